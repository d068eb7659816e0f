// Tests of lockstep/sim: the discrete-event simulator against the closed forms where both must
// agree exactly, its symmetric shortcut against the full event run, contention and monotonicity,
// the alpha/beta/eta fit against known parameters, and the exchange efficiency eta (pairwise
// exchanges at eta x bandwidth) in both.
#include <catch2/catch.hpp>

#include <cmath>
#include <tuple>
#include <random>

#include <lockstep/codec.hpp>
#include <lockstep/collective/executor.hpp>  // chunk_range
#include <lockstep/sim/cost_model.hpp>
#include <lockstep/sim/fit.hpp>
#include <lockstep/sim/hybrid.hpp>
#include <lockstep/sim/simulator.hpp>
#include <lockstep/topology.hpp>

#include "sim_fit.hpp"  // bench/: the JSON reader, the codec names and the simulation fit

using namespace lockstep;

namespace {

sim::cluster gigabit() {
  sim::cluster cl;
  cl.nic = {30e-6, 125e6};
  cl.segment_bytes = 256 * 1024;  // several segments per step at the sizes below
  return cl;
}

// gamma of the order measured on a laptop core, so codec work is visible next to 1 Gbit/s
sim::codec_rates some_gamma() { return {4e-9, 0.7e-9, 0.9e-9}; }

double full_run(const sim::cluster& cl, const sim::codec_model& c, int size, std::size_t n, bool torus) {
  sim::simulator s(cl, c);
  s.disable_symmetry();
  auto r = torus ? s.all_reduce(topology::torus2d{}, size, n) : s.all_reduce(topology::ring{}, size, n);
  REQUIRE_FALSE(s.last_was_symmetric());
  return r.time_s;
}

// A rows x cols torus (rows = 1: a ring of cols), simulated with or without the shortcut.
double simulate(const sim::cluster& cl, const sim::codec_model& c, int rows, int cols, std::size_t n, bool symmetric) {
  sim::simulator s(cl, c);
  s.set_symmetry_checks(0);
  s.disable_symmetry(!symmetric);
  auto r = rows == 1 ? s.all_reduce(topology::ring{}, cols, n) : s.all_reduce(topology::torus2d{rows, cols}, rows * cols, n);
  REQUIRE(s.last_was_symmetric() == symmetric);
  return r.time_s;
}

double closed_shape(const sim::cluster& cl, const sim::codec_model& c, int rows, int cols, std::size_t n) {
  if (rows == 1) return sim::ring_terms(cols, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead).time(cl.nic, c.rates);
  return sim::torus2d_terms(rows, cols, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead).time(cl.nic, c.rates);
}

// The closed form of a ring of `size`, or of the most square torus of that size.
double closed(const sim::cluster& cl, const sim::codec_model& c, int size, std::size_t n, bool torus) {
  const auto [r, cc] = torus ? topology::torus2d{}.shape(size) : std::pair{1, size};
  return closed_shape(cl, c, r, cc, n);
}

}  // namespace

// The model's handshake is the executor's header, byte for byte.
static_assert(lockstep::sim::header_bytes == sizeof(lockstep::detail::wire_header));

TEST_CASE("simulator equals the closed form on contention-free links", "[sim]") {
  const bool torus = GENERATE(false, true);
  const bool send_ahead = GENERATE(false, true);
  const std::string name = GENERATE(as<std::string>{}, "fp32", "bf16", "dyntree8");
  const int size = GENERATE(2, 4, 6, 16);
  const std::size_t n = std::size_t{1} << 20;  // 4 MiB: 64 to 512 KiB chunks, 1 to 4 segments
  sim::cluster cl = gigabit();
  cl.send_ahead = send_ahead;
  sim::codec_model c = bench::codec_by_name(name);
  // With gamma = 0 the model is exact whatever the segmentation; without send-ahead the executor's
  // order (send j+1 after receive j) serialises codec work with transfer, so it is exact then too.
  if (!send_ahead) c.rates = some_gamma();
  CAPTURE(torus, send_ahead, name, size);
  const double want = closed(cl, c, size, n - n % static_cast<std::size_t>(size), torus);
  const double got = full_run(cl, c, size, n - n % static_cast<std::size_t>(size), torus);
  REQUIRE(got == Approx(want).epsilon(1e-9));
}

TEST_CASE("with send-ahead and codec work, the closed form is an upper bound the overlap stays under", "[sim]") {
  sim::cluster cl = gigabit();
  cl.send_ahead = true;
  sim::codec_model c = bench::codec_by_name("int8");
  c.rates = some_gamma();
  const std::size_t n = std::size_t{1} << 22;
  const double got = full_run(cl, c, 8, n, false);
  const double bound = closed(cl, c, 8, n, false);
  sim::codec_model free_codec = c;
  free_codec.rates = {};
  REQUIRE(got < bound);
  REQUIRE(got > closed(cl, free_codec, 8, n, false));
}

TEST_CASE("the symmetric shortcut equals the full event run", "[sim]") {
  const bool torus = GENERATE(false, true);
  const bool send_ahead = GENERATE(false, true);
  const int size = GENERATE(3, 12, 16, 64);
  sim::cluster cl = gigabit();
  cl.send_ahead = send_ahead;
  sim::codec_model c = bench::codec_by_name("dyntree8");
  c.rates = some_gamma();
  const std::size_t n = static_cast<std::size_t>(size) * 12288;
  sim::simulator s(cl, c);
  s.set_symmetry_checks(0);  // every rank: here the check is the proof
  auto fast = torus ? s.all_reduce(topology::torus2d{}, size, n) : s.all_reduce(topology::ring{}, size, n);
  REQUIRE(s.last_was_symmetric());
  CAPTURE(torus, send_ahead, size);
  REQUIRE(fast.time_s == Approx(full_run(cl, c, size, n, torus)).epsilon(1e-12));
}

TEST_CASE("the shortcut is not taken where the symmetry does not hold", "[sim]") {
  sim::codec_model c = bench::codec_by_name("fp32");
  SECTION("unequal chunks") {
    sim::simulator s(gigabit(), c);
    s.all_reduce(topology::ring{}, 8, 8 * 1000 + 3);
    REQUIRE_FALSE(s.last_was_symmetric());
  }
  SECTION("two ranks per NIC") {
    sim::cluster cl = gigabit();
    cl.ranks_per_host = 2;
    sim::simulator s(cl, c);
    s.all_reduce(topology::ring{}, 8, 8 * 1000);
    REQUIRE_FALSE(s.last_was_symmetric());
  }
}

TEST_CASE("shared links slow the collective down", "[sim]") {
  sim::codec_model c = bench::codec_by_name("fp32");
  const std::size_t n = std::size_t{1} << 22;
  sim::cluster cl = gigabit();
  const double free_links = full_run(cl, c, 8, n, false);
  SECTION("a switch core no faster than one NIC serialises all hosts' flows") {
    cl.switch_bandwidth_Bps = cl.nic.bandwidth_Bps;
    const double shared = full_run(cl, c, 8, n, false);
    // 8 flows of one step share the core: about 8x the bandwidth term
    REQUIRE(shared > 6 * free_links);
  }
  SECTION("torus rows on one host keep their traffic off the NIC; columns share it") {
    // 4 ranks per host = one torus row per host (4x4): the row rings are local, the column rings
    // send four flows through each NIC at once.
    cl.ranks_per_host = 4;
    cl.local = {1e-6, 10e9};
    sim::simulator s(cl, c);
    const double t = s.all_reduce(topology::torus2d{4, 4}, 16, n).time_s;
    const double one_per_nic = full_run(gigabit(), c, 16, n, true);
    REQUIRE(t > one_per_nic);
  }
}

TEST_CASE("predicted time is monotone in size, group and bandwidth", "[sim]") {
  sim::codec_model c = bench::codec_by_name("bf16");
  c.rates = some_gamma();
  sim::cluster cl = gigabit();
  sim::simulator s(cl, c);
  double prev = 0;
  for (std::size_t n : {1u << 14, 1u << 18, 1u << 22, 1u << 24}) {
    const double t = s.all_reduce(topology::ring{}, 16, n).time_s;
    REQUIRE(t > prev);
    prev = t;
  }
  prev = 0;
  for (int size : {2, 4, 16, 64, 256, 1024, 4096}) {
    const double t = s.all_reduce(topology::ring{}, size, std::size_t{1} << 24).time_s;
    REQUIRE(t > prev);
    prev = t;
  }
  sim::cluster fast = cl;
  fast.nic.bandwidth_Bps *= 10;
  sim::simulator sf(fast, c);
  REQUIRE(sf.all_reduce(topology::ring{}, 16, 1u << 22).time_s < s.all_reduce(topology::ring{}, 16, 1u << 22).time_s);
}

