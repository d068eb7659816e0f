// lockstep-bench-codec: how fast each codec turns fp32 into wire bytes and back, on one core,
// beside memcpy of a buffer of the same size measured in the same run, and how much it loses.
//
//   lockstep-bench-codec [--codec all|fp32|bf16|int8|dyntree8] [--sizes 64K,1M,64M] [--iters N]
//                        [--block B] [--feedback] [--json]
//
// Rates are fp32 bytes processed per second: encode_gbs = 4n / t(encode), decode_add_gbs =
// 4n / t(decode_add), roundtrip_gbs = 4n / (t(encode) + t(decode_add)); memcpy_gbs = 4n / t(memcpy
// of 4n bytes). Each timing is the median of --iters rounds over a rotation of buffers that together
// exceed the last-level cache, so that a large size measures memory, not cache. A round times
// encode, decode-add and memcpy one after the other (each from its own place in the rotation, in
// an order that turns with the round), so that the three see the same moment of a
// shared machine; roundtrip_vs_memcpy (the table's rt/cpy) is the median over rounds of that
// round's ratio (the figure issue targets are read from), not a ratio of medians taken at
// different moments. Errors are the mean
// and max of |decode(encode(x)) - x| / |x| over x ~ N(0, 1) (and, in the table, Student-t with 2
// degrees of freedom for heavy tails).
#include <lockstep/codec.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace lockstep;

namespace {

std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string unit(end);
  if (unit == "K" || unit == "KiB") v *= 1024;
  else if (unit == "M" || unit == "MiB") v *= 1024 * 1024;
  else if (unit == "G" || unit == "GiB") v *= 1024.0 * 1024 * 1024;
  else if (!unit.empty()) {
    std::fprintf(stderr, "lockstep-bench-codec: bad size '%s' (use e.g. 64K, 1M, 64M)\n", s.c_str());
    std::exit(2);
  }
  return static_cast<std::size_t>(v);
}

std::vector<std::size_t> parse_sizes(const std::string& list) {
  std::vector<std::size_t> out;
  std::size_t a = 0;
  while (a <= list.size()) {
    auto b = list.find(',', a);
    if (b == std::string::npos) b = list.size();
    if (b > a) out.push_back(parse_size(list.substr(a, b - a)));
    a = b + 1;
  }
  return out;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct errors {
  double mean = 0, max = 0;
};

template <class C>
errors measure_error(const C& c, const std::vector<float>& x) {
  std::vector<std::byte> w(c.wire_bytes(x.size()));
  std::vector<float> y(x.size());
  c.encode(x.data(), x.size(), w.data());
  c.decode(w.data(), x.size(), y.data());
  // What the rounds below time is checked once here: decode_add must give acc + decode bit for
  // bit (the executor's reduce-scatter relies on it), so that a fast but wrong path cannot be
  // reported as fast.
  std::vector<float> acc(x.size()), want(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    acc[i] = 0.5f * x[(i * 7) % x.size()];
    want[i] = acc[i] + y[i];
  }
  c.decode_add(w.data(), x.size(), acc.data());
  for (std::size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(&acc[i], &want[i], sizeof(float)) != 0) {
      std::fprintf(stderr, "lockstep-bench-codec: %s: decode_add gave %.9g at element %zu, decode + add %.9g\n",
                   std::string(c.name()).c_str(), acc[i], i, want[i]);
      std::exit(1);
    }
  errors e;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double r = std::abs(double(y[i]) - x[i]) / std::abs(double(x[i]));
    e.mean += r;
    e.max = std::max(e.max, r);
  }
  e.mean /= static_cast<double>(x.size());
  return e;
}

struct options {
  std::string codec = "all";
  std::vector<std::size_t> sizes = parse_sizes("64K,1M,16M,64M");
  int iters = 7;
  std::size_t block = 512;
  bool json = false;
  bool feedback = false;
};

