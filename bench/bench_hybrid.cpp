// lockstep-bench-hybrid: one training step of the big FC head (Krizhevsky's "one weird trick"
// setting: features F -> H1 -> H2 -> NC, ReLU between), data-parallel against hybrid, with the bytes
// every rank puts on the wire per step (transport::counting) and the step time.
//
//   lockstep-bench-hybrid [--ranks 4] [--batch 32] [--features 2048] [--fc 4096,4096] [--classes 10]
//                         [--modes dp-fp32,dp-dyntree8,a-fp32,b-dyntree8,...] [--iters 5] [--threads T] [--json]
//                         [--predict-gbit G [--latency-us A] [--exchange-efficiency E] [--calibrate]
//                          [--burst-bytes B --burst-gbit R] [--cores-per-rank C]] [--comm-only]
//   mpirun -np 4 lockstep-bench-hybrid --transport mpi ...       (bench/netlab --bench-args runs this)
//
// Modes: dp-<codec>: every rank holds the whole head, computes on its --batch rows and all-reduces
// the head's gradients (one async all-reduce per layer as backward produces it, ring, <codec>);
// <a|b|c>-<codec>: parallel::column_linear (fc1) and row_linear (fc2) with scheme gather_all /
// by_rank / by_slice and <codec> activations, the classifier data-parallel (its gradients
// all-reduced in fp32). Same global batch (ranks x --batch) in every mode. The convolutions of the
// model, identical in both modes and about 1% of the bytes, are not part of this step. Products
// on oneDNN (dnnl_sgemm). Times: median over --iters steps after one warm-up step; bytes: one
// step, data and headers, this rank's sends (the same on every rank up to the uneven splits).
// --predict-gbit: beside each row the simulator's step (sim/hybrid.hpp) on links of G Gbit/s
// (default α 0 and η 0.699, netlab's fit in docs/scaling.md), with the products at the rate of
// the step's own products measured on this rank while every rank runs them, in the shapes of the
// mode's scheme (measure_step_rate; the GFLOP/s column), and the codecs' measured rates.
// --calibrate takes α and the per-message overhead o from small messages on this very group
// instead (the all-reduces at 4 KiB, 64 KiB and 1 MiB and the segment test of
// calibrate_automatic, before any step is timed, so the steps stay out of sample), and α while
// every rank's products run (measure_busy_latency_us), which the model gives a collective for the
// part of its time it runs beside the products where the cores are shared (JSON predicted_ms;
// predicted_idle_ms without it); the bandwidth stays --predict-gbit's. --burst-bytes /
// --burst-gbit: the links' token bucket (netlab's tbf: 262144 bytes at 1 Gbit/s; 4.2 Gbit/s is
// the rate its bytes leave at in docs/scaling.md's fit).
// --cores-per-rank (default: hardware threads / ranks, as --threads assumes the ranks share this
// machine; 0: a core for each lane): below the product threads + 1, a collective's CPU part
// delays the products it runs beside (sim::host_cores). --comm-only: the steps without their
// products, the collectives alone, to set beside the model's comm column (JSON sim_comm_ms; the
// skipped products leave zeros, so a lossy codec encodes zeros, which its measured rates do not).
#include <lockstep/lockstep.hpp>
#include <lockstep/sim/hybrid.hpp>
#include <lockstep/transport/counting.hpp>

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if LOCKSTEP_HAVE_MPI
#include <lockstep/transport/mpi.hpp>
#endif
#include "cli.hpp"  // split_list, with or without MPI

using namespace lockstep;