TEST_CASE("with send-ahead the torus's fewer steps beat the ring at scale", "[sim]") {
  sim::cluster cl = gigabit();
  cl.send_ahead = true;
  sim::codec_model c = bench::codec_by_name("fp32");
  sim::simulator s(cl, c);
  const std::size_t n = std::size_t{1} << 24;
  const double ring = s.all_reduce(topology::ring{}, 1024, n).time_s;
  const double torus = s.all_reduce(topology::torus2d{}, 1024, n).time_s;
  // 2046 against 124 latencies of 30 us
  REQUIRE(ring - torus == Approx((2046 - 124) * 30e-6).epsilon(1e-6));
}

TEST_CASE("the fit recovers known alpha and beta", "[sim]") {
  const sim::link_params truth{47e-6, 117e6};
  sim::cluster cl;
  cl.nic = truth;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(-0.02, 0.02);
  std::vector<sim::sample> xs;
  for (const char* name : {"fp32", "bf16", "dyntree8"})
    for (int size : {2, 4, 8})
      for (std::size_t bytes : {std::size_t{1} << 12, std::size_t{1} << 16, std::size_t{1} << 20, std::size_t{1} << 26}) {
        sim::codec_model c = bench::codec_by_name(name);
        c.rates = some_gamma();
        bench::json_object line{{"topology", size == 4 ? "torus2d" : "ring"}, {"codec", name},
                              {"ranks", std::to_string(size)}, {"bytes", std::to_string(bytes)}};
        auto t = bench::terms_of(line, c, cl.segment_bytes);
        REQUIRE(t);
        const double seconds = t->time(truth, c.rates) * (1 + noise(rng));
        xs.push_back(sim::sample_of(*t, c.rates, seconds));
      }
  const sim::fit_result f = sim::fit_alpha_beta(xs);
  REQUIRE(f.link.latency_s == Approx(truth.latency_s).epsilon(0.05));
  REQUIRE(f.link.bandwidth_Bps == Approx(truth.bandwidth_Bps).epsilon(0.01));
  REQUIRE(f.rms_relative_error < 0.02);
}

TEST_CASE("bench JSON lines parse", "[sim]") {
  auto o = bench::parse_json_line(R"({"bench":"allreduce", "topology":"ring","codec":"bf16","ranks":4,"bytes":1048576,"time_us":123.5,"ok":true})");
  REQUIRE(o);
  REQUIRE((*o)["topology"] == "ring");
  REQUIRE(std::stod((*o)["time_us"]) == 123.5);
  REQUIRE((*o)["ok"] == "true");
  REQUIRE_FALSE(bench::parse_json_line("not json"));
  REQUIRE_FALSE(bench::parse_json_line(R"({"a":1,)"));
}

TEST_CASE("closed forms match the papers' formulas in the one-segment case", "[sim]") {
  sim::codec_model c = bench::codec_by_name("fp32");
  const sim::link_params l{10e-6, 1e9};
  const std::size_t n = 1 << 16;  // 256 KiB, below a segment
  const double s = n * 4.0;
  auto t = sim::ring_terms(8, n, c, 1 << 20, false);
  REQUIRE(t.time(l, {}) == Approx(2 * 7 * l.latency_s + 2.0 * 7 / 8 * s * l.beta()));
  t = sim::torus2d_terms(2, 4, n, c, 1 << 20, false, true);
  REQUIRE(t.time(l, {}) == Approx(2 * (2 + 4 - 2) * l.latency_s + 2.0 * 7 / 8 * s * l.beta()));
  t = sim::halving_doubling_terms(8, n, c, 1 << 20, false, true);
  REQUIRE(t.time(l, {}) == Approx(2 * 3 * l.latency_s + 2.0 * 7 / 8 * s * l.beta()));
  REQUIRE(sim::data_parallel_speedup(96, 1.0, 0.0) == Approx(96));
  REQUIRE(sim::data_parallel_speedup(96, 1.0, 1.0) == Approx(48));
}

TEST_CASE("with exchange efficiency < 1 the simulator still equals the closed form", "[sim][exchange]") {
  const bool send_ahead = GENERATE(false, true);
  const bool symmetric = GENERATE(false, true);
  const std::string name = GENERATE(as<std::string>{}, "fp32", "dyntree8");
  const auto shape = GENERATE(std::pair{1, 2}, std::pair{1, 4}, std::pair{2, 2}, std::pair{2, 4}, std::pair{4, 4});
  sim::cluster cl = gigabit();
  cl.nic.exchange_efficiency = 0.57;
  cl.send_ahead = send_ahead;
  sim::codec_model c = bench::codec_by_name(name);
  if (!send_ahead) c.rates = some_gamma();
  const int size = shape.first * shape.second;
  const std::size_t n = static_cast<std::size_t>(size) * 65536;  // several segments per step
  CAPTURE(send_ahead, symmetric, name, shape.first, shape.second);
  const double want = closed_shape(cl, c, shape.first, shape.second, n);
  REQUIRE(simulate(cl, c, shape.first, shape.second, n, symmetric) == Approx(want).epsilon(1e-9));
  // The penalty lands exactly where a step's peers coincide: rings of 2, torus rows/columns of 2.
  sim::cluster ideal = cl;
  ideal.nic.exchange_efficiency = 1;
  const double t1 = closed_shape(ideal, c, shape.first, shape.second, n);
  const bool has_exchange = shape.first == 2 || shape.second == 2;
  if (has_exchange) REQUIRE(want > t1);
  else REQUIRE(want == t1);
}

TEST_CASE("exchange efficiency 1 changes nothing", "[sim][exchange]") {
  sim::codec_model c = bench::codec_by_name("dyntree8");
  c.rates = some_gamma();
  const std::size_t n = std::size_t{1} << 20;
  sim::cluster cl = gigabit();
  for (int size : {2, 4, 8}) {
    const bool torus = size >= 4;
    sim::cluster explicit_one = cl;
    explicit_one.nic.exchange_efficiency = 1.0;
    REQUIRE(full_run(cl, c, size, n, torus) == full_run(explicit_one, c, size, n, torus));
    // eta = 1: the exchanged bytes cost beta like any other, the total is the papers' count
    auto [r, cc] = topology::torus2d{}.shape(size);
    const sim::cost_terms t = torus ? sim::torus2d_terms(r, cc, n, c, cl.segment_bytes) : sim::ring_terms(size, n, c, cl.segment_bytes);
    REQUIRE(t.time(cl.nic, c.rates) ==
            Approx(t.messages * cl.nic.latency_s + t.wire_bytes() * cl.nic.beta() + t.compute_time(c.rates)).epsilon(1e-12));
  }
  // Which bytes are exchanges: all of a 2-ring and a 2x2 torus, none of a 4-ring.
  REQUIRE(sim::ring_terms(4, n, c, cl.segment_bytes).exchange_bytes == 0);
  REQUIRE(sim::ring_terms(2, n, c, cl.segment_bytes, false).oneway_bytes == 0);
  REQUIRE(sim::torus2d_terms(2, 2, n, c, cl.segment_bytes, false).oneway_bytes == 0);
  REQUIRE(sim::halving_doubling_terms(8, n, c, cl.segment_bytes, false).oneway_bytes == 0);
  REQUIRE(sim::torus2d_terms(2, 4, n, c, cl.segment_bytes, false).oneway_bytes > 0);
  REQUIRE(sim::torus2d_terms(2, 4, n, c, cl.segment_bytes, false).exchange_bytes > 0);
}

namespace {
std::vector<sim::sample> synthetic(const sim::link_params& truth, double noise_amp, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> noise(-noise_amp, noise_amp);
  std::vector<sim::sample> xs;
  for (const char* name : {"fp32", "int8", "dyntree8"})
    for (const char* topo : {"ring", "torus2d"})
      for (int size : {2, 4, 8})
        for (std::size_t bytes : {std::size_t{1} << 16, std::size_t{1} << 20, std::size_t{1} << 24, std::size_t{1} << 26}) {
          sim::codec_model c = bench::codec_by_name(name);
          c.rates = some_gamma();
          bench::json_object line{{"topology", topo}, {"codec", name}, {"ranks", std::to_string(size)}, {"bytes", std::to_string(bytes)}};
          auto t = bench::terms_of(line, c, std::size_t{1} << 20);
          REQUIRE(t);
          xs.push_back(sim::sample_of(*t, c.rates, t->time(truth, c.rates) * (1 + noise(rng))));
        }
  return xs;
}
}  // namespace

TEST_CASE("the fit recovers known alpha, beta and exchange efficiency", "[sim][exchange]") {
  const sim::link_params truth{180e-6, 110e6, 0.58};
  SECTION("exact data") {
    const sim::fit_result f = sim::fit_alpha_beta(synthetic(truth, 0, 1));
    REQUIRE_FALSE(f.eta_tied);
    REQUIRE_FALSE(f.alpha_pinned);
    REQUIRE(f.exchange_samples > 0);
    REQUIRE(f.link.latency_s == Approx(truth.latency_s).epsilon(1e-6));
    REQUIRE(f.link.bandwidth_Bps == Approx(truth.bandwidth_Bps).epsilon(1e-6));
    REQUIRE(f.link.exchange_efficiency == Approx(truth.exchange_efficiency).epsilon(1e-6));
    REQUIRE(f.rms_relative_error < 1e-9);
  }
  SECTION("2% noise") {
    const sim::fit_result f = sim::fit_alpha_beta(synthetic(truth, 0.02, 11));
    REQUIRE(f.link.latency_s == Approx(truth.latency_s).epsilon(0.1));
    REQUIRE(f.link.bandwidth_Bps == Approx(truth.bandwidth_Bps).epsilon(0.02));
    REQUIRE(f.link.exchange_efficiency == Approx(truth.exchange_efficiency).epsilon(0.02));
    REQUIRE(f.rms_relative_error < 0.02);
  }
}