template <class C>
void run(const char* name, const C& c, const options& o, const std::vector<float>& gauss,
         const std::vector<float>& heavy) {
  const errors eg = measure_error(c, gauss), eh = measure_error(c, heavy);
  for (std::size_t bytes : o.sizes) {
    const std::size_t n = std::max<std::size_t>(1, bytes / sizeof(float));
    // Enough buffers that one pass over all of them is >= 256 MiB, at most 64: from 4 MiB up no
    // size is served from cache; below that (64 buffers of 1 MiB are 64 MiB) partly.
    const std::size_t nbuf = std::max<std::size_t>(2, (std::size_t{256} << 20) / (n * sizeof(float)) + 1);
    const std::size_t rot = std::min<std::size_t>(nbuf, 64);
    std::vector<std::vector<float>> in(rot, std::vector<float>(n)), acc(rot, std::vector<float>(n, 0.0f));
    std::vector<std::vector<std::byte>> wire(rot, std::vector<std::byte>(c.wire_bytes(n)));
    std::vector<std::vector<float>> dst(rot, std::vector<float>(n));
    for (std::size_t b = 0; b < rot; ++b)
      for (std::size_t i = 0; i < n; ++i) in[b][i] = gauss[(i + b * 7919) % gauss.size()];
    const std::size_t reps = std::max<std::size_t>(1, (std::size_t{64} << 20) / (n * sizeof(float)));
    // Each round: reps encodes, reps decode-adds, reps memcpys, in an order that turns with the
    // round, each starting at its own place in the rotation (decode-add half of it ahead of
    // encode, memcpy two thirds): at 64 MiB (5 buffers, one per round) none touches what another
    // has just left in cache, and decode-add reads wire bytes encoded rounds earlier (all are
    // encoded once before timing starts). Below 4 MiB every op sweeps the whole rotation each
    // round, so what one op wrote is read tens of MiB later by the next: past the 32 MiB L3 from
    // 1 MiB up, partly in cache below that.
    for (std::size_t b = 0; b < rot; ++b) c.encode(in[b].data(), n, wire[b].data());
    std::vector<double> t_enc, t_dec, t_cpy, ratio;
    for (int it = 0; it < o.iters; ++it) {
      auto buffer = [&](std::size_t r, std::size_t ahead) { return (static_cast<std::size_t>(it) * reps + r + ahead) % rot; };
      double e = 0, d = 0, m = 0;
      auto run_encode = [&] {
        e = seconds([&] { for (std::size_t r = 0; r < reps; ++r) c.encode(in[buffer(r, 0)].data(), n, wire[buffer(r, 0)].data()); });
      };
      auto run_decode = [&] {
        d = seconds([&] {
          for (std::size_t r = 0; r < reps; ++r) c.decode_add(wire[buffer(r, rot / 2)].data(), n, acc[buffer(r, rot / 2)].data());
        });
      };
      auto run_memcpy = [&] {
        m = seconds([&] {
          for (std::size_t r = 0; r < reps; ++r) {
            const std::size_t b = buffer(r, 2 * rot / 3);
            std::memcpy(dst[b].data(), in[b].data(), n * sizeof(float));
          }
        });
      };
      switch (it % 3) {
        case 0: run_encode(), run_decode(), run_memcpy(); break;
        case 1: run_decode(), run_memcpy(), run_encode(); break;
        default: run_memcpy(), run_encode(), run_decode(); break;
      }
      t_enc.push_back(e / static_cast<double>(reps));
      t_dec.push_back(d / static_cast<double>(reps));
      t_cpy.push_back(m / static_cast<double>(reps));
      ratio.push_back(m / (e + d));  // roundtrip rate / memcpy rate in this round
    }
    const double gb = static_cast<double>(n * sizeof(float)) / 1e9;
    const double enc = gb / median(t_enc), dec = gb / median(t_dec), cpy = gb / median(t_cpy);
    const double rt = gb / (median(t_enc) + median(t_dec)), rt_vs_cpy = median(ratio);
    if (o.json) {
      std::printf("{\"codec\":\"%s\",\"bytes\":%zu,\"encode_gbs\":%.3f,\"decode_add_gbs\":%.3f,\"roundtrip_gbs\":%.3f,"
                  "\"memcpy_gbs\":%.3f,\"roundtrip_vs_memcpy\":%.3f,\"mean_rel_err\":%.6g,\"max_rel_err\":%.6g,\"block\":%zu,"
                  "\"heavy_mean_rel_err\":%.6g,\"heavy_max_rel_err\":%.6g}\n",
                  name, n * sizeof(float), enc, dec, rt, cpy, rt_vs_cpy, eg.mean, eg.max, c.block(), eh.mean, eh.max);
    } else {
      std::printf("%-9s %10zu %9.2f %9.2f %9.2f %9.2f %7.0f%% %10.2e %10.2e %10.2e %10.2e\n", name, n * sizeof(float),
                  enc, dec, rt, cpy, 100.0 * rt_vs_cpy, eg.mean, eg.max, eh.mean, eh.max);
    }
    std::fflush(stdout);
  }
}