namespace {

struct options {
  std::string transport = "inproc";
  int ranks = 4;
  std::size_t batch = 32, F = 2048, H1 = 4096, H2 = 4096, NC = 10;
  std::vector<std::string> modes = {"dp-fp32", "dp-dyntree8", "a-fp32", "a-dyntree8", "b-fp32", "b-dyntree8", "c-fp32",
                                    "c-int8", "c-dyntree8"};
  int iters = 5;
  int threads = 0;  // oneDNN (OpenMP) threads per rank; 0: hardware threads / ranks, at least 1
  double predict_gbit = 0;  // > 0: also the simulator's step (sim/hybrid.hpp) on links of this rate
  double latency_us = 0, exchange_efficiency = 0.699;  // netlab's fitted link (docs/scaling.md)
  double overhead_us = 0;  // o per message posted and read (sim::link_params::overhead_s)
  double busy_latency_us = -1;  // --calibrate: α measured while the products run (sim::host_cores; -1: not measured)
  double cores_per_rank = -1;   // sim::host_cores; < 0: hardware threads / ranks (the ranks share this machine)
  bool calibrate = false;  // α and o from calibrate_automatic on this group
  double burst_bytes = 0;  // the links' token bucket (netlab's tbf burst: 262144 at 1 Gbit/s)
  double burst_gbit = 0;   // how fast the bucket's bytes leave (0: at once; netlab's fit: 4.2)
  bool comm_only = false;  // the steps without their products (measure_step_rate still multiplies)
  bool json = false;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "lockstep-bench-hybrid: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--transport") o.transport = next();
    else if (a == "--ranks") o.ranks = std::atoi(next().c_str());
    else if (a == "--batch") o.batch = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--features") o.F = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--fc") {
      const auto v = lockstep::bench::split_list(next());
      if (v.size() != 2) std::fprintf(stderr, "lockstep-bench-hybrid: --fc wants H1,H2\n"), std::exit(2);
      o.H1 = std::strtoull(v[0].c_str(), nullptr, 10), o.H2 = std::strtoull(v[1].c_str(), nullptr, 10);
    } else if (a == "--classes") o.NC = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--modes") o.modes = lockstep::bench::split_list(next());
    else if (a == "--iters") o.iters = std::max(1, std::atoi(next().c_str()));
    else if (a == "--threads") o.threads = std::atoi(next().c_str());
    else if (a == "--predict-gbit") o.predict_gbit = std::atof(next().c_str());
    else if (a == "--latency-us") o.latency_us = std::atof(next().c_str());
    else if (a == "--exchange-efficiency") o.exchange_efficiency = std::atof(next().c_str());
    else if (a == "--overhead-us") o.overhead_us = std::atof(next().c_str());
    else if (a == "--cores-per-rank") o.cores_per_rank = std::atof(next().c_str());
    else if (a == "--comm-only") o.comm_only = true;
    else if (a == "--burst-bytes") o.burst_bytes = std::atof(next().c_str());
    else if (a == "--burst-gbit") o.burst_gbit = std::atof(next().c_str());
    else if (a == "--calibrate") o.calibrate = true;
    else if (a == "--json") o.json = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: lockstep-bench-hybrid [--transport inproc|mpi] [--ranks N] [--batch B] [--features F]\n"
                  "       [--fc H1,H2] [--classes NC] [--modes dp-fp32,a-dyntree8,...] [--iters N] [--json]\n"
                  "       [--predict-gbit G [--latency-us A] [--overhead-us O] [--exchange-efficiency E] [--calibrate]\n"
                  "        [--burst-bytes B --burst-gbit R] [--cores-per-rank C]] [--comm-only]\n");
      std::exit(0);
    } else {
      std::fprintf(stderr, "lockstep-bench-hybrid: unknown flag %s (--help)\n", a.c_str());
      std::exit(2);
    }
  }
  return o;
}

// --comm-only: every product skipped (the step's collectives alone, to set beside the model's).
thread_local bool skip_products = false;  // per rank: in-process ranks are threads

void sgemm(const parallel::gemm_args& a) {
  if (a.m == 0 || a.n == 0 || skip_products) return;
  if (dnnl_sgemm(a.trans_a ? 'T' : 'N', a.trans_b ? 'T' : 'N', static_cast<dnnl_dim_t>(a.m), static_cast<dnnl_dim_t>(a.n),
                 static_cast<dnnl_dim_t>(a.k), 1.0f, a.a, static_cast<dnnl_dim_t>(a.lda), a.b,
                 static_cast<dnnl_dim_t>(a.ldb), a.beta, a.c, static_cast<dnnl_dim_t>(a.ldc)) != dnnl_success)
    throw std::runtime_error("dnnl_sgemm failed");
}

void relu_fwd(float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] = y[i] > 0 ? y[i] : 0;
}
void relu_bwd(float* dy, const float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (!(y[i] > 0)) dy[i] = 0;
}

float value(std::uint64_t seed, std::size_t i) {
  std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1p-53 - 0.5) * 0.05f;
}

// The bench checks once per mode, after a step, that the step it times computes the head: a fast
// but wrong path cannot be reported as fast. The reference is this rank's own, from weights every
// rank can generate (rank k's slices are value(2 + 16 k, .) and value(3 + 16 k, .)): fp32 must
// agree up to the order of summation; a lossy codec within a loose bound that still catches the
// wiring (a wrong rank's rows, a partial sum missing: errors of the order of the values), not the
// codecs' own bounds, which tests/ check.
double check_tolerance(const std::string& codec_name) {
  return codec_name == "fp32" ? 1e-4 : codec_name == "bf16" ? 2e-2 : 0.1;
}

void check_close(const std::string& mode, const char* what, int rank, const std::vector<float>& got,
                 const std::vector<float>& ref, double tolerance) {
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(ref[i])));
    const double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    err = d == d ? std::max(err, d) : HUGE_VAL;  // NaN: fails
  }
  if (got.size() != ref.size() || !(err <= tolerance * scale))
    throw std::runtime_error("self-check failed: " + mode + " on rank " + std::to_string(rank) + ": " + what +
                             " is off the reference by " + std::to_string(scale > 0 ? err / scale : err) +
                             " of its largest value (allowed " + std::to_string(tolerance) + ")");
}

struct row {
  std::string mode;
  double step_ms = 0;
  transport::traffic sent;
  double predicted_ms = 0;  // the simulator's, with --predict-gbit
  double predicted_idle_ms = 0;  // the same without the busy α (every message at the idle α)
  double sim_compute_ms = 0, sim_comm_ms = 0;  // its products alone, its collectives alone
  double flops_per_s = 0;   // the measured rate of the mode's products it took
};