TEST_CASE("the fit keeps eta in (0, 1]", "[sim][exchange]") {
  SECTION("no exchange rows: eta stays 1") {
    std::vector<sim::sample> xs;
    for (const auto& s : synthetic({50e-6, 120e6, 0.5}, 0, 3))
      if (s.exchange_count == 0) xs.push_back(s);
    const sim::fit_result f = sim::fit_alpha_beta(xs);
    REQUIRE(f.eta_tied);
    REQUIRE(f.link.exchange_efficiency == 1.0);
    REQUIRE(f.link.bandwidth_Bps == Approx(120e6).epsilon(1e-6));
  }
  SECTION("exchanges faster than one-way traffic: clamped at 1 and refitted") {
    auto xs = synthetic({50e-6, 120e6, 1.0}, 0, 3);
    for (auto& s : xs) s.seconds -= 0.2 * s.exchange_count / 120e6;  // as if eta were 1.25
    const sim::fit_result f = sim::fit_alpha_beta(xs);
    REQUIRE(f.eta_tied);
    REQUIRE(f.link.exchange_efficiency == 1.0);
    REQUIRE(f.link.bandwidth_Bps > 0);
  }
}

// Token buckets (link_params::burst_bytes): tc tbf's arithmetic on one link, then whole runs.
TEST_CASE("a token bucket lets its credit through at once and the rest at the rate", "[sim][bucket]") {
  sim::link_params l{0.0, 1e6};  // 1 MB/s: seconds read as megabytes
  l.burst_bytes = 250e3;
  sim::detail::shaper out{0.0, l.burst_bytes}, in{0.0, l.burst_bytes};
  auto path = std::array{&out, &in};
  // a message within the full bucket leaves at once and spends its bytes
  REQUIRE(sim::detail::transmit(path, 1.0, 100e3, l.bandwidth_Bps, l) == 1.0);
  REQUIRE(out.tokens == Approx(150e3));
  // right after: 150 kB of credit, the other 250 kB at 1 MB/s
  REQUIRE(sim::detail::transmit(path, 1.0, 400e3, l.bandwidth_Bps, l) == Approx(1.25));
  REQUIRE(out.tokens == Approx(0.0).margin(1e-6));
  // 0.1 s idle refills 100 kB; the scarcer of two buckets decides, and each keeps its own rest
  in.tokens = 20e3, in.free = 1.25;
  REQUIRE(sim::detail::transmit(path, 1.35, 200e3, l.bandwidth_Bps, l) == Approx(1.35 + (200e3 - 100e3) / 1e6));
  REQUIRE(out.tokens == Approx(0.0).margin(1e-6));  // had 100 kB at 1.35 s, spent them all
  REQUIRE(in.tokens == Approx(20e3));               // had 120 kB (20 + 100 refilled), spent 100
  // never more than the depth, however long the link idled
  REQUIRE(out.credit(100.0, l) == l.burst_bytes);
  // with a burst rate P the credit C drains at P - r while the rate r refills it: tbf sends
  // C P / (P - r) = 333 kB at 4 MB/s (1/12 s), the other 117 kB at 1 MB/s, and ends empty
  l.burst_rate_Bps = 4e6;
  sim::detail::shaper a{0.0, l.burst_bytes}, b{0.0, l.burst_bytes};
  REQUIRE(sim::detail::transmit(std::array{&a, &b}, 0.0, 450e3, l.bandwidth_Bps, l) == Approx(0.2));
  REQUIRE(a.tokens == Approx(0.0).margin(1e-6));
  // a message the burst phase covers: 200 kB at 4 MB/s, 150 kB of credit spent, 100 kB left
  sim::detail::shaper e{0.0, l.burst_bytes};
  REQUIRE(sim::detail::transmit(std::array{&e}, 0.0, 200e3, l.bandwidth_Bps, l) == Approx(0.05));
  REQUIRE(e.tokens == Approx(100e3));
  // in an exchange the rest moves at eta x bandwidth
  sim::detail::shaper c{0.0, 0.0};
  REQUIRE(sim::detail::transmit(std::array{&c}, 0.0, 100e3, 0.5 * l.bandwidth_Bps, l) == Approx(0.2));
}

TEST_CASE("with a token bucket the shortcut still equals the full event run", "[sim][bucket]") {
  const bool torus = GENERATE(false, true);
  const int size = GENERATE(4, 12, 16);
  const double rate = GENERATE(0.0, 4e9 / 8);
  sim::cluster cl = gigabit();
  cl.nic.burst_bytes = 96 * 1024;
  cl.nic.burst_rate_Bps = rate;
  cl.nic.exchange_efficiency = 0.7;
  sim::codec_model c = bench::codec_by_name("int8");
  c.rates = some_gamma();
  const std::size_t n = static_cast<std::size_t>(size) * 12288;
  sim::simulator s(cl, c);
  s.set_symmetry_checks(0);
  auto fast = torus ? s.all_reduce(topology::torus2d{}, size, n) : s.all_reduce(topology::ring{}, size, n);
  REQUIRE(s.last_was_symmetric());
  CAPTURE(torus, size, rate);
  REQUIRE(fast.time_s == Approx(full_run(cl, c, size, n, torus)).epsilon(1e-12));
}

TEST_CASE("a bucket turns idle time into bandwidth, within its depth", "[sim][bucket]") {
  const bool torus = GENERATE(false, true);
  sim::cluster plain = gigabit();
  plain.nic.latency_s = 0;
  sim::codec_model c = bench::codec_by_name(GENERATE(as<std::string>{}, "fp32", "int8"));
  c.rates = some_gamma();
  const int size = 4;
  const std::size_t n = std::size_t{1} << 22;
  auto run = [&](double burst) {
    sim::cluster cl = plain;
    cl.nic.burst_bytes = burst;
    sim::simulator s(cl, c);
    return torus ? s.all_reduce(topology::torus2d{}, size, n) : s.all_reduce(topology::ring{}, size, n);
  };
  const double t0 = run(0).time_s, t_small = run(64 * 1024).time_s, t_big = run(1 << 20).time_s;
  CAPTURE(torus, c.name, t0, t_small, t_big);
  // a deeper bucket never slows a run down
  REQUIRE(t_small <= t0);
  REQUIRE(t_big <= t_small);
  // Token conservation: whatever crosses a link by time T is at most the depth plus T x rate. Every
  // rank's egress carries its share of the wire bytes (the symmetric schedules give each rank the
  // same), so T >= (wire bytes per rank - depth) / rate; with the bucket as deep as all of them
  // it can reach 0 but never go below.
  const std::size_t seg = sim::segment_elems(c, plain.segment_bytes), chunk = n / size;
  const double per_rank = 2.0 * (size - 1) * static_cast<double>(sim::chunk_wire_bytes(c, chunk, seg));
  for (double depth : {64.0 * 1024, 1024.0 * 1024})
    REQUIRE(run(depth).time_s >= (per_rank - depth) / plain.nic.bandwidth_Bps * (1 - 1e-12));
  // fp32 gains less than a lossy codec, which computes between its messages and so refills
  const double one_bucket = (1 << 20) / plain.nic.bandwidth_Bps;
  if (!c.identity) REQUIRE(t0 - t_big > one_bucket);
}

TEST_CASE("the simulation fit recovers alpha, bandwidth, eta and the burst rate", "[sim][bucket]") {
  sim::cluster truth = gigabit();
  truth.segment_bytes = std::size_t{1} << 20;
  truth.nic = {900e-6, 100e6, 0.65, 0, 300e6};
  std::vector<bench::measured_run> runs;
  for (double burst : {128.0 * 1024, 256.0 * 1024, 1024.0 * 1024})
    for (const char* topo : {"ring", "torus2d"})
      for (const char* codec : {"fp32", "int8"})
        for (std::size_t mib : {4, 16, 64}) {
          sim::codec_model c = bench::codec_by_name(codec);
          c.rates = some_gamma();
          bench::measured_run m{{topo, 4, mib << 18}, c, 0, burst};
          m.seconds = bench::simulate(m, truth);
          runs.push_back(m);
        }
  // start where a closed-form fit would: no bucket, a rough latency and rate
  sim::link_params start{100e-6, 120e6, 0.8};
  const sim::fit_result f = bench::fit_by_simulation(runs, truth, start);
  CAPTURE(f.link.latency_s, f.link.bandwidth_Bps, f.link.exchange_efficiency, f.link.burst_rate_Bps, f.rms_relative_error);
  REQUIRE(f.rms_relative_error < 0.005);
  REQUIRE(f.link.bandwidth_Bps == Approx(100e6).epsilon(0.02));
  REQUIRE(f.link.exchange_efficiency == Approx(0.65).epsilon(0.03));
  REQUIRE(f.link.latency_s == Approx(900e-6).epsilon(0.15));
  REQUIRE(f.link.burst_rate_Bps == Approx(300e6).epsilon(0.15));
}