// --feedback: error feedback's encode step (v = x + r, wire = C(v), r = v - decode(wire)) as
// error_feedback<C> runs it (fused per block for int8 and dyntree8: blockwise::encode_feedback)
// against the same step in four passes (error_feedback<C>::encode_in_passes), both over a rotation
// as above, alternating within each round. Rates are fp32 bytes of x per second.
template <class C>
void run_feedback(const char* name, const C& c, const options& o, const std::vector<float>& gauss) {
  for (std::size_t bytes : o.sizes) {
    const std::size_t n = std::max<std::size_t>(1, bytes / sizeof(float));
    const std::size_t rot = std::min<std::size_t>(std::max<std::size_t>(2, (std::size_t{256} << 20) / (n * sizeof(float)) + 1), 64);
    std::vector<std::vector<float>> in(rot, std::vector<float>(n)), res(rot, std::vector<float>(n, 0.0f));
    std::vector<std::vector<std::byte>> wire(rot, std::vector<std::byte>(c.wire_bytes(n)));
    for (std::size_t b = 0; b < rot; ++b)
      for (std::size_t i = 0; i < n; ++i) in[b][i] = gauss[(i + b * 7919) % gauss.size()];
    const std::size_t reps = std::max<std::size_t>(1, (std::size_t{64} << 20) / (n * sizeof(float)));
    codec::error_feedback<C> ef(c);
    std::vector<double> t_fused, t_passes, ratio;
    for (int it = 0; it < o.iters; ++it) {
      auto buffer = [&](std::size_t r, std::size_t ahead) { return (static_cast<std::size_t>(it) * reps + r + ahead) % rot; };
      double f = 0, p = 0;
      auto fused = [&] {
        f = seconds([&] {
          for (std::size_t r = 0; r < reps; ++r) {
            const std::size_t b = buffer(r, 0);
            ef.encode_with_residual(in[b].data(), n, wire[b].data(), res[b].data());
          }
        });
      };
      auto passes = [&] {
        p = seconds([&] {
          for (std::size_t r = 0; r < reps; ++r) {
            const std::size_t b = buffer(r, rot / 2);
            codec::error_feedback<C>::encode_in_passes(c, in[b].data(), n, wire[b].data(), res[b].data());
          }
        });
      };
      if (it % 2) fused(), passes();
      else passes(), fused();
      t_fused.push_back(f / static_cast<double>(reps));
      t_passes.push_back(p / static_cast<double>(reps));
      ratio.push_back(p / f);
    }
    const double gb = static_cast<double>(n * sizeof(float)) / 1e9;
    if (o.json)
      std::printf("{\"codec\":\"%s+ef\",\"bytes\":%zu,\"ef_encode_gbs\":%.3f,\"ef_passes_gbs\":%.3f,\"speedup\":%.3f,"
                  "\"block\":%zu}\n",
                  name, n * sizeof(float), gb / median(t_fused), gb / median(t_passes), median(ratio), c.block());
    else
      std::printf("%-12s %10zu %12.2f %12.2f %8.2fx\n", name, n * sizeof(float), gb / median(t_fused), gb / median(t_passes),
                  median(ratio));
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "lockstep-bench-codec: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--codec") o.codec = next();
    else if (a == "--sizes") o.sizes = parse_sizes(next());
    else if (a == "--iters") o.iters = std::max(1, std::atoi(next().c_str()));
    else if (a == "--block") o.block = static_cast<std::size_t>(std::atol(next().c_str()));
    else if (a == "--json") o.json = true;
    else if (a == "--feedback") o.feedback = true;
    else {
      std::printf("usage: lockstep-bench-codec [--codec all|fp32|bf16|int8|dyntree8] [--sizes 64K,1M,64M]\n"
                  "                            [--iters N] [--block B] [--feedback] [--json]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  std::mt19937 g(42);
  std::normal_distribution<float> nd;
  std::student_t_distribution<float> td(2.0f);
  std::vector<float> gauss(1 << 20), heavy(1 << 20);
  for (auto& v : gauss) v = nd(g);
  for (auto& v : heavy) v = td(g);
  auto want = [&](const char* c) { return o.codec == "all" || o.codec == c; };
  if (o.feedback) {
    if (!o.json) std::printf("%-12s %10s %12s %12s %9s\n", "codec", "bytes", "ef GB/s", "passes GB/s", "speedup");
    if (want("int8")) run_feedback("int8", codec::int8{o.block}, o, gauss);
    if (want("dyntree8")) run_feedback("dyntree8", codec::dyntree8{o.block}, o, gauss);
    return 0;
  }
  if (!o.json)
    std::printf("%-9s %10s %9s %9s %9s %9s %8s %10s %10s %10s %10s\n", "codec", "bytes", "enc GB/s", "dec+ GB/s",
                "rt GB/s", "memcpy", "rt/cpy", "N01 mean", "N01 max", "t2 mean", "t2 max");
  if (want("fp32")) run("fp32", codec::fp32{}, o, gauss, heavy);
  if (want("bf16")) run("bf16", codec::bf16{}, o, gauss, heavy);
  if (want("int8")) run("int8", codec::int8{o.block}, o, gauss, heavy);
  if (want("dyntree8")) run("dyntree8", codec::dyntree8{o.block}, o, gauss, heavy);
  return 0;
}