// Every product of one step, with the ReLU passes, in the shapes the step runs them
// (data-parallel: this rank's rows through the whole head; hybrid: every rank's rows against this
// rank's slices, cut into the scheme's rounds, so that (b) and (c) multiply K times by a K-th of
// the rows and read the slices K times). Nothing is sent.
struct step_products {
  std::size_t b, F, H2, NC, B, n;
  std::vector<std::size_t> rounds;
  std::vector<float> x, w1, w2, w3, h1, h2, y, g1, g2, g3, d2, d1, dx;

  step_products(int ranks, const options& o, const std::vector<std::size_t>& round_rows)
      : b(o.batch), F(o.F), H2(o.H2), NC(o.NC),
        B(round_rows.empty() ? o.batch : o.batch * static_cast<std::size_t>(ranks)),
        n(round_rows.empty() ? o.H1 : std::max<std::size_t>(1, o.H1 / static_cast<std::size_t>(ranks))),
        rounds(round_rows.empty() ? std::vector<std::size_t>{o.batch} : round_rows),
        x(B * F, 0.01f), w1(F * n, 0.01f), w2(n * H2, 0.01f), w3(H2 * NC, 0.01f), h1(B * n), h2(B * H2), y(b * NC),
        g1(F * n), g2(n * H2), g3(H2 * NC), d2(B * H2), d1(B * n), dx(B * F) {}

  void operator()() {
    std::size_t at = 0;
    for (const std::size_t m : rounds) {  // fc1 forward, then fc2's partial products, round by round
      sgemm({false, false, m, n, F, x.data() + at * F, F, w1.data(), n, 0, h1.data() + at * n, n});
      relu_fwd(h1.data() + at * n, m * n);
      sgemm({false, false, m, H2, n, h1.data() + at * n, n, w2.data(), H2, 0, h2.data() + at * H2, H2});
      at += m;
    }
    relu_fwd(h2.data(), b * H2);
    sgemm({false, false, b, NC, H2, h2.data(), H2, w3.data(), NC, 0, y.data(), NC});
    sgemm({true, false, H2, NC, b, h2.data(), H2, y.data(), NC, 0, g3.data(), NC});
    sgemm({false, true, b, H2, NC, y.data(), NC, w3.data(), NC, 0, d2.data(), H2});
    relu_bwd(d2.data(), h2.data(), b * H2);
    at = 0;
    for (const std::size_t m : rounds) {  // fc2's dH rows, then fc1's partial dX rows
      sgemm({false, true, m, n, H2, d2.data() + at * H2, H2, w2.data(), H2, 0, d1.data() + at * n, n});
      relu_bwd(d1.data() + at * n, h1.data() + at * n, m * n);
      sgemm({false, true, m, F, n, d1.data() + at * n, n, w1.data(), n, 0, dx.data() + at * F, F});
      at += m;
    }
    sgemm({true, false, n, H2, B, h1.data(), n, d2.data(), H2, 0, g2.data(), H2});
    sgemm({true, false, F, n, B, x.data(), F, d1.data(), n, 0, g1.data(), n});
  }

  // The simulator's flop accounting of these products (sim/hybrid.hpp counts every product 3 times:
  // forward, and the two of backward).
  double flops() const {
    auto mm = [](double m_, double n_, double k_) { return 2.0 * m_ * n_ * k_; };
    return 3 * (mm(double(B), double(n), double(F)) + mm(double(B), double(H2), double(n)) +
                mm(double(b), double(NC), double(H2)));
  }
};

