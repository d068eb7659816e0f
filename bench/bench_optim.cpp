// lockstep-bench-optim: one optimizer step over ResNet-50's 161 tensors (25,557,032 parameters),
// against the memory bandwidth measured in the same run and against torch.optim.SGD(foreach=True).
//
//   lockstep-bench-optim [--threads N] [--ranks R] [--rounds K] [--python PATH] [--no-torch] [--json]
//
// Rows (optimizer x mode):
//   sgd, lars       update        optim::update alone: no communication
//   sgd, lars       step          optim::step on R in-process ranks (threads): all_reduce whose
//                                 epilogue is the update; every rank updates every tensor
//   sgd, lars       step_sharded  optim::step_sharded (only with R > 1)
//   torch_sgd_foreach update      torch.optim.SGD(foreach=True), momentum 0.9, weight decay 1e-4,
//                                 on the same sizes with torch.set_num_threads(N) (bench/torch_sgd.py)
// effective_gbs counts the bytes a perfect implementation must move, 20 B per parameter for SGD
// with momentum (read w, g, v; write w, v) and the same for LARS (its norms fused into passes that
// read w and g anyway), times the ranks that update (R for step, 1 in all for step_sharded).
// memcpy_gbs is a parallel memcpy of 128 MiB on the same threads, counted as bytes read plus
// bytes written, the same way. memcpy also reads each destination line before writing it (write
// allocate) unless it streams, which the count does not see; triad_gbs is therefore given beside
// it: x[i] = x[i] + s·y[i] in place over 2 x 128 MiB, 12 B per element, the same read-modify-write
// pattern as an optimizer step. Measurements of memcpy, triad, the lockstep updates and torch are
// interleaved round by round, so a neighbour's load on a shared machine touches them alike; each
// figure is the median over the rounds.
#include <lockstep/lockstep.hpp>
#include <lockstep/optim.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "resnet50_shapes.hpp"

#ifndef LOCKSTEP_TORCH_SGD_SCRIPT
#define LOCKSTEP_TORCH_SGD_SCRIPT "bench/torch_sgd.py"
#endif

namespace {

using namespace lockstep;
using bench_clock = std::chrono::steady_clock;

struct options {
  unsigned threads = 0;  // 0: one per hardware thread
  int ranks = 1;
  int rounds = 9;
  std::string python;  // "": /usr/bin/python3, then python3
  bool torch = true;
  bool json = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "lockstep-bench-optim: %s\n"
               "usage: lockstep-bench-optim [--threads N] [--ranks R] [--rounds K] [--python PATH] [--no-torch] [--json]\n",
               why);
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    auto number = [&](long lo) {
      const std::string v = value();
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (*end || x < lo) usage(("bad value for " + a + ": " + v).c_str());
      return x;
    };
    if (a == "--threads") o.threads = static_cast<unsigned>(number(1));
    else if (a == "--ranks") o.ranks = static_cast<int>(number(1));
    else if (a == "--rounds") o.rounds = static_cast<int>(number(1));
    else if (a == "--python") o.python = value();
    else if (a == "--no-torch") o.torch = false;
    else if (a == "--json") o.json = true;
    else if (a == "--help" || a == "-h") usage("help");
    else usage(("unknown argument " + a).c_str());
  }
  if (o.threads == 0) o.threads = std::max(1u, std::thread::hardware_concurrency());
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double seconds_since(bench_clock::time_point t0) {
  return std::chrono::duration<double>(bench_clock::now() - t0).count();
}