TEST_CASE("a measurement is simulated with the segment size its bench line recorded", "[sim][fit]") {
  sim::cluster cl = gigabit();  // one segment at a time: every segment pays alpha, so the size shows
  cl.segment_bytes = std::size_t{1} << 20;
  const std::map<std::string, sim::codec_model> models{{"fp32", bench::codec_by_name("fp32")}};
  const std::string line =
      R"({"op":"all_reduce","topology":"ring","codec":"fp32","transport":"mpi","ranks":4,"bytes":16777216,"time_us":250000.0)";
  const auto plain = bench::run_of(*bench::parse_json_line(line + "}"), models, 0);
  const auto small = bench::run_of(*bench::parse_json_line(line + R"(,"segment_bytes":262144})"), models, 0);
  REQUIRE(plain);
  REQUIRE(small);
  REQUIRE(plain->segment_bytes == 0);
  REQUIRE(small->segment_bytes == 262144);
  sim::cluster quarter = cl;
  quarter.segment_bytes = 262144;
  REQUIRE(bench::simulate(*small, cl) == bench::simulate(*plain, quarter));
  REQUIRE(bench::simulate(*small, cl) > bench::simulate(*plain, cl));  // 4x the segments, 4x the alphas
  for (const char* bad : {R"("many")", "-1", "0", "1e6", "12abc", "99999999999999999999999"}) {
    const auto o = bench::parse_json_line(line + ",\"segment_bytes\":" + bad + "}");
    REQUIRE(o);
    REQUIRE_THROWS_WITH(bench::run_of(*o, models, 0), Catch::Contains("segment_bytes"));
  }
}

TEST_CASE("a bucket the simulator cannot model is refused", "[sim][bucket]") {
  sim::cluster cl = gigabit();
  cl.nic.burst_bytes = -1;
  REQUIRE_THROWS_WITH(sim::simulator(cl, bench::codec_by_name("fp32")), Catch::Contains("burst_bytes"));
  cl.nic.burst_bytes = 1 << 16;
  cl.nic.burst_rate_Bps = cl.nic.bandwidth_Bps / 2;  // slower than the rate: not a burst
  REQUIRE_THROWS_WITH(sim::simulator(cl, bench::codec_by_name("fp32")), Catch::Contains("above the bandwidth"));
  cl.nic.burst_rate_Bps = 0;
  cl.switch_bandwidth_Bps = 1e9;
  REQUIRE_THROWS_WITH(sim::simulator(cl, bench::codec_by_name("fp32")), Catch::Contains("shared core"));
}

TEST_CASE("the simulation fit holds eta at 1 without exchanges and refuses empty measurements", "[sim][bucket]") {
  sim::cluster truth = gigabit();
  truth.nic = {300e-6, 100e6, 1.0, 128 * 1024, 0};
  std::vector<bench::measured_run> runs;
  for (std::size_t mib : {4, 16, 64}) {  // 4-rank rings only: every step one-way
    sim::codec_model c = bench::codec_by_name("int8");
    c.rates = some_gamma();
    bench::measured_run m{{"ring", 4, mib << 18}, c, 0, -1};
    m.seconds = bench::simulate(m, truth);
    runs.push_back(m);
  }
  const sim::fit_result f = bench::fit_by_simulation(runs, truth, {100e-6, 120e6, 0.7});
  REQUIRE(f.eta_tied);
  REQUIRE(f.link.exchange_efficiency == 1.0);
  REQUIRE(f.exchange_samples == 0);
  runs[1].seconds = 0;
  REQUIRE_THROWS_WITH(bench::fit_by_simulation(runs, truth, {100e-6, 120e6, 0.7}), Catch::Contains("measurement"));
}

TEST_CASE("sends running ahead by a window: shortcut = event run, an endless window = send-ahead", "[sim][ahead]") {
  const bool torus = GENERATE(false, true);
  const int size = GENERATE(4, 12);
  const int ahead = GENERATE(1, 2, sim::cluster::as_executor);
  sim::cluster cl = gigabit();
  cl.segments_ahead = ahead;
  cl.nic.burst_bytes = 64 * 1024;
  sim::codec_model c = bench::codec_by_name(GENERATE(as<std::string>{}, "fp32", "dyntree8"));
  c.rates = some_gamma();
  const std::size_t n = static_cast<std::size_t>(size) * 98304;  // several segments per step
  sim::simulator s(cl, c);
  s.set_symmetry_checks(0);
  auto fast = torus ? s.all_reduce(topology::torus2d{}, size, n) : s.all_reduce(topology::ring{}, size, n);
  REQUIRE(s.last_was_symmetric());
  CAPTURE(torus, size, ahead, c.name);
  REQUIRE(fast.time_s == Approx(full_run(cl, c, size, n, torus)).epsilon(1e-12));
  // the lockstep executor sends every fp32 segment of a step at once: that is send-ahead
  if (ahead == sim::cluster::as_executor && c.identity) {
    sim::cluster all = cl;
    all.segments_ahead = 0;
    all.send_ahead = true;
    REQUIRE(fast.time_s == full_run(all, c, size, n, torus));
  }
  // a window never slows a contention-free run down, and more of it never does either
  sim::cluster none = cl;
  none.segments_ahead = 0;
  REQUIRE(fast.time_s <= full_run(none, c, size, n, torus) * (1 + 1e-12));
}

TEST_CASE("a negative window other than as_executor is refused", "[sim][ahead]") {
  sim::cluster cl = gigabit();
  cl.segments_ahead = -2;
  REQUIRE_THROWS_WITH(sim::simulator(cl, bench::codec_by_name("fp32")), Catch::Contains("segments_ahead"));
}

namespace {
// The lockstep::error that f throws; fails the test when f throws nothing or another type.
template <class F>
lockstep::error error_of(F&& f) {
  try {
    f();
  } catch (const lockstep::error& e) {
    return e;
  } catch (const std::exception& e) {
    FAIL("threw something other than lockstep::error: " << e.what());
  }
  FAIL("threw nothing");
  throw;  // not reached: FAIL throws
}
}  // namespace

TEST_CASE("the cost model and the simulator throw lockstep::error naming the operation", "[sim][error]") {
  const sim::codec_model c = bench::codec_by_name("fp32");
  SECTION("closed forms refuse groups and sizes they do not cover") {
    auto e = error_of([&] { sim::ring_terms(0, 64, c, 1 << 20); });
    CHECK(e.code() == errc::invalid_argument);
    CHECK(e.op() == "sim::ring_terms");
    CHECK_THAT(e.detail(), Catch::Contains("group size 0"));
    e = error_of([&] { sim::ring_terms(4, 10, c, 1 << 20); });
    CHECK(e.code() == errc::invalid_argument);
    CHECK_THAT(e.detail(), Catch::Contains("10 values do not split into 4 equal chunks"));
    e = error_of([&] { sim::torus2d_terms(0, 4, 64, c, 1 << 20); });
    CHECK(e.op() == "sim::torus2d_terms");
    CHECK_THAT(e.detail(), Catch::Contains("shape 0x4"));
    e = error_of([&] { sim::halving_doubling_terms(6, 60, c, 1 << 20); });
    CHECK(e.op() == "sim::halving_doubling_terms");
    CHECK_THAT(e.detail(), Catch::Contains("power-of-two group, not 6 ranks"));
  }
  SECTION("a cluster the simulator cannot model") {
    sim::cluster cl = gigabit();
    cl.ranks_per_host = 0;
    const auto e = error_of([&] { sim::simulator(cl, c); });
    CHECK(e.code() == errc::invalid_argument);
    CHECK(e.op() == "sim::simulator");
    CHECK(e.rank() == -1);
    CHECK_THAT(e.detail(), Catch::Contains("ranks_per_host must be >= 1, not 0"));
  }
  SECTION("a group of no ranks") {
    sim::simulator s(gigabit(), c);
    const auto e = error_of([&] { s.run(0, 64, [](int r) { return topology::all_reduce_schedule(topology::ring{}, r, 1); }); });
    CHECK(e.code() == errc::invalid_argument);
    CHECK(e.op() == "sim::simulator::run");
  }
  SECTION("ranks whose schedules cut the buffer differently disagree: a mismatch naming the rank") {
    sim::simulator s(gigabit(), c);
    const auto e = error_of([&] {
      s.run(3, 96, [](int r) {
        topology::schedule sc = topology::all_reduce_schedule(topology::ring{}, r, 3);
        if (r == 2) sc.chunks = 6;
        return sc;
      });
    });
    CHECK(e.code() == errc::mismatch);
    CHECK(e.rank() == 2);
    CHECK(e.peer() == 0);
    CHECK_THAT(e.detail(), Catch::Contains("6 chunks, rank 0's into 3"));
  }
  SECTION("schedules that never meet: a mismatch naming the stuck rank and the peer it waits for") {
    sim::simulator s(gigabit(), c);
    const auto e = error_of([&] {
      s.run(2, 64, [](int r) {
        // rank 1 has nothing to do, so rank 0 waits for it forever
        if (r == 1) return topology::schedule{1, 2, 2, {}, {1, 1}};
        return topology::all_reduce_schedule(topology::ring{}, r, 2);
      });
    });
    CHECK(e.code() == errc::mismatch);
    CHECK(e.op() == "sim::simulator::run");
    CHECK(e.rank() == 0);
    CHECK(e.peer() == 1);
    CHECK_THAT(e.detail(), Catch::Contains("never finished (stuck at step 0 of 2)"));
  }
  SECTION("a fit without enough measurements") {
    const auto e = error_of([] { sim::fit_alpha_beta({sim::sample{1, 1000, 0, 1e-3, 0}}); });
    CHECK(e.code() == errc::invalid_argument);
    CHECK(e.op() == "sim::fit_alpha_beta");
    CHECK_THAT(e.detail(), Catch::Contains("at least two measurements"));
  }
  SECTION("lockstep-sim's tooling: an unknown codec name") {
    const auto e = error_of([] { bench::codec_by_name("fp16"); });
    CHECK(e.code() == errc::invalid_argument);
    CHECK(e.op() == "bench::codec_by_name");
    CHECK_THAT(e.detail(), Catch::Contains("unknown codec 'fp16'"));
  }
}