// The rate of one step's own products, for --predict-gbit: step_products timed while every rank
// runs the same, as the simulator's flop accounting over that time, so the model's compute is the
// step's measured compute: the small and transposed products, the weights read once per round,
// cache misses and cores shared by the hosts included. Each run's time is its slowest rank's: a
// step waits for its slowest rank, and where the hosts share cores the scheduler may give one of
// them a core to itself for a while (netlab, 4 hosts on 2 cores, 2026-12-06: in most runs one
// rank finished in about half the others' time; rank 0's own median was 2..8% under the median
// of the slowest). The median of 5 runs; every rank returns the same rate.
template <class G>
double measure_step_rate(G& g, const options& o, const std::vector<std::size_t>& round_rows) {
  constexpr std::size_t runs = 5;
  step_products products(g.size(), o, round_rows);
  products();
  const auto K = static_cast<std::size_t>(g.size()), me = static_cast<std::size_t>(g.rank());
  std::vector<float> ts(K * runs, 0.0f);  // (rank, run): gathered by a sum, each rank's own slots
  for (std::size_t i = 0; i < runs; ++i) {
    barrier(g);
    const auto t0 = std::chrono::steady_clock::now();
    products();
    ts[me * runs + i] = static_cast<float>(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  codec::fp32 exact;
  all_reduce(g, std::span<float>(ts), topology::ring{}, exact, reduce_op::sum);
  std::vector<double> slowest(runs, 0.0);
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t i = 0; i < runs; ++i) slowest[i] = std::max<double>(slowest[i], ts[k * runs + i]);
  std::sort(slowest.begin(), slowest.end());
  return products.flops() / slowest[runs / 2];
}

// Rows per round of scheme S when every rank holds `batch` rows.
template <parallel::scheme S>
std::vector<std::size_t> round_rows(int ranks, std::size_t batch) {
  std::vector<std::size_t> out;
  for (const auto& r : S::rounds(std::vector<std::size_t>(static_cast<std::size_t>(ranks), batch))) {
    std::size_t m = 0;
    for (const auto& blk : r) m += blk.size();
    out.push_back(m);
  }
  return out;
}

// The step products' measured rates by kind (dp, a, b, c), for the modes asked for.
struct step_rates_t {
  double dp = 0, a = 0, b = 0, c = 0;
  double of(const std::string& mode) const {
    switch (mode[0]) {
      case 'a': return a;
      case 'b': return b;
      case 'c': return c;
      default: return dp;
    }
  }
};

template <class C>
sim::codec_model model_with_rates(const C& c) {
  return sim::model_of(c, c.identity ? sim::codec_rates{} : sim::measure_rates(c, std::size_t{1} << 20, 2));
}

// The mean time of `reps` 4 KiB fp32 ring all-reduces, one after another, over the group.
template <class G>
double small_all_reduce_s(G& g, int reps) {
  std::vector<float> v(1024, 1.0f);
  codec::fp32 c;
  barrier(g);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) all_reduce(g, std::span<float>(v), topology::ring{}, c, reduce_op::average);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  std::vector<float> mean{static_cast<float>(t)};
  all_reduce(g, std::span<float>(mean), topology::ring{}, c, reduce_op::average);
  return mean[0];
}

// α while every rank multiplies: the same small all-reduces as above, timed once with the cores
// idle and once while a thread of every rank runs the step's products (scheme a's, in a loop),
// as a round of (b) or (c), or an all-reduce behind backward, runs beside the calling thread's
// products. Where the hosts have fewer cores than threads, a message then waits for its receiver
// to be scheduled: α_busy = α + (t_busy - t_idle) / hops, hops = 2 (K - 1) of the ring.
template <class G>
double measure_busy_latency_us(G& g, const options& o, double latency_us) {
  const int K = g.size();
  if (K < 2) return latency_us;
  constexpr int reps = 32;
  small_all_reduce_s(g, 4);  // warm
  const double idle = small_all_reduce_s(g, reps);
  step_products products(K, o, round_rows<parallel::gather_all>(K, o.batch));
  std::atomic<bool> stop{false};
  std::exception_ptr failed;  // a product's error, rethrown once this rank has done its collectives
  const int threads = omp_get_max_threads();
  std::thread worker([&] {
    omp_set_num_threads(threads);
    try {
      while (!stop.load(std::memory_order_relaxed)) products();
    } catch (...) {
      failed = std::current_exception();
    }
  });
  double busy = 0;
  try {
    small_all_reduce_s(g, 4);
    busy = small_all_reduce_s(g, reps);
  } catch (...) {
    stop = true;
    worker.join();
    throw;
  }
  stop = true;
  worker.join();
  barrier(g);
  if (failed) std::rethrow_exception(failed);
  return std::max(latency_us, latency_us + (busy - idle) / (2.0 * (K - 1)) * 1e6);
}

// --calibrate: α and o measured on this group with small messages (the same values on every rank:
// calibrate_automatic averages over the group), and α while the products run, before any step is
// timed.
template <class G>
options calibrated(G& g, const options& o) {
  if (!o.calibrate || o.predict_gbit <= 0) return o;
  const topology::automatic a = calibrate_automatic(g);
  options c = o;
  c.latency_us = a.link.latency_s * 1e6;
  c.overhead_us = a.link.overhead_s * 1e6;
  c.busy_latency_us = measure_busy_latency_us(g, o, c.latency_us);
  return c;
}

// The cores of one rank: --cores-per-rank, or this machine's hardware threads shared by the ranks
// (in-process ranks, and netlab's hosts, which share this machine; as --threads assumes).
double cores_per_rank(const options& o, int ranks) {
  if (o.cores_per_rank >= 0) return o.cores_per_rank;
  return static_cast<double>(std::max(1u, std::thread::hardware_concurrency())) / std::max(1, ranks);
}