// ---- torch peer: bench/torch_sgd.py over two pipes ----------------------------------------------
class torch_peer {
 public:
  // Starts `python script --threads N`, sends the sizes, waits for "ready". false: not available.
  bool start(const std::string& python, unsigned threads, const std::vector<std::size_t>& sizes, std::string& why) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) {
      why = "pipe failed";
      return false;
    }
    const std::string th = std::to_string(threads);
    pid_ = fork();
    if (pid_ < 0) {
      why = "fork failed";
      return false;
    }
    if (pid_ == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);
      close(from_child[0]);
      execlp(python.c_str(), python.c_str(), LOCKSTEP_TORCH_SGD_SCRIPT, "--threads", th.c_str(), (char*)nullptr);
      std::printf("error cannot run %s\n", python.c_str());
      std::fflush(stdout);
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    out_ = fdopen(to_child[1], "w");
    in_ = fdopen(from_child[0], "r");
    std::string cmd = "sizes";
    for (std::size_t n : sizes) cmd += " " + std::to_string(n);
    send(cmd);
    const std::string r = line();
    if (r.rfind("ready", 0) != 0) {
      why = r.empty() ? "no answer" : r;
      stop();
      return false;
    }
    version_ = r.substr(6);
    return true;
  }
  double step_us() {
    send("step");
    const std::string r = line();
    if (r.rfind("time_us ", 0) != 0) return -1;
    return std::strtod(r.c_str() + 8, nullptr);
  }
  const std::string& version() const { return version_; }
  void stop() {
    if (pid_ <= 0) return;
    if (out_) {
      std::fputs("quit\n", out_);
      std::fclose(out_);
      out_ = nullptr;
    }
    if (in_) {
      std::fclose(in_);
      in_ = nullptr;
    }
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  ~torch_peer() { stop(); }

 private:
  void send(const std::string& s) {
    std::fputs((s + "\n").c_str(), out_);
    std::fflush(out_);
  }
  std::string line() {
    std::string s;
    for (int c; (c = std::fgetc(in_)) != EOF && c != '\n';) s += static_cast<char>(c);
    return s;
  }
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  FILE* in_ = nullptr;
  std::string version_;
};

// ---- results ------------------------------------------------------------------------------------
struct row {
  std::string optimizer, mode;
  int ranks;
  double time_us, bytes;
};