namespace {
// A ring that does not declare its symmetry: the simulator must run every rank.
struct plain_ring {
  topology::ring r;
  std::string name() const { return "plain_ring"; }
  void validate(int size) const { r.validate(size); }
  topology::schedule reduce_scatter(int rank, int size) const { return r.reduce_scatter(rank, size); }
  topology::schedule all_gather(int rank, int size) const { return r.all_gather(rank, size); }
};
// A 2 x C torus that claims to be a 1 x N ring: its row steps do not move along the ring.
struct false_claim : topology::torus2d {
  false_claim() : topology::torus2d{2, 4} {}
  topology::grid_symmetry symmetry(int size) const { return {1, size}; }
};
}  // namespace

TEST_CASE("the simulator takes the shortcut where the topology declares its symmetry, and checks it", "[sim][symmetry]") {
  static_assert(!topology::symmetric_topology<plain_ring> && topology::symmetric_topology<false_claim>);
  sim::codec_model c = bench::codec_by_name("int8");
  c.rates = some_gamma();
  const sim::cluster cl = gigabit();
  const std::size_t n = 8 * 24576;
  sim::simulator s(cl, c);
  s.set_symmetry_checks(0);
  const double ring = s.all_reduce(topology::ring{}, 8, n).time_s;
  REQUIRE(s.last_was_symmetric());
  SECTION("no declared symmetry: every rank runs, to the same time") {
    REQUIRE(s.all_reduce(plain_ring{}, 8, n).time_s == Approx(ring).epsilon(1e-12));
    REQUIRE_FALSE(s.last_was_symmetric());
  }
  SECTION("a symmetry the schedules do not have is not trusted") {
    const double t = s.all_reduce(false_claim{}, 8, n).time_s;
    REQUIRE_FALSE(s.last_was_symmetric());
    REQUIRE(t == Approx(full_run(cl, c, 8, n, true)).epsilon(1e-12));  // torus2d{} of 8 is 2 x 4
  }
}

TEST_CASE("the cost model and the simulator cut and pipeline segments by the executor's rules", "[sim][pipeline]") {
  const sim::codec_model d = bench::codec_by_name("dyntree8");
  for (std::size_t bytes : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20, pipeline::whole_chunk})
    CHECK(sim::segment_elems(d, bytes) == pipeline::segment_elems(d.block, bytes));
  SECTION("a whole-chunk segment (the device's) is one message per chunk") {
    CHECK(sim::chunk_segments(1000, sim::segment_elems(d, pipeline::whole_chunk)) == 1);
    sim::cluster whole = gigabit(), big = gigabit();
    whole.segment_bytes = pipeline::whole_chunk;
    big.segment_bytes = std::size_t{1} << 30;  // above any chunk here
    sim::codec_model c = d;
    c.rates = some_gamma();
    const std::size_t n = 6 * 40000;
    const double t = full_run(whole, c, 6, n, false);
    REQUIRE(t == Approx(full_run(big, c, 6, n, false)).epsilon(1e-12));
    REQUIRE(t == Approx(closed(whole, c, 6, n, false)).epsilon(1e-9));
  }
  SECTION("as_executor is pipeline::sends_ahead: a lossy codec runs lossy_sends_ahead segments ahead") {
    sim::codec_model c = d;
    c.rates = some_gamma();
    sim::cluster executor = gigabit();
    executor.nic.latency_s = 10e-3;  // above a segment's 2 ms on the wire: the window shows
    sim::cluster window = executor;
    executor.segments_ahead = sim::cluster::as_executor;
    window.segments_ahead = static_cast<int>(pipeline::lossy_sends_ahead);
    const std::size_t n = 4 * 524288;  // 8 segments of 256 KiB per chunk: more than either window
    REQUIRE(full_run(executor, c, 4, n, false) == full_run(window, c, 4, n, false));
    window.segments_ahead = static_cast<int>(pipeline::lossy_sends_ahead) - 1;
    REQUIRE(full_run(executor, c, 4, n, false) != full_run(window, c, 4, n, false));
  }
}

TEST_CASE("lockstep-sim knows every codec by the name it prints, error feedback included", "[sim][fit]") {
  auto same = [](const sim::codec_model& a, const sim::codec_model& b) {
    CHECK(a.name == b.name);
    CHECK(a.identity == b.identity);
    CHECK(a.block == b.block);
    for (std::size_t n : {1u, 1000u, 1u << 20}) CHECK(a.wire_bytes(n) == b.wire_bytes(n));
  };
  same(bench::codec_by_name("fp32"), sim::model_of(codec::fp32{}));
  same(bench::codec_by_name("int8", 64), sim::model_of(codec::int8{64}));
  same(bench::codec_by_name("dyntree8+ef"), sim::model_of(codec::error_feedback<codec::dyntree8>{}));
  same(bench::codec_by_name("int8+ef", 64), sim::model_of(codec::error_feedback<codec::int8>{codec::int8{64}}));
  CHECK(bench::codec_by_name("dyntree8+ef").name == "dyntree8+ef");
  // fp32 under error feedback encodes (through the residual): not the identity on the wire path
  CHECK_FALSE(bench::codec_by_name("fp32+ef").identity);
  CHECK_THROWS_AS(bench::codec_by_name("+ef"), lockstep::error);
  CHECK_THROWS_AS(bench::codec_by_name("fp16+ef"), lockstep::error);
}

TEST_CASE("per-rank counts: equal counts as offsets change nothing; one-hot counts are a chain", "[sim][counts]") {
  sim::cluster cl = gigabit();
  cl.nic.latency_s = 0;
  const sim::codec_model c = bench::codec_by_name("fp32");
  for (int n : {2, 3, 5}) {
    const std::size_t count = 4u << 20;  // values
    std::vector<std::size_t> equal(static_cast<std::size_t>(n) + 1);
    for (int k = 0; k <= n; ++k) equal[static_cast<std::size_t>(k)] = lockstep::chunk_range(count, n, k).first;
    equal.back() = count;
    auto rs = [&](int r) { return topology::ring{}.reduce_scatter(r, n); };
    sim::simulator a(cl, c), b(cl, c);
    a.disable_symmetry();
    const double plain = a.run(n, count, rs, false).time_s;
    const double with = b.run(n, count, rs, false, std::span<const std::size_t>(equal)).time_s;
    CHECK(with == Approx(plain).epsilon(1e-12));
    // All values owned by rank n-1: its chunk passes n-1 hops, each the whole buffer at 1 Gbit/s.
    std::vector<std::size_t> hot(static_cast<std::size_t>(n) + 1, 0);
    hot.back() = count;
    sim::simulator h(cl, c);
    const double chain = h.run(n, count, rs, false, std::span<const std::size_t>(hot)).time_s;
    CHECK(chain == Approx((n - 1) * 4.0 * count / cl.nic.bandwidth_Bps).epsilon(0.01));
  }
  sim::simulator s(cl, c);
  const std::vector<std::size_t> bad = {0, 5, 9};
  CHECK_THROWS_WITH(s.run(2, 10, [](int r) { return topology::ring{}.all_gather(r, 2); }, false, std::span<const std::size_t>(bad)),
                    Catch::Contains("end at 9, not at the 10 values"));
  // Offsets that do not start at 0 or that fall would cut chunks of wrapped (size_t) lengths.
  const std::vector<std::size_t> late = {1, 5, 10}, falling = {0, 7, 3, 10};
  CHECK_THROWS_WITH(s.run(2, 10, [](int r) { return topology::ring{}.all_gather(r, 2); }, false, std::span<const std::size_t>(late)),
                    Catch::Contains("start at 1, not at 0"));
  CHECK_THROWS_WITH(s.run(3, 10, [](int r) { return topology::ring{}.reduce_scatter(r, 3); }, false,
                          std::span<const std::size_t>(falling)),
                    Catch::Contains("fall from 7 to 3 at chunk 2"));
}