// The simulator's step for `mode` on the links of --predict-gbit: with the busy α where it was
// measured, and without it (`idle`). One codec model (its rates are measured) serves both, so the
// two differ by the busy α alone.
template <class G>
sim::step_estimate predict(G& g, const options& o, const std::string& mode, double flops, double& idle_step_s) {
  sim::cluster cl;
  cl.nic = {o.latency_us * 1e-6, o.predict_gbit * 1e9 / 8, o.exchange_efficiency};
  cl.nic.overhead_s = o.overhead_us * 1e-6;
  cl.nic.burst_bytes = o.burst_bytes;
  cl.nic.burst_rate_Bps = o.burst_gbit * 1e9 / 8;
  cl.segment_bytes = G::transport_type::segment_bytes;
  cl.segments_ahead = sim::cluster::as_executor;
  const sim::fc_head h{g.size(), o.batch, o.F, o.H1, o.H2, o.NC};
  const auto dash = mode.find('-');
  const std::string kind = mode.substr(0, dash), cname = mode.substr(dash + 1);
  const sim::codec_model f32 = sim::model_of(codec::fp32{});
  sim::codec_model c = f32;
  if (cname == "bf16") c = model_with_rates(codec::bf16{});
  else if (cname == "int8") c = model_with_rates(codec::int8{});
  else if (cname == "dyntree8") c = model_with_rates(codec::dyntree8{});
  auto step = [&](double busy_latency_s) {
    const sim::host_cores cores{cores_per_rank(o, g.size()), omp_get_max_threads(), busy_latency_s};
    if (kind == "dp") return sim::data_parallel_step(cl, c, h, flops, cores);
    if (kind == "a") return sim::hybrid_step<parallel::gather_all>(cl, c, f32, h, flops, cores);
    if (kind == "b") return sim::hybrid_step<parallel::by_rank>(cl, c, f32, h, flops, cores);
    return sim::hybrid_step<parallel::by_slice>(cl, c, f32, h, flops, cores);
  };
  const sim::step_estimate idle = step(0.0);
  idle_step_s = idle.step_s;
  return o.busy_latency_us > 0 ? step(o.busy_latency_us * 1e-6) : idle;
}