void fill(std::span<float> x, float scale, std::uint32_t seed, thread_pool& pool) {
  const std::size_t task = 1 << 20;
  pool.parallel_for((x.size() + task - 1) / task, [&](std::size_t t) {
    std::uint32_t h = seed * 2654435761u + static_cast<std::uint32_t>(t);
    for (std::size_t i = t * task; i < std::min(x.size(), (t + 1) * task); ++i) {
      h = h * 1664525u + 1013904223u;
      x[i] = scale * (static_cast<float>(h >> 8) * (1.0f / 16777216.0f) - 0.5f);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse(argc, argv);
  signal(SIGPIPE, SIG_IGN);

  const auto shapes = bench::resnet50_shapes();
  std::vector<std::size_t> sizes;
  std::vector<bool> exempt;
  for (const auto& s : shapes) {
    sizes.push_back(s.size());
    exempt.push_back(s.exempt);
  }
  const auto ps = optim::param_set::packed(sizes, exempt);
  const std::size_t n = ps.size();
  const double params = static_cast<double>(ps.params());
  thread_pool pool(opt.threads);

  const optim::sgd sgd{.momentum = 0.9f, .weight_decay = 1e-4f};
  const optim::lars lars = optim::mlperf_resnet50::optimizer();

  torch_peer torch;
  bool have_torch = false;
  if (opt.torch) {
    std::vector<std::string> pythons = opt.python.empty() ? std::vector<std::string>{"/usr/bin/python3", "python3"}
                                                           : std::vector<std::string>{opt.python};
    std::string why;
    for (const auto& py : pythons) {
      if (torch.start(py, opt.threads, sizes, why)) {
        have_torch = true;
        break;
      }
    }
    if (!have_torch) std::fprintf(stderr, "lockstep-bench-optim: no torch peer (%s); its row is left out\n", why.c_str());
  }

  // ---- phase 1: memcpy, update alone, torch; interleaved rounds --------------------------------
  std::vector<float> w(n), g(n);
  fill(w, 0.2f, 1, pool);
  fill(g, 0.02f, 2, pool);
  optim::state st_sgd(ps, sgd), st_lars(ps, lars);
  const std::size_t copy_elems = (std::size_t{128} << 20) / sizeof(float);
  std::vector<float> src(copy_elems), dst(copy_elems);
  fill(src, 1.0f, 3, pool);
  fill(dst, 1.0f, 4, pool);
  auto time_memcpy = [&] {
    const std::size_t tasks = 8 * pool.size(), per = (copy_elems + tasks - 1) / tasks;
    const auto t0 = bench_clock::now();
    pool.parallel_for(tasks, [&](std::size_t t) {
      const std::size_t a = std::min(copy_elems, t * per), b = std::min(copy_elems, a + per);
      std::memcpy(dst.data() + a, src.data() + a, (b - a) * sizeof(float));
    });
    return seconds_since(t0);
  };
  volatile float triad_scale = 1e-3f;
  auto time_triad = [&] {
    const std::size_t tasks = 8 * pool.size(), per = (copy_elems + tasks - 1) / tasks;
    const float k = triad_scale;
    const auto t0 = bench_clock::now();
    pool.parallel_for(tasks, [&](std::size_t t) {
      const std::size_t a = std::min(copy_elems, t * per), b = std::min(copy_elems, a + per);
      float* LOCKSTEP_RESTRICT x = dst.data();
      const float* LOCKSTEP_RESTRICT y = src.data();
      for (std::size_t i = a; i < b; ++i) x[i] = x[i] + k * y[i];
    });
    return seconds_since(t0);
  };
  auto time_update = [&](const auto& o, optim::state& st) {
    const auto t0 = bench_clock::now();
    optim::update(o, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = 0.01f}, {}, pool);
    return seconds_since(t0);
  };
  // What is timed is checked once, untimed: one SGD step from a fresh state against torch's
  // formula in double (first step: v = g + weight_decay * w; w -= lr * v), every element of every
  // tensor, so that a fast but wrong update cannot be reported as fast.
  {
    std::vector<float> w1 = w;
    optim::state st(ps, sgd);
    optim::update(sgd, ps, std::span<float>(w1), std::span<const float>(g), st, {.lr = 0.01f}, {}, pool);
    for (const auto& t : ps.tensors())
      for (std::size_t i = t.offset; i < t.offset + t.size; ++i) {
        const double want = double(w[i]) - 0.01 * (double(g[i]) + 1e-4 * double(w[i]));
        // fp32 rounding, relative to the operands' size (a result near 0 is the difference of two)
        const double tol = 1e-6 * (std::abs(double(w[i])) + 0.01 * std::abs(double(g[i]))) + 1e-30;
        if (!(std::abs(w1[i] - want) <= tol)) {
          std::fprintf(stderr, "lockstep-bench-optim: the SGD update gave %.9g at element %zu, torch's formula %.9g\n",
                       double(w1[i]), i, want);
          return 1;
        }
      }
  }
  std::vector<double> t_copy, t_triad, t_sgd, t_lars, t_torch;
  for (int r = -1; r < opt.rounds; ++r) {  // round -1 warms up: page faults, momentum first touch
    const double a = time_memcpy(), e = time_triad(), b = time_update(sgd, st_sgd), c = time_update(lars, st_lars);
    const double d = have_torch ? torch.step_us() * 1e-6 : 0.0;
    if (r < 0) continue;
    t_copy.push_back(a);
    t_triad.push_back(e);
    t_sgd.push_back(b);
    t_lars.push_back(c);
    if (have_torch) t_torch.push_back(d);
  }
  const std::string torch_version = have_torch ? torch.version() : "";
  torch.stop();
  src = {};
  dst = {};
  const double memcpy_gbs = 2.0 * copy_elems * sizeof(float) / median(t_copy) * 1e-9;
  const double triad_gbs = 3.0 * copy_elems * sizeof(float) / median(t_triad) * 1e-9;

  std::vector<row> rows;
  rows.push_back({"sgd", "update", 1, median(t_sgd) * 1e6, 20 * params});
  rows.push_back({"lars", "update", 1, median(t_lars) * 1e6, 20 * params});
  if (have_torch) rows.push_back({"torch_sgd_foreach", "update", 1, median(t_torch) * 1e6, 20 * params});
  w = {};
  g = {};

  // ---- phase 2: fused steps on R in-process ranks ------------------------------------------------
  std::vector<float> g0(n);  // every rank's gradients, refilled before each step (sums grow)
  fill(g0, 0.02f, 5, pool);
  const int R = opt.ranks;
  std::vector<double> s_sgd, s_lars, h_sgd, h_lars;
  std::barrier sync(R);
  run_inproc(R, [&](group<transport::inproc>& grp) {
    std::vector<float> wr(n), gr(n);
    fill(wr, 0.2f, 1, pool);
    optim::state a(ps, sgd), b(ps, lars), c, d;
    if (R > 1) {
      c = optim::state(ps, sgd);
      d = optim::state(ps, lars);
    }
    codec::fp32 codec;
    topology::ring ring;
    auto timed = [&](auto&& fn, std::vector<double>& out, bool record) {
      std::copy(g0.begin(), g0.end(), gr.begin());
      sync.arrive_and_wait();
      const auto t0 = bench_clock::now();
      fn();
      sync.arrive_and_wait();
      if (grp.rank() == 0 && record) out.push_back(seconds_since(t0));
    };
    const optim::plan<optim::sgd> pa{.opt = sgd, .params = ps, .st = a, .weights = wr, .grads = gr, .pool = pool};
    const optim::plan<optim::lars> pb{.opt = lars, .params = ps, .st = b, .weights = wr, .grads = gr, .pool = pool};
    const optim::plan<optim::sgd> pc{.opt = sgd, .params = ps, .st = c, .weights = wr, .grads = gr, .pool = pool};
    const optim::plan<optim::lars> pd{.opt = lars, .params = ps, .st = d, .weights = wr, .grads = gr, .pool = pool};
    for (int r = -1; r < opt.rounds; ++r) {
      const bool rec = r >= 0;
      timed([&] { optim::step(grp, ring, codec, pa, 0.01f); }, s_sgd, rec);
      timed([&] { optim::step(grp, ring, codec, pb, 0.01f); }, s_lars, rec);
      if (R > 1) {
        timed([&] { optim::step_sharded(grp, ring, codec, pc, 0.01f); }, h_sgd, rec);
        timed([&] { optim::step_sharded(grp, ring, codec, pd, 0.01f); }, h_lars, rec);
      }
    }
  });
  rows.push_back({"sgd", "step", R, median(s_sgd) * 1e6, 20 * params * R});
  rows.push_back({"lars", "step", R, median(s_lars) * 1e6, 20 * params * R});
  if (R > 1) {
    rows.push_back({"sgd", "step_sharded", R, median(h_sgd) * 1e6, 20 * params});
    rows.push_back({"lars", "step_sharded", R, median(h_lars) * 1e6, 20 * params});
  }

  // ---- report --------------------------------------------------------------------------------
  if (!opt.json) {
    std::printf("lockstep-bench-optim: ResNet-50, %zu tensors, %.0f parameters, %u threads, %d rounds (median)\n",
                ps.tensor_count(), params, pool.size(), opt.rounds);
    std::printf("memcpy: %.2f GB/s, triad in place: %.2f GB/s (bytes read + written)%s%s\n", memcpy_gbs, triad_gbs,
                have_torch ? "; torch " : "", torch_version.c_str());
    std::printf("%-18s %-13s %5s %10s %10s %9s %8s %7s\n", "optimizer", "mode", "ranks", "time_ms", "Mparam/s",
                "eff_GB/s", "%memcpy", "%triad");
  }
  for (const row& r : rows) {
    const double gbs = r.bytes / (r.time_us * 1e-6) * 1e-9;
    const double mps = params * (r.mode == "step" ? r.ranks : 1) / (r.time_us * 1e-6) * 1e-6;
    if (opt.json)
      std::printf("{\"optimizer\":\"%s\",\"mode\":\"%s\",\"params\":%.0f,\"tensors\":%zu,\"threads\":%u,\"ranks\":%d,"
                  "\"time_us\":%.1f,\"effective_gbs\":%.3f,\"memcpy_gbs\":%.3f,\"triad_gbs\":%.3f}\n",
                  r.optimizer.c_str(), r.mode.c_str(), params, ps.tensor_count(), pool.size(), r.ranks, r.time_us, gbs,
                  memcpy_gbs, triad_gbs);
    else
      std::printf("%-18s %-13s %5d %10.2f %10.1f %9.2f %7.0f%% %6.0f%%\n", r.optimizer.c_str(), r.mode.c_str(),
                  r.ranks, r.time_us * 1e-3, mps, gbs, 100.0 * gbs / memcpy_gbs, 100.0 * gbs / triad_gbs);
  }
  if (!opt.json && have_torch) {
    const double ours = rows[0].time_us, theirs = rows[2].time_us;
    std::printf("sgd update vs torch foreach: %.2fx\n", theirs / ours);
  }
  return 0;
}