TEST_CASE("halving_doubling's and recursive_doubling's schedules simulate to their closed forms on powers of two",
          "[sim][halving_doubling]") {
  const bool rd = GENERATE(false, true);
  const bool send_ahead = GENERATE(false, true);
  const std::string name = GENERATE(as<std::string>{}, "fp32", "bf16", "dyntree8");
  const int size = GENERATE(2, 4, 8, 16);
  const std::size_t n = std::size_t{1} << 20;
  sim::cluster cl = gigabit();
  cl.send_ahead = send_ahead;
  sim::codec_model c = bench::codec_by_name(name);
  if (!send_ahead) c.rates = some_gamma();
  CAPTURE(rd, send_ahead, name, size);
  sim::simulator s(cl, c);
  const double got = rd ? s.all_reduce(topology::recursive_doubling{}, size, n).time_s
                        : s.all_reduce(topology::halving_doubling{}, size, n).time_s;
  const double want = (rd ? sim::recursive_doubling_terms(size, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead)
                          : sim::halving_doubling_terms(size, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead))
                          .time(cl.nic, c.rates);
  REQUIRE(got == Approx(want).epsilon(1e-9));
}

// direct's reduce-scatter is a fan-in: the simulator finds it by the executor's rule and runs it as
// the executor does (every send at once, one pass over the copies of each segment).
TEST_CASE("pipeline::fan_in_end finds direct's fan-ins, fan_max steps at most, and nothing else", "[sim][direct]") {
  for (int size : {1, 2, 3, 4, 17, 20, 40}) {
    CAPTURE(size);
    for (int rank : {0, size / 2, size - 1}) {
      const topology::schedule d = topology::all_reduce_schedule(topology::direct{}, rank, size);
      // The reduce-scatter's size - 1 steps (2 ranks: one exchange, no fan) in fans of fan_max.
      std::size_t si = 0;
      for (std::size_t left = size > 2 ? static_cast<std::size_t>(size - 1) : 0; left > 0;) {
        const std::size_t m = std::min(left, pipeline::fan_max);
        CHECK(pipeline::fan_in_end(d, si) == si + m);
        si += m, left -= m;
      }
      for (; si < d.steps.size(); ++si) CHECK(pipeline::fan_in_end(d, si) == si + 1);
      for (const auto& topo : {topology::all_reduce_schedule(topology::ring{}, rank, size),
                               topology::all_reduce_schedule(topology::halving_doubling{}, rank, size)})
        for (std::size_t i = 0; i < topo.steps.size(); ++i) CHECK(pipeline::fan_in_end(topo, i) == i + 1);
    }
  }
}

TEST_CASE("direct's fan-in: sends at once, one pass of (m + 2) / 3 decode-adds for fp32, m for a lossy codec",
          "[sim][direct]") {
  // Links that cost nothing: what is left is the reduction (the reduce-scatter alone, as
  // reduce_scatter calls it).
  sim::cluster cl;
  cl.nic = {0.0, 1e18};
  cl.local = cl.nic;
  cl.segment_bytes = 64 * 1024;
  cl.segments_ahead = sim::cluster::as_executor;
  const double gamma = 1e-9;
  for (const char* name : {"fp32", "int8"}) {
    sim::codec_model c = bench::codec_by_name(name);
    c.rates = {0, 0, gamma};
    for (int size : {3, 4, 17, 20}) {
      CAPTURE(name, size);
      const std::size_t n = static_cast<std::size_t>(size) * 65536;  // a chunk is 4 segments
      sim::simulator s(cl, c);
      const double t = s.run(size, n, [&](int r) { return topology::direct{}.reduce_scatter(r, size); }, false).time_s;
      double passes = 0;  // decode-adds per value of the chunk
      for (std::size_t left = static_cast<std::size_t>(size - 1); left > 0;) {
        const double m = static_cast<double>(std::min(left, pipeline::fan_max));
        passes += c.identity ? (m + 2) / 3 : m;
        left -= static_cast<std::size_t>(m);
      }
      CHECK(t == Approx(65536 * gamma * passes).epsilon(1e-6));  // the links: 1e-13 s a message
      // The ring adds each copy in a pass of its own.
      const double ring = s.run(size, n, [&](int r) { return topology::ring{}.reduce_scatter(r, size); }, false).time_s;
      CHECK(ring == Approx(65536 * gamma * (size - 1)).epsilon(1e-6));
    }
  }
}

TEST_CASE("direct's fan-ins on the symmetric shortcut equal the full event run", "[sim][direct]") {
  for (const char* name : {"fp32", "dyntree8"})
    for (double eta : {1.0, 0.7})
      for (int size : {1, 2, 3, 4, 5, 8, 17, 20}) {
        CAPTURE(name, eta, size);
        sim::cluster cl = gigabit();
        cl.nic.exchange_efficiency = eta;  // direct's step N/2 of an even N is an exchange
        cl.nic.overhead_s = 2e-6;
        cl.segments_ahead = sim::cluster::as_executor;
        sim::codec_model c = bench::codec_by_name(name);
        c.rates = some_gamma();
        for (std::size_t per : {std::size_t{1}, std::size_t{1000}, std::size_t{262144}}) {
          CAPTURE(per);
          const std::size_t n = per * static_cast<std::size_t>(size);
          sim::simulator s(cl, c), full(cl, c);
          s.set_symmetry_checks(0);
          full.disable_symmetry();
          const sim::result a = s.all_reduce(topology::direct{}, size, n);
          CHECK(s.last_was_symmetric());
          const sim::result b = full.all_reduce(topology::direct{}, size, n);
          CHECK(a.time_s == Approx(b.time_s).epsilon(1e-12));
          CHECK(a.messages == b.messages);
        }
      }
}

TEST_CASE("an fp32 fan-in waits for its peers' headers; local links are not paced", "[sim][direct]") {
  const sim::codec_model f = bench::codec_by_name("fp32");
  SECTION("latency-bound: the ring pays a latency per step, a fan the headers' and one more") {
    sim::cluster cl;
    cl.nic = {1e-3, 1e18};
    cl.segments_ahead = sim::cluster::as_executor;
    for (int size : {3, 4, 9}) {
      CAPTURE(size);
      sim::simulator s(cl, f);
      const std::size_t n = 64 * static_cast<std::size_t>(size);
      auto rs = [&](const auto& topo) { return s.run(size, n, [&](int r) { return topo.reduce_scatter(r, size); }, false).time_s; };
      CHECK(rs(topology::ring{}) == Approx((size - 1) * 1e-3).epsilon(1e-6));
      CHECK(rs(topology::direct{}) == Approx(2e-3).epsilon(1e-6));
      cl.handshake = false;
      sim::simulator quiet(cl, f);
      CHECK(quiet.run(size, n, [&](int r) { return topology::direct{}.reduce_scatter(r, size); }, false).time_s ==
            Approx(1e-3).epsilon(1e-6));
      cl.handshake = true;
    }
  }
  SECTION("ranks of one host: local links are not shared, so sending to all peers at once pays") {
    sim::cluster cl;
    cl.nic = cl.local = {0.0, 1e9};
    cl.ranks_per_host = 4;
    cl.segments_ahead = sim::cluster::as_executor;
    sim::simulator s(cl, f);
    const std::size_t n = std::size_t{1} << 24;  // 64 MiB
    auto rs = [&](const auto& topo) { return s.run(4, n, [&](int r) { return topo.reduce_scatter(r, 4); }, false).time_s; };
    const double ring = rs(topology::ring{}), direct = rs(topology::direct{});
    // A local link carries each message at its own rate (the 1 MiB segments of a step side by
    // side): a ring step is one segment's time, and direct's three steps are one step.
    CHECK(ring == Approx(3.0 * (1 << 20) / 1e9).epsilon(0.01));
    CHECK(direct == Approx(ring / 3).epsilon(0.01));
  }
}