template <class G, class Step>
row time_steps(G& g, const options& o, Step& step, const std::string& mode) {
  step();  // warm-up: primitives, scratch, first touch
  barrier(g);
  g.transport().reset();
  std::vector<double> ms;
  for (int i = 0; i < o.iters; ++i) {
    barrier(g);
    const auto t0 = std::chrono::steady_clock::now();
    step();
    barrier(g);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  row r{mode, 0, g.transport().sent()};
  // per step, and less the barriers' own (fp32, one value per rank) traffic, counted separately
  r.sent.bytes /= static_cast<std::uint64_t>(o.iters);
  r.sent.messages /= static_cast<std::uint64_t>(o.iters);
  r.sent.header_bytes /= static_cast<std::uint64_t>(o.iters);
  r.sent.header_messages /= static_cast<std::uint64_t>(o.iters);
  std::sort(ms.begin(), ms.end());
  r.step_ms = ms[ms.size() / 2];
  return r;
}

// One mode's steps on this rank. The codec of the gradients (dp) or of the activations (hybrid).
template <class G, class C>
row run_dp(G& g, const options& o, C codec, const std::string& mode) {
  const std::size_t B = o.batch, F = o.F, H1 = o.H1, H2 = o.H2, NC = o.NC;
  std::vector<float> x(B * F), w1(F * H1), w2(H1 * H2), w3(H2 * NC), h1(B * H1), h2(B * H2), y(B * NC);
  std::vector<float> g1(F * H1), g2(H1 * H2), g3(H2 * NC), d2(B * H2), d1(B * H1), dx(B * F);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(1 + g.rank(), i);
  for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = value(2, i);
  for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = value(3, i);
  for (std::size_t i = 0; i < w3.size(); ++i) w3[i] = value(4, i);
  auto step = [&] {
    sgemm({false, false, B, H1, F, x.data(), F, w1.data(), H1, 0, h1.data(), H1});
    relu_fwd(h1.data(), h1.size());
    sgemm({false, false, B, H2, H1, h1.data(), H1, w2.data(), H2, 0, h2.data(), H2});
    relu_fwd(h2.data(), h2.size());
    sgemm({false, false, B, NC, H2, h2.data(), H2, w3.data(), NC, 0, y.data(), NC});
    // dlogits: y itself stands in for the loss gradient (the work is what is timed)
    std::vector<request> r;
    sgemm({true, false, H2, NC, B, h2.data(), H2, y.data(), NC, 0, g3.data(), NC});
    sgemm({false, true, B, H2, NC, y.data(), NC, w3.data(), NC, 0, d2.data(), H2});
    r.push_back(all_reduce_async(g, std::span<float>(g3), topology::ring{}, codec, reduce_op::average));
    relu_bwd(d2.data(), h2.data(), d2.size());
    sgemm({true, false, H1, H2, B, h1.data(), H1, d2.data(), H2, 0, g2.data(), H2});
    sgemm({false, true, B, H1, H2, d2.data(), H2, w2.data(), H2, 0, d1.data(), H1});
    r.push_back(all_reduce_async(g, std::span<float>(g2), topology::ring{}, codec, reduce_op::average));
    relu_bwd(d1.data(), h1.data(), d1.size());
    sgemm({true, false, F, H1, B, x.data(), F, d1.data(), H1, 0, g1.data(), H1});
    sgemm({false, true, B, F, H1, d1.data(), H1, w1.data(), H1, 0, dx.data(), F});
    r.push_back(all_reduce_async(g, std::span<float>(g1), topology::ring{}, codec, reduce_op::average));
    for (auto& q : r) q.wait();
  };
  if (!skip_products) {
    // The averaged gradients of the last two layers, from every rank's forward on this rank.
    step();
    const int K = g.size();
    std::vector<float> ref3(g3.size(), 0.0f), ref2(g2.size(), 0.0f), xr(x.size()), a1(h1.size()), a2(h2.size()), yr(y.size()),
        e2(d2.size());
    for (int k = 0; k < K; ++k) {
      for (std::size_t i = 0; i < xr.size(); ++i) xr[i] = value(1 + k, i);
      sgemm({false, false, B, H1, F, xr.data(), F, w1.data(), H1, 0, a1.data(), H1});
      relu_fwd(a1.data(), a1.size());
      sgemm({false, false, B, H2, H1, a1.data(), H1, w2.data(), H2, 0, a2.data(), H2});
      relu_fwd(a2.data(), a2.size());
      sgemm({false, false, B, NC, H2, a2.data(), H2, w3.data(), NC, 0, yr.data(), NC});
      sgemm({true, false, H2, NC, B, a2.data(), H2, yr.data(), NC, 1, ref3.data(), NC});
      sgemm({false, true, B, H2, NC, yr.data(), NC, w3.data(), NC, 0, e2.data(), H2});
      relu_bwd(e2.data(), a2.data(), e2.size());
      sgemm({true, false, H1, H2, B, a1.data(), H1, e2.data(), H2, 1, ref2.data(), H2});
    }
    for (auto& v : ref3) v /= static_cast<float>(K);
    for (auto& v : ref2) v /= static_cast<float>(K);
    const double tol = check_tolerance(mode.substr(mode.find('-') + 1));
    check_close(mode, "the averaged gradient of the classifier", g.rank(), g3, ref3, tol);
    check_close(mode, "the averaged gradient of fc2", g.rank(), g2, ref2, tol);
  }
  return time_steps(g, o, step, mode);
}

template <class S, class G, class C>
row run_hybrid(G& g, const options& o, C codec, const std::string& mode) {
  using Tr = typename G::transport_type;
  const std::size_t B = o.batch, F = o.F, H2 = o.H2, NC = o.NC;
  parallel::column_linear<S, Tr, C> fc1(g, F, o.H1, codec);
  parallel::row_linear<S, Tr, C> fc2(g, o.H1, H2, codec);
  const std::size_t n = fc1.cols();
  std::vector<float> x(B * F), w1(F * n), w2(n * H2), w3(H2 * NC), h2(B * H2), y(B * NC);
  std::vector<float> g1(F * n), g2(n * H2), g3(H2 * NC), d2(B * H2), dx(B * F), dh1;
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = value(1 + g.rank(), i);
  const std::uint64_t me = static_cast<std::uint64_t>(g.rank());
  for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = value(2 + 16 * me, i);  // this rank's slices
  for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = value(3 + 16 * me, i);
  for (std::size_t i = 0; i < w3.size(); ++i) w3[i] = value(4, i);
  codec::fp32 c32;
  auto step = [&] {
    auto h1 = fc1.forward(std::span<const float>(x), std::span<const float>(w1), sgemm);
    relu_fwd(h1.data(), h1.size());
    auto y2 = fc2.forward(h1, B, std::span<const float>(w2), sgemm);
    std::copy(y2.begin(), y2.end(), h2.begin());
    relu_fwd(h2.data(), h2.size());
    sgemm({false, false, B, NC, H2, h2.data(), H2, w3.data(), NC, 0, y.data(), NC});
    sgemm({true, false, H2, NC, B, h2.data(), H2, y.data(), NC, 0, g3.data(), NC});
    sgemm({false, true, B, H2, NC, y.data(), NC, w3.data(), NC, 0, d2.data(), H2});
    auto r = all_reduce_async(g, std::span<float>(g3), topology::ring{}, c32, reduce_op::average);
    relu_bwd(d2.data(), h2.data(), d2.size());
    dh1.resize(h1.size());
    fc2.backward(h1, std::span<const float>(d2), std::span<const float>(w2), std::span<float>(g2), std::span<float>(dh1), sgemm);
    relu_bwd(dh1.data(), h1.data(), dh1.size());
    fc1.backward(std::span<const float>(dh1), std::span<const float>(w1), std::span<float>(g1), std::span<float>(dx), sgemm);
    r.wait();
  };
  if (!skip_products) {
    // This rank's rows forward (fc2's output) and backward (fc1's dX), from every rank's slices and
    // this rank's rows as they travelled (fc1.inputs(): a lossy codec's decoded image, which every
    // rank multiplied; with the exact rows a ReLU whose input is near 0 would open on one side only).
    step();
    const int K = g.size();
    const float* xq = fc1.inputs().data() + static_cast<std::size_t>(g.rank()) * B * F;
    std::vector<float> ref_h2(h2.size(), 0.0f), ref_dx(dx.size(), 0.0f), w1k, w2k, a1, e1;
    for (int k = 0; k < K; ++k) {
      const auto [lo, hi] = chunk_range(o.H1, static_cast<std::size_t>(K), static_cast<std::size_t>(k));
      const std::size_t nk = hi - lo;
      if (nk == 0) continue;
      w1k.resize(F * nk), w2k.resize(nk * H2), a1.resize(B * nk), e1.resize(B * nk);
      for (std::size_t i = 0; i < w1k.size(); ++i) w1k[i] = value(2 + 16 * static_cast<std::uint64_t>(k), i);
      for (std::size_t i = 0; i < w2k.size(); ++i) w2k[i] = value(3 + 16 * static_cast<std::uint64_t>(k), i);
      sgemm({false, false, B, nk, F, xq, F, w1k.data(), nk, 0, a1.data(), nk});
      relu_fwd(a1.data(), a1.size());
      sgemm({false, false, B, H2, nk, a1.data(), nk, w2k.data(), H2, 1, ref_h2.data(), H2});
      // d2 is this rank's own, computed locally in the step from h2 and the classifier
      sgemm({false, true, B, nk, H2, d2.data(), H2, w2k.data(), H2, 0, e1.data(), nk});
      relu_bwd(e1.data(), a1.data(), e1.size());
      sgemm({false, true, B, F, nk, e1.data(), nk, w1k.data(), nk, 1, ref_dx.data(), F});
    }
    relu_fwd(ref_h2.data(), ref_h2.size());
    const double tol = check_tolerance(mode.substr(mode.find('-') + 1));
    check_close(mode, "fc2's output (this rank's rows)", g.rank(), h2, ref_h2, tol);
    check_close(mode, "fc1's input gradient (this rank's rows)", g.rank(), dx, ref_dx, tol);
  }
  return time_steps(g, o, step, mode);
}

template <class G>
row run_mode_measured(G& g, const options& o, const std::string& mode);

// rates: the step products' measured rates by kind, from measure_step_rate.
template <class G>
row run_mode(G& g, const options& o, const std::string& mode, const step_rates_t& rates) {
  skip_products = o.comm_only;
  row r = run_mode_measured(g, o, mode);
  skip_products = false;
  if (o.predict_gbit > 0) {
    r.flops_per_s = rates.of(mode);
    double idle_s = 0;
    const sim::step_estimate e = predict(g, o, mode, r.flops_per_s, idle_s);
    r.predicted_ms = e.step_s * 1e3, r.sim_compute_ms = e.compute_s * 1e3, r.sim_comm_ms = e.comm_s * 1e3;
    r.predicted_idle_ms = idle_s * 1e3;
  }
  return r;
}

template <class G>
step_rates_t step_rates(G& g, const options& o) {
  step_rates_t r;
  if (o.predict_gbit <= 0) return r;
  auto wanted = [&](char k) {
    return std::any_of(o.modes.begin(), o.modes.end(), [&](const std::string& m) { return !m.empty() && m[0] == k; });
  };
  // Every rank asks for the same modes, so every rank runs the same measurements (each has barriers).
  if (wanted('d')) r.dp = measure_step_rate(g, o, {});
  if (wanted('a')) r.a = measure_step_rate(g, o, round_rows<parallel::gather_all>(g.size(), o.batch));
  if (wanted('b')) r.b = measure_step_rate(g, o, round_rows<parallel::by_rank>(g.size(), o.batch));
  if (wanted('c')) r.c = measure_step_rate(g, o, round_rows<parallel::by_slice>(g.size(), o.batch));
  return r;
}

template <class G>
row run_mode_measured(G& g, const options& o, const std::string& mode) {
  const auto dash = mode.find('-');
  const std::string kind = mode.substr(0, dash), cname = dash == std::string::npos ? "fp32" : mode.substr(dash + 1);
  auto with_codec = [&](auto&& f) -> row {
    if (cname == "fp32") return f(codec::fp32{});
    if (cname == "bf16") return f(codec::bf16{});
    if (cname == "int8") return f(codec::int8{});
    if (cname == "dyntree8") return f(codec::dyntree8{});
    throw std::invalid_argument("unknown codec in mode " + mode);
  };
  if (kind == "dp") return with_codec([&](auto c) { return run_dp(g, o, c, mode); });
  if (kind == "a") return with_codec([&](auto c) { return run_hybrid<parallel::gather_all>(g, o, c, mode); });
  if (kind == "b") return with_codec([&](auto c) { return run_hybrid<parallel::by_rank>(g, o, c, mode); });
  if (kind == "c") return with_codec([&](auto c) { return run_hybrid<parallel::by_slice>(g, o, c, mode); });
  throw std::invalid_argument("unknown mode " + mode + " (dp-, a-, b-, c- followed by a codec)");
}

void report(const options& o, const std::vector<row>& rows, const std::string& transport_name, int ranks) {
  double dp_ms = 0, dp_bytes = 0;
  for (const auto& r : rows)
    if (r.mode == "dp-fp32") dp_ms = r.step_ms, dp_bytes = static_cast<double>(r.sent.bytes + r.sent.header_bytes);
  if (o.json) {
    for (const auto& r : rows)
      std::printf("{\"bench\":\"hybrid\",\"transport\":\"%s\",\"ranks\":%d,\"batch\":%zu,\"features\":%zu,\"h1\":%zu,"
                  "\"h2\":%zu,\"mode\":\"%s\",\"step_ms\":%.3f,\"predicted_ms\":%.3f,\"predicted_idle_ms\":%.3f,\"bytes\":%llu,\"messages\":%llu,"
                  "\"header_bytes\":%llu,\"sim_gbit\":%.4f,\"sim_alpha_us\":%.2f,\"sim_overhead_us\":%.2f,\"sim_busy_alpha_us\":%.2f,\"sim_cores_per_rank\":%.3f,\"sim_gflops\":%.3f,\"sim_compute_ms\":%.3f,\"sim_comm_ms\":%.3f}\n",
                  transport_name.c_str(), ranks, o.batch, o.F, o.H1, o.H2, r.mode.c_str(), r.step_ms, r.predicted_ms, r.predicted_idle_ms,
                  static_cast<unsigned long long>(r.sent.bytes), static_cast<unsigned long long>(r.sent.messages),
                  static_cast<unsigned long long>(r.sent.header_bytes), o.predict_gbit, o.latency_us, o.overhead_us,
                  o.busy_latency_us, cores_per_rank(o, ranks), r.flops_per_s * 1e-9,
                  r.sim_compute_ms,
                  r.sim_comm_ms);
    return;
  }
  std::printf("%d ranks (%s), batch %zu per rank, head %zu -> %zu -> %zu -> %zu; rank 0's sends per step\n", ranks,
              transport_name.c_str(), o.batch, o.F, o.H1, o.H2, o.NC);
  if (o.predict_gbit > 0)
    std::printf("sim: %.3f Gbit/s, alpha %.1f us, overhead %.1f us per message, eta %.3f%s; %.2f cores per rank\n",
                o.predict_gbit, o.latency_us, o.overhead_us, o.exchange_efficiency,
                o.calibrate ? " (alpha and overhead calibrated on this group)" : "", cores_per_rank(o, ranks));
  if (o.busy_latency_us >= 0)
    std::printf("alpha %.1f us while every rank's products run without a pause (modelled beside the products)\n",
                o.busy_latency_us);
  std::printf("%-12s %10s %8s %10s %14s %10s %8s %9s\n", "mode", "step ms", "x dp32", "sim ms", "bytes sent", "x dp32", "msgs",
              "GFLOP/s");
  for (const auto& r : rows) {
    const double b = static_cast<double>(r.sent.bytes + r.sent.header_bytes);
    std::printf("%-12s %10.2f %8.3f %10.2f %14.0f %10.4f %8llu %9.2f\n", r.mode.c_str(), r.step_ms,
                dp_ms > 0 ? r.step_ms / dp_ms : 0.0, r.predicted_ms, b, dp_bytes > 0 ? b / dp_bytes : 0.0,
                static_cast<unsigned long long>(r.sent.messages + r.sent.header_messages), r.flops_per_s * 1e-9);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    if (o.transport == "mpi") {
#if LOCKSTEP_HAVE_MPI
      transport::mpi_session session(&argc, &argv);
      using counted = transport::counting<transport::mpi>;
      group<counted> g(counted(transport::mpi(MPI_COMM_WORLD)));
      // netlab's hosts share this machine's cores: hardware threads / ranks each, as in-process
      omp_set_num_threads(o.threads > 0 ? o.threads
                                        : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / g.size()));
      std::vector<row> rows;
      const options oc = calibrated(g, o);
      const auto flops = step_rates(g, oc);
      for (const auto& m : o.modes) rows.push_back(run_mode(g, oc, m, flops));
      if (g.rank() == 0) report(oc, rows, "mpi", g.size());
      return 0;
#else
      std::fprintf(stderr, "lockstep-bench-hybrid: built without MPI\n");
      return 2;
#endif
    }
    using counted = transport::counting<transport::inproc>;
    auto world = transport::inproc::make_world(o.ranks);
    std::vector<row> rows;
    options reported = o;
    std::mutex m;
    const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / o.ranks);
    transport::detail::run_ranks(o.ranks, *world, [&](int r) {
      omp_set_num_threads(threads);
      group<counted> g(counted(transport::inproc(world, r)));
      std::vector<row> mine;
      const options oc = calibrated(g, o);
      const auto flops = step_rates(g, oc);
      for (const auto& mode : o.modes) mine.push_back(run_mode(g, oc, mode, flops));
      if (r == 0) {
        std::lock_guard lk(m);
        rows = mine;
        reported = oc;
      }
    });
    report(reported, rows, "inproc", o.ranks);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-bench-hybrid: %s\n", e.what());
    return 1;
  }
  return 0;
}