TEST_CASE("direct simulates no slower than a ring on the NIC (fp32: but for the headers), for N = 1..32", "[sim][direct]") {
  sim::cluster cl = gigabit();
  cl.segments_ahead = sim::cluster::as_executor;
  for (const char* name : {"fp32", "dyntree8"}) {
    sim::codec_model c = bench::codec_by_name(name);
    c.rates = some_gamma();
    for (int size = 1; size <= 32; ++size) {
      CAPTURE(name, size);
      sim::simulator s(cl, c);
      for (std::size_t n : {std::size_t{1024}, std::size_t{1} << 22}) {
        CAPTURE(n);
        const double d = s.all_reduce(topology::direct{}, size, n).time_s;
        CHECK(s.last_was_symmetric() == (n % static_cast<std::size_t>(size) == 0));
        const double ring = s.all_reduce(topology::ring{}, size, n).time_s;
        // An fp32 fan waits for the headers, which a ring's first step is sent beside.
        const bool fans = size > 2;
        const double headers = fans && c.identity ? cl.nic.latency_s + double(sim::header_bytes) / cl.nic.bandwidth_Bps : 0;
        CHECK(d <= ring * 1.001 + headers);
        // The same bytes on the same links: what it saves is waiting, never more than the ring's
        // latencies and codec work.
        if (size > 2 && n > 1024) CHECK(d >= ring * 0.7);
      }
    }
  }
  SECTION("flows to many peers share the egress: bandwidth-bound, direct takes the ring's time") {
    sim::cluster nic;
    nic.nic = {0.0, 1e9};
    nic.segments_ahead = sim::cluster::as_executor;
    const sim::codec_model f = bench::codec_by_name("fp32");
    for (int size : {3, 4, 8}) {
      CAPTURE(size);
      sim::simulator s(nic, f);
      const std::size_t n = std::size_t{1} << 24;  // 64 MiB
      const double d = s.all_reduce(topology::direct{}, size, n).time_s;
      const double wire = 2.0 * (size - 1) / size * 4.0 * static_cast<double>(n) / 1e9;
      CHECK(d == Approx(wire).epsilon(0.01));
    }
  }
}

TEST_CASE("the latency topologies run in the simulator for N = 1..64 and win where alpha dominates", "[sim][halving_doubling]") {
  sim::cluster cl = gigabit();
  cl.segments_ahead = sim::cluster::as_executor;  // fp32 posts a step's sends at once: alpha per step
  const sim::codec_model c = bench::codec_by_name("fp32");
  for (int size = 1; size <= 64; ++size) {
    CAPTURE(size);
    sim::simulator s(cl, c);
    const std::size_t small = 1024, large = std::size_t{1} << 22;  // 4 KiB, 16 MiB
    const double rd = s.all_reduce(topology::recursive_doubling{}, size, small).time_s;
    const double hd = s.all_reduce(topology::halving_doubling{}, size, small).time_s;
    const double ring = s.all_reduce(topology::ring{}, size, small).time_s;
    if (size >= 4) {
      CHECK(rd < hd);
      CHECK(hd < ring);
    }
    // At 16 MiB on a power of two the whole-buffer exchanges lose to halving-doubling, which
    // matches the ring's bandwidth term. (Folded ranks cost halving-doubling most of two more
    // passes of the buffer and an uneven split, since a virtual rank of a folded pair stands for two
    // chunks: there recursive doubling's four passes can come out ahead. The cost model says so
    // per case, which is what topology::automatic asks.)
    const double rd_l = s.all_reduce(topology::recursive_doubling{}, size, large).time_s;
    const double hd_l = s.all_reduce(topology::halving_doubling{}, size, large).time_s;
    const double ring_l = s.all_reduce(topology::ring{}, size, large).time_s;
    if (size >= 2 && (size & (size - 1)) == 0) {
      if (size >= 4) CHECK(hd_l < rd_l);
      CHECK(hd_l <= ring_l * 1.01);
    }
  }
}

TEST_CASE("a per-message overhead makes many small segments cost more than few large ones", "[sim][overhead]") {
  sim::cluster cl = gigabit();
  cl.nic = {5e-6, 10e9};
  cl.segments_ahead = sim::cluster::as_executor;
  const sim::codec_model c = bench::codec_by_name("fp32");
  const std::size_t n = std::size_t{1} << 22;  // 16 MiB over 4 ranks: 4 MiB chunks
  auto time = [&](double o, std::size_t seg) {
    sim::cluster x = cl;
    x.nic.overhead_s = o;
    x.segment_bytes = seg;
    sim::simulator s(x, c);
    const double sym = s.all_reduce(topology::ring{}, 4, n).time_s;
    s.disable_symmetry();
    REQUIRE(s.all_reduce(topology::ring{}, 4, n).time_s == Approx(sym).epsilon(1e-12));  // both paths charge it
    return sym;
  };
  // Without it the segment size changes (almost) nothing for fp32, whose sends go out at once.
  CHECK(time(0, 64 << 10) == Approx(time(0, 4 << 20)).epsilon(0.02));
  // With it each of the 64 segments of a 4 MiB chunk pays o twice, at 4 MiB segments only once.
  CHECK(time(20e-6, 64 << 10) > time(20e-6, 4 << 20) + 6 * 63 * 20e-6);
}

// ---- sim/hybrid.hpp: the hybrid and data-parallel steps, and cores the two lanes share ----------

namespace {

const sim::fc_head small_head{4, 8, 64, 128, 128, 10};

template <class S>
sim::step_estimate hybrid(const sim::cluster& cl, const sim::codec_model& c, double flops, sim::host_cores cores = {}) {
  return sim::hybrid_step<S>(cl, c, sim::model_of(codec::fp32{}), small_head, flops, cores);
}

}  // namespace

TEST_CASE("host_cores: the share of a collective's CPU part that the products lose", "[sim][hybrid]") {
  CHECK(sim::host_cores{}.serial() == 0.0);           // unset: a core per lane
  CHECK(sim::host_cores{0.5, 1}.serial() == 1.0);     // netlab: 4 hosts on 2 cores
  CHECK(sim::host_cores{1.0, 1}.serial() == 1.0);
  CHECK(sim::host_cores{1.5, 1}.serial() == 0.5);
  CHECK(sim::host_cores{2.0, 1}.serial() == 0.0);     // the worker has a core of its own
  CHECK(sim::host_cores{8.0, 4}.serial() == 0.0);
  CHECK(sim::host_cores{4.0, 4}.serial() == 1.0);
}

TEST_CASE("a hybrid step is its products on free links and its collectives at infinite flops", "[sim][hybrid]") {
  sim::cluster free_links;
  free_links.nic = {0.0, 1e18};
  free_links.local = {0.0, 1e18};
  const auto f32 = sim::model_of(codec::fp32{});
  for (const sim::host_cores cores : {sim::host_cores{}, sim::host_cores{0.5, 1}}) {
    for (const auto& e : {hybrid<parallel::gather_all>(free_links, f32, 1e9, cores),
                          hybrid<parallel::by_rank>(free_links, f32, 1e9, cores),
                          hybrid<parallel::by_slice>(free_links, f32, 1e9, cores)}) {
      CHECK(e.comm_s == Approx(0.0).margin(1e-12));
      CHECK(e.step_s == Approx(e.compute_s).epsilon(1e-9));
    }
    const auto dp = sim::data_parallel_step(free_links, f32, small_head, 1e9, cores);
    CHECK(dp.step_s == Approx(dp.compute_s).epsilon(1e-9));
  }
  // Products free: the collectives one after another on the wire.
  const sim::cluster cl = gigabit();
  for (const auto& e : {hybrid<parallel::gather_all>(cl, f32, 1e30), hybrid<parallel::by_rank>(cl, f32, 1e30),
                        hybrid<parallel::by_slice>(cl, f32, 1e30)}) {
    CHECK(e.compute_s < 1e-12);
    CHECK(e.step_s == Approx(e.comm_s).epsilon(1e-9));
  }
}

TEST_CASE("shared cores: overlapped rounds give their CPU part to the products, never more", "[sim][hybrid]") {
  sim::cluster cl = gigabit();
  cl.nic.latency_s = 500e-6;  // latency-bound rounds, as netlab's
  const auto f32 = sim::model_of(codec::fp32{});
  const auto lossy = sim::model_of(codec::dyntree8{}, some_gamma());
  const double flops = 1e7;  // a round's products (ms) of the order of a round's collective
  const sim::host_cores shared{0.5, 1}, own{2.0, 1};
  auto check = [&](const sim::step_estimate& free, const sim::step_estimate& contended, bool many_rounds) {
    CHECK(contended.compute_s == Approx(free.compute_s));
    CHECK(contended.comm_s == Approx(free.comm_s));
    CHECK(contended.step_s >= free.step_s);
    // Each lane's work once, one after the other: the most that sharing can cost.
    CHECK(contended.step_s <= free.compute_s + free.comm_s + 1e-12);
    // Every step here has a collective beside products: (b) and (c) most of their rounds, (a) its
    // last reduce round beside dW1, data-parallel its first two all-reduces beside backward.
    CHECK(contended.step_s > free.step_s);
    if (many_rounds) CHECK(contended.step_s > free.step_s * 1.01);
  };
  for (const auto* c : {&f32, &lossy}) {
    // (b) and (c) move round r + 1 while round r's product runs: every such round costs the products.
    check(hybrid<parallel::by_rank>(cl, *c, flops), hybrid<parallel::by_rank>(cl, *c, flops, shared), true);
    check(hybrid<parallel::by_slice>(cl, *c, flops), hybrid<parallel::by_slice>(cl, *c, flops, shared), true);
    check(hybrid<parallel::gather_all>(cl, *c, flops), hybrid<parallel::gather_all>(cl, *c, flops, shared), false);
    check(sim::data_parallel_step(cl, *c, small_head, flops), sim::data_parallel_step(cl, *c, small_head, flops, shared),
          false);
    // A core of its own for the worker: as if unset.
    CHECK(hybrid<parallel::by_slice>(cl, *c, flops, own).step_s == hybrid<parallel::by_slice>(cl, *c, flops).step_s);
  }
  // The CPU part is the latency and the codec's work: with neither, sharing costs nothing.
  cl.nic.latency_s = 0;
  cl.local.latency_s = 0;
  CHECK(hybrid<parallel::by_slice>(cl, f32, flops, shared).step_s ==
        Approx(hybrid<parallel::by_slice>(cl, f32, flops).step_s).epsilon(1e-9));
  CHECK(sim::detail::without_wire(cl).nic.bandwidth_Bps > 1e15);
}

TEST_CASE("busy latency: a collective beside the products moves at the busy pace while they run, idle after",
          "[sim][hybrid]") {
  // The blend of sim::detail::timeline::running, by hand.
  sim::detail::timeline t;
  t.serial = 1.0;
  const sim::detail::cost x{2.0, 0.5, 6.0};  // 2 s idle, 6 s with every message at the busy alpha
  CHECK(t.running(x, 10.0, 10.0) == 2.0);  // nothing runs beside it
  CHECK(t.running(x, 10.0, 9.0) == 2.0);
  CHECK(t.running(x, 0.0, 8.0) == 6.0);    // beside the products throughout
  CHECK(t.running(x, 0.0, 3.0) == Approx(3.0 + 0.5 * 2.0));  // half its messages busy, the rest idle
  t.serial = 0.0;  // a core for the worker: it never waits for the products' threads
  CHECK(t.running(x, 0.0, 8.0) == 2.0);
  t.serial = 1.0;
  CHECK(t.running(sim::detail::cost{2.0, 0.5, 0.0}, 0.0, 8.0) == 2.0);  // no busy pace simulated
  CHECK(t.running(x, 0.0, 1.0) == Approx(1.0 + 5.0 / 6.0 * 2.0));     // a window shorter than its idle time
  t.busy_pace = false;
  CHECK(t.running(x, 0.0, 8.0) == 2.0);
  t.busy_pace = true;

  // The phases, by hand (serial 1, no CPU part: only the pace moves). Gather: round 0 at the idle
  // pace (nothing before it), round 1 beside round 0's product: busy for 2 s of its 5, 1 s idle
  // for the 3/5 left: ends at 1 + 2 + 0.6.
  {
    sim::detail::timeline g;
    g.serial = 1.0;
    sim::detail::gather_phase(g, {{1, 0, 5}, {1, 0, 5}}, {2, 2});
    CHECK(g.comm == Approx(3.6));
    CHECK(g.compute == Approx(5.6));
    // Reduce: product 0 (1 s), round 0 beside product 1 and the overlap work (2 s: 2/5 busy, 0.6 s
    // idle), round 1 beside the overlap work only (1 s of it left: 1/5 busy, 0.8 s idle).
    sim::detail::timeline r;
    r.serial = 1.0;
    sim::detail::reduce_phase(r, {1, 1}, {{1, 0, 5}, {1, 0, 5}}, 1.0);
    CHECK(std::max(r.compute, r.comm) == Approx(4.6));
    r = {};
    r.serial = 1.0;
    r.busy_pace = false;
    sim::detail::reduce_phase(r, {1, 1}, {{1, 0, 5}, {1, 0, 5}}, 1.0);
    CHECK(std::max(r.compute, r.comm) == Approx(3.0));
  }

  sim::cluster cl = gigabit();
  cl.nic.latency_s = 200e-6;
  cl.nic.bandwidth_Bps /= 100;  // rounds whose wire time outweighs their latency, as netlab's (b) broadcasts
  const auto f32 = sim::model_of(codec::fp32{});
  const double flops = 1e7;
  const sim::host_cores shared{0.5, 1}, busy{0.5, 1, 20e-3}, low{0.5, 1, 100e-6}, own{2.0, 1, 20e-3};
  sim::cluster all_busy = cl;
  all_busy.nic.latency_s = all_busy.local.latency_s = 20e-3;
  auto same = [](const sim::step_estimate& a, const sim::step_estimate& b) { CHECK(a.step_s == Approx(b.step_s).epsilon(1e-12)); };
  // A busy alpha at or below the idle one, or a core of its own for the worker: nothing changes.
  same(hybrid<parallel::by_slice>(cl, f32, flops, low), hybrid<parallel::by_slice>(cl, f32, flops, shared));
  same(hybrid<parallel::by_slice>(cl, f32, flops, own), hybrid<parallel::by_slice>(cl, f32, flops));
  same(sim::data_parallel_step(cl, f32, small_head, flops, own), sim::data_parallel_step(cl, f32, small_head, flops));
  // (b) and (c) move their rounds beside the products: slower, but never slower than every message busy.
  for (const auto& [with, without, bound] :
       {std::tuple{hybrid<parallel::by_rank>(cl, f32, flops, busy), hybrid<parallel::by_rank>(cl, f32, flops, shared),
                   hybrid<parallel::by_rank>(all_busy, f32, flops, shared)},
        std::tuple{hybrid<parallel::by_slice>(cl, f32, flops, busy), hybrid<parallel::by_slice>(cl, f32, flops, shared),
                   hybrid<parallel::by_slice>(all_busy, f32, flops, shared)}}) {
    CHECK(with.step_s > without.step_s * 1.01);
    CHECK(with.step_s <= bound.step_s + 1e-12);
    CHECK(with.compute_s == Approx(without.compute_s));
  }
  // (a) and data-parallel: only what overlaps products (a's last reduce round beside dW1; the
  // first two all-reduces beside backward) changes, never beyond every message busy.
  for (const auto& [with, without, bound] :
       {std::tuple{hybrid<parallel::gather_all>(cl, f32, flops, busy), hybrid<parallel::gather_all>(cl, f32, flops, shared),
                   hybrid<parallel::gather_all>(all_busy, f32, flops, shared)},
        std::tuple{sim::data_parallel_step(cl, f32, small_head, flops, busy),
                   sim::data_parallel_step(cl, f32, small_head, flops, shared),
                   sim::data_parallel_step(all_busy, f32, small_head, flops, shared)}}) {
    CHECK(with.step_s >= without.step_s);
    CHECK(with.step_s <= bound.step_s + 1e-12);
  }
  // data-parallel's first two all-reduces run beside backward, its last one after it: slower with
  // the busy alpha, faster than with every message busy.
  CHECK(sim::data_parallel_step(cl, f32, small_head, flops, busy).step_s >
        sim::data_parallel_step(cl, f32, small_head, flops, shared).step_s);
  CHECK(sim::data_parallel_step(cl, f32, small_head, flops, busy).step_s <
        sim::data_parallel_step(all_busy, f32, small_head, flops, shared).step_s);
}

TEST_CASE("busy latency never makes a step faster than its idle pace", "[sim][hybrid]") {
  // A busy round ends later, so the next one starts later, overlaps fewer products and charges them
  // less: the phases alone can come out shorter at the busy pace (these two do).
  {
    sim::detail::timeline b, i;
    b.serial = i.serial = 1.0;
    i.busy_pace = false;
    sim::detail::gather_phase(b, {{1, 0, 1}, {0.5, 0, 5}, {2.5, 2.5, 2.5}}, {1, 2, 0});
    sim::detail::gather_phase(i, {{1, 0, 1}, {0.5, 0, 5}, {2.5, 2.5, 2.5}}, {1, 2, 0});
    CHECK(sim::detail::step_end(b) < sim::detail::step_end(i));
  }
  // The steps take the later of the two, for every scheme, codec and busy alpha tried.
  sim::cluster cl = gigabit();
  cl.nic.latency_s = 200e-6;
  const auto f32 = sim::model_of(codec::fp32{});
  const auto lossy = sim::model_of(codec::dyntree8{}, some_gamma());
  for (const double bw : {1.0, 0.1, 0.01})
    for (const double busy : {300e-6, 1e-3, 5e-3, 20e-3})
      for (const double flops : {1e6, 1e7, 1e8})
        for (const auto* c : {&f32, &lossy}) {
          sim::cluster l = cl;
          l.nic.bandwidth_Bps *= bw;
          const sim::host_cores shared{0.5, 1}, with{0.5, 1, busy};
          INFO("bandwidth x" << bw << ", busy alpha " << busy << ", flops " << flops);
          CHECK(hybrid<parallel::gather_all>(l, *c, flops, with).step_s >= hybrid<parallel::gather_all>(l, *c, flops, shared).step_s);
          CHECK(hybrid<parallel::by_rank>(l, *c, flops, with).step_s >= hybrid<parallel::by_rank>(l, *c, flops, shared).step_s);
          CHECK(hybrid<parallel::by_slice>(l, *c, flops, with).step_s >= hybrid<parallel::by_slice>(l, *c, flops, shared).step_s);
          CHECK(sim::data_parallel_step(l, *c, small_head, flops, with).step_s >=
                sim::data_parallel_step(l, *c, small_head, flops, shared).step_s);
        }
}
