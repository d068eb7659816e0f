// lockstep-sim: predicted all-reduce time and bus bandwidth for topology x codec x ranks x size,
// the speedup of data-parallel training, and link parameters fitted from measurements.
//
//   lockstep-sim --ranks 16,256,4096 --bytes 64M --topology ring,torus2d --codec fp32,dyntree8
//   lockstep-sim --fit netlab.jsonl --compare      fit alpha/beta/eta, then predicted vs measured
//   lockstep-sim --speedup --ranks 96 --params 60M --compute-ms 100
// A table by default, one JSON object per line with --json. Every number the simulator prints is
// the discrete-event run of the topologies' own schedules (sim/simulator.hpp); "closed" is the
// alpha-beta-gamma formula (sim/cost_model.hpp) beside it.
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/sim/cost_model.hpp>
#include <lockstep/sim/fit.hpp>
#include <lockstep/sim/simulator.hpp>
#include <lockstep/topology.hpp>

#include "sim_fit.hpp"
#include "cli.hpp"

namespace {

using namespace lockstep;

// "64M" = 64 MiB, "1K" = 1 KiB, "1G" = 1 GiB; plain numbers are bytes (or counts). tc's byte
// units (256kb, 2mb: powers of 1024 too) are accepted, so netlab's "burst" reads as tc took it.
double parse_size(const std::string& s) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("'" + s + "' is not a size or count");
  }
  if (!std::isfinite(v)) throw std::invalid_argument("'" + s + "' is not a finite size or count");
  std::string unit = s.substr(used);
  for (char& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));  // tc ignores case
  if (unit.empty() || unit == "b") return v;
  if (unit == "k" || unit == "kb") return v * 1024;
  if (unit == "m" || unit == "mb") return v * 1024 * 1024;
  if (unit == "g" || unit == "gb") return v * 1024 * 1024 * 1024;
  throw std::invalid_argument("size '" + s + "': units are K, M, G (powers of 1024; tc's kb, mb, gb alike)");
}

struct options {
  std::vector<std::string> topologies{"ring", "torus2d"};
  std::vector<std::string> codecs{"fp32", "bf16", "int8", "dyntree8"};
  std::vector<int> ranks{4};
  std::vector<double> bytes{64.0 * 1024 * 1024};
  sim::cluster cl;
  bool json = false, measure_gamma = false, compare = false, speedup = false, explain = false;
  std::map<std::string, sim::codec_rates> gamma;  // --gamma-ns CODEC:E,D,A
  std::string fit_file, against_file;
  double compute_s = 0.1, params = 60e6, overlap = 0;
  double min_compare_bytes = 4.0 * 1024 * 1024;
  std::optional<std::vector<std::size_t>> segment_choices;  // --segment-choices; else automatic's own
  std::vector<std::size_t> direct_sizes;  // --direct-sizes (automatic::direct_sizes)
  // --explain's cache tier (topology::automatic::cache_bytes): --cache-bytes, --cache-latency-us,
  // --cache-gbit, --cache-gamma-ns
  std::size_t cache_bytes = 0;
  double cache_latency_s = -1, cache_bandwidth_Bps = -1;
  std::map<std::string, sim::codec_rates> cache_gamma;
  // --explain's bulk tier (topology::automatic::bulk_bytes): --bulk-bytes, --bulk-exchange-efficiency
  std::size_t bulk_bytes = 0;
  double bulk_eta = -1;
  bool bulk_set = false;
};

void usage() {
  std::puts(
      "usage: lockstep-sim [options]\n"
      "  --topology LIST      ring,torus2d,halving_doubling,recursive_doubling,direct (closed forms of\n"
      "                       the doublings for powers of two; otherwise, and for direct, whose\n"
      "                       fan-in has none, the closed column repeats the simulation)\n"
      "  --codec LIST         fp32,bf16,int8,dyntree8; NAME+ef: under error feedback\n"
      "  --ranks LIST         group sizes, e.g. 16,64,256,1024,4096\n"
      "  --bytes LIST         fp32 payload per rank, e.g. 1M,64M\n"
      "  --gbit G             NIC bandwidth per direction in Gbit/s (default 1)\n"
      "  --latency-us A       per-message latency alpha (default 25)\n"
      "  --overhead-us O      core time per message posted and per message read (LogP's o; default 0)\n"
      "  --exchange-efficiency E  fraction of the bandwidth a pairwise exchange (send peer =\n"
      "                       receive peer: ring of 2, torus row/column of 2) gets, (0,1] (default 1)\n"
      "  --ranks-per-host K   ranks sharing one NIC (default 1)\n"
      "  --switch-gbit G      shared switch core (default 0: non-blocking)\n"
      "  --segment-bytes B    the transport's segment size (default 1M); --fit: for lines\n"
      "                       without the bench's \"segment_bytes\"\n"
      "  --burst B            each NIC direction is a token bucket of B bytes (tc tbf's burst;\n"
      "                       default 0: a plain rate); --fit: for lines without netlab's \"burst\"\n"
      "  --burst-gbit G       how fast the bucket's bytes leave (default 0: at once)\n"
      "  --no-handshake       leave out the executor's header exchange\n"
      "  --send-ahead         model an executor that posts a step's sends before its receives\n"
      "  --ahead N|executor   sends lead receives by N segments (default 0, the closed forms'\n"
      "                       model); executor: as lockstep's does (fp32 all, lossy codecs 4)\n"
      "  --measure-gamma      measure codec encode/decode rates on this machine (else gamma = 0)\n"
      "  --fit FILE           fit alpha, beta and eta (exchange efficiency) to the JSON lines in\n"
      "                       FILE (bytes, time_us, ranks, topology, codec), then predict with them\n"
      "  --compare            with --fit: predicted against measured for every line of FILE\n"
      "  --against FILE2      with --fit: compare against FILE2 instead (out of sample)\n"
      "  --min-bytes B        --compare: the error summary covers sizes >= B (default 4M)\n"
      "  --speedup            data-parallel speedup: --params P (default 60M) --compute-ms T\n"
      "                       (default 100) --overlap F (default 0) over --ranks\n"
      "  --explain            what topology::automatic compares for each --ranks x --bytes x --codec:\n"
      "                       every candidate topology and segment size with its predicted time, the\n"
      "                       choice marked (the library's own function, on --latency-us, --gbit,\n"
      "                       --exchange-efficiency and --segment-bytes as the group's segment)\n"
      "  --segment-choices L  --explain: the segment sizes tried besides the group's (default\n"
      "                       256K,4M; none: only the group's), as the calibration leaves them\n"
      "  --direct-sizes L     --explain: direct is a candidate within a factor of two of these sizes\n"
      "                       (default none), as the calibration measured it faster than the ring;\n"
      "                       one of at least --bulk-bytes offers it from half that size up\n"
      "  --gamma-ns C:E,D,A   codec C's encode, decode, decode-add ns/value (as lockstep-bench-allreduce\n"
      "                       prints its calibration); repeatable\n"
      "  --cache-bytes B      --explain: calls of at most B bytes per rank are predicted on the cache\n"
      "                       tier: --cache-latency-us A, --cache-gbit G (default: the link's) and\n"
      "                       --cache-gamma-ns C:E,D,A (default: --gamma-ns), as the calibration prints\n"
      "  --bulk-bytes B       --explain: calls of at least B bytes per rank are predicted with\n"
      "                       exchanges at --bulk-exchange-efficiency E (the bulk tier), as printed\n"
      "  --json               one JSON object per line");
}

// A flag's value as a finite number ("lockstep-sim: stod" named neither the flag nor the value).
double number_of(const std::string& flag, const std::string& v) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || !std::isfinite(x)) throw std::invalid_argument(flag + ": '" + v + "' is not a finite number");
  return x;
}

options parse(int argc, char** argv) {
  options o;
  o.cl.nic = {25e-6, 1e9 / 8};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--topology") o.topologies = lockstep::bench::split_list(next());
    else if (a == "--codec") o.codecs = lockstep::bench::split_list(next());
    else if (a == "--ranks") {
      o.ranks.clear();
      for (auto& s : lockstep::bench::split_list(next())) o.ranks.push_back(static_cast<int>(parse_size(s)));
    } else if (a == "--bytes") {
      o.bytes.clear();
      for (auto& s : lockstep::bench::split_list(next())) o.bytes.push_back(parse_size(s));
    } else if (a == "--gbit") o.cl.nic.bandwidth_Bps = number_of(a, next()) * 1e9 / 8;
    else if (a == "--latency-us") o.cl.nic.latency_s = number_of(a, next()) * 1e-6;
    else if (a == "--overhead-us") o.cl.nic.overhead_s = number_of(a, next()) * 1e-6;
    else if (a == "--exchange-efficiency") {
      o.cl.nic.exchange_efficiency = number_of(a, next());
      if (!(o.cl.nic.exchange_efficiency > 0 && o.cl.nic.exchange_efficiency <= 1))
        throw std::invalid_argument("--exchange-efficiency must be in (0, 1]");
    }
    else if (a == "--ranks-per-host") o.cl.ranks_per_host = std::stoi(next());
    else if (a == "--switch-gbit") o.cl.switch_bandwidth_Bps = number_of(a, next()) * 1e9 / 8;
    else if (a == "--segment-bytes") o.cl.segment_bytes = static_cast<std::size_t>(parse_size(next()));
    else if (a == "--burst") o.cl.nic.burst_bytes = parse_size(next());
    else if (a == "--burst-gbit") o.cl.nic.burst_rate_Bps = number_of(a, next()) * 1e9 / 8;
    else if (a == "--no-handshake") o.cl.handshake = false;
    else if (a == "--send-ahead") o.cl.send_ahead = true;
    else if (a == "--ahead") {
      const std::string v = next();
      o.cl.segments_ahead = v == "executor" ? sim::cluster::as_executor : std::stoi(v);
      if (o.cl.segments_ahead < sim::cluster::as_executor) throw std::invalid_argument("--ahead: a count >= 0 or 'executor'");
    }
    else if (a == "--measure-gamma") o.measure_gamma = true;
    else if (a == "--fit") o.fit_file = next();
    else if (a == "--compare") o.compare = true;
    else if (a == "--against") o.against_file = next(), o.compare = true;
    else if (a == "--min-bytes") o.min_compare_bytes = parse_size(next());
    else if (a == "--speedup") o.speedup = true;
    else if (a == "--explain") o.explain = true;
    else if (a == "--segment-choices") {
      const std::string v = next();
      o.segment_choices.emplace();
      if (v != "none")
        for (auto& x : lockstep::bench::split_list(v)) o.segment_choices->push_back(static_cast<std::size_t>(parse_size(x)));
    }
    else if (a == "--direct-sizes") {
      for (auto& x : lockstep::bench::split_list(next())) o.direct_sizes.push_back(static_cast<std::size_t>(parse_size(x)));
    }
    else if (a == "--gamma-ns" || a == "--cache-gamma-ns") {
      const std::string v = next();
      const auto colon = v.find(':');
      double e = 0, d = 0, da = 0;
      if (colon == std::string::npos || std::sscanf(v.c_str() + colon + 1, "%lf,%lf,%lf", &e, &d, &da) != 3)
        throw std::invalid_argument(a + " wants CODEC:ENCODE,DECODE,DECODE_ADD (ns per value), not " + v);
      (a == "--gamma-ns" ? o.gamma : o.cache_gamma)[v.substr(0, colon)] = {e * 1e-9, d * 1e-9, da * 1e-9};
    }
    else if (a == "--cache-bytes") o.cache_bytes = static_cast<std::size_t>(parse_size(next()));
    else if (a == "--cache-latency-us") o.cache_latency_s = number_of(a, next()) * 1e-6;
    else if (a == "--cache-gbit") o.cache_bandwidth_Bps = number_of(a, next()) * 1e9 / 8;
    else if (a == "--bulk-bytes") o.bulk_bytes = static_cast<std::size_t>(parse_size(next()));
    else if (a == "--bulk-exchange-efficiency") o.bulk_eta = number_of(a, next()), o.bulk_set = true;
    else if (a == "--params") o.params = parse_size(next());
    else if (a == "--compute-ms") o.compute_s = number_of(a, next()) * 1e-3;
    else if (a == "--overlap") o.overlap = number_of(a, next());
    else if (a == "--json") o.json = true;
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else throw std::invalid_argument("unknown option " + a + " (--help lists them)");
  }
  // Values no link or call has (--ranks 0 divided by zero, --bytes -1M looped for good).
  for (int r : o.ranks)
    if (r < 1) throw std::invalid_argument("--ranks: " + std::to_string(r) + " is not a group size (at least 1)");
  for (double b : o.bytes)
    if (!(b > 0)) throw std::invalid_argument("--bytes: " + std::to_string(b) + " is not a positive size");
  if (o.cl.nic.latency_s < 0) throw std::invalid_argument("--latency-us must be at least 0");
  if (o.cl.nic.overhead_s < 0) throw std::invalid_argument("--overhead-us must be at least 0");
  if (o.cl.switch_bandwidth_Bps < 0) throw std::invalid_argument("--switch-gbit must be positive (or absent)");
  if (o.compute_s < 0) throw std::invalid_argument("--compute-ms must be at least 0");
  if (o.overlap < 0 || o.overlap > 1) throw std::invalid_argument("--overlap must be in [0, 1]");
  if (!o.cache_bytes && (o.cache_latency_s >= 0 || o.cache_bandwidth_Bps > 0 || !o.cache_gamma.empty()))
    throw std::invalid_argument("--cache-latency-us, --cache-gbit and --cache-gamma-ns describe the tier --cache-bytes sets; give it");
  if (o.bulk_bytes && !(o.bulk_eta > 0 && o.bulk_eta <= 1))
    throw std::invalid_argument("--bulk-bytes wants --bulk-exchange-efficiency E, 0 < E <= 1");
  if (!o.bulk_bytes && o.bulk_set)
    throw std::invalid_argument("--bulk-exchange-efficiency describes the tier --bulk-bytes B (B > 0) sets; give it");
  return o;
}

struct prediction {
  double sim_s = -1;  // -1: no schedule to simulate
  double closed_s = 0;
  std::uint64_t messages = 0;
};

prediction predict(const std::string& topo, const sim::codec_model& c, int size, std::size_t n, const sim::cluster& cl) {
  prediction p;
  n -= n % static_cast<std::size_t>(size);
  if (topo == "ring") {
    p.closed_s = sim::ring_terms(size, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead).time(cl.nic, c.rates);
    sim::simulator s(cl, c);
    auto r = s.all_reduce(topology::ring{}, size, n);
    p.sim_s = r.time_s, p.messages = r.messages;
  } else if (topo == "torus2d") {
    auto [rows, cols] = topology::torus2d{}.shape(size);
    p.closed_s = sim::torus2d_terms(rows, cols, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead).time(cl.nic, c.rates);
    sim::simulator s(cl, c);
    auto r = s.all_reduce(topology::torus2d{rows, cols}, size, n);
    p.sim_s = r.time_s, p.messages = r.messages;
  } else if (topo == "halving_doubling" || topo == "recursive_doubling") {
    // closed forms for powers of two only (the fold has none): else the simulation alone
    const bool pow2 = (size & (size - 1)) == 0;
    const bool hd = topo == "halving_doubling";
    if (pow2)
      p.closed_s = (hd ? sim::halving_doubling_terms(size, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead)
                       : sim::recursive_doubling_terms(size, n, c, cl.segment_bytes, cl.handshake, cl.send_ahead))
                       .time(cl.nic, c.rates);
    sim::simulator s(cl, c);
    auto r = hd ? s.all_reduce(topology::halving_doubling{}, size, n) : s.all_reduce(topology::recursive_doubling{}, size, n);
    p.sim_s = r.time_s, p.messages = r.messages;
    if (!pow2) p.closed_s = r.time_s;
  } else if (topo == "direct") {
    sim::simulator s(cl, c);
    auto r = s.all_reduce(topology::direct{}, size, n);
    p.sim_s = p.closed_s = r.time_s, p.messages = r.messages;
  } else {
    throw std::invalid_argument("unknown topology '" + topo + "' (ring, torus2d, halving_doubling, recursive_doubling, direct)");
  }
  return p;
}

std::map<std::string, sim::codec_model> codec_models(const options& o, const std::vector<std::string>& names) {
  std::map<std::string, sim::codec_model> m;
  for (const auto& n : names)
    if (!m.count(n)) m.emplace(n, bench::codec_by_name(n, 0, o.measure_gamma));
  return m;
}

void print_gamma(const options& o, const std::map<std::string, sim::codec_model>& models) {
  for (const auto& [name, c] : models) {
    if (o.json)
      std::printf("{\"kind\":\"gamma\",\"codec\":\"%s\",\"encode_ns\":%.4f,\"decode_ns\":%.4f,\"decode_add_ns\":%.4f}\n",
                  name.c_str(), c.rates.encode_s * 1e9, c.rates.decode_s * 1e9, c.rates.decode_add_s * 1e9);
    else
      std::printf("# gamma %-11s encode %.3f ns/value, decode %.3f, decode-add %.3f\n", name.c_str(),
                  c.rates.encode_s * 1e9, c.rates.decode_s * 1e9, c.rates.decode_add_s * 1e9);
  }
}

// The lockstep all-reduces of a bench JSON file, with their codec models (added to `models`,
// gamma measured when asked), each run's token bucket (the "burst" netlab recorded, else --burst)
// and its segment size (the "segment_bytes" the bench recorded, else --segment-bytes).
std::vector<bench::measured_run> read_runs(const options& o, const std::string& file,
                                         std::map<std::string, sim::codec_model>& models) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("cannot open " + file);
  std::vector<bench::json_object> lines;
  for (std::string line; std::getline(in, line);)
    if (auto obj = bench::parse_json_line(line)) lines.push_back(*obj);
  std::vector<std::string> names;
  for (auto& l : lines)
    if (l.count("codec") && !models.count(l["codec"])) names.push_back(l["codec"]);
  models.merge(codec_models(o, names));
  std::vector<bench::measured_run> runs;
  for (auto& l : lines)
    if (auto r = bench::run_of(l, models, l.count("burst") ? parse_size(l["burst"]) : o.cl.nic.burst_bytes))
      runs.push_back(*r);
  return runs;
}

int run_fit(options& o) {
  std::map<std::string, sim::codec_model> models;
  std::vector<bench::measured_run> runs = read_runs(o, o.fit_file, models);
  // the closed-form fit, with the model the predictions below use (same handshake, send-ahead)
  std::vector<sim::sample> samples;
  for (const auto& r : runs)
    samples.push_back(sim::sample_of(bench::terms_of(r, r.codec, bench::cluster_of(r, o.cl).segment_bytes, o.cl.handshake, o.cl.send_ahead),
                                     r.codec.rates, r.seconds));
  sim::fit_result f = sim::fit_alpha_beta(samples);
  double max_burst = 0;
  for (const auto& r : runs) max_burst = std::max(max_burst, r.burst_bytes);
  if (max_burst > 0 || o.cl.segments_ahead != 0) {
    // no closed form for a bucket or a send window: refine the linear fit on the simulator's own
    // predictions
    sim::link_params start = f.link;
    start.burst_rate_Bps = o.cl.nic.burst_rate_Bps;  // --burst-gbit: measured, not fitted
    f = bench::fit_by_simulation(runs, o.cl, start, o.cl.nic.burst_rate_Bps == 0);
  }
  const double default_burst = o.cl.nic.burst_bytes;
  o.cl.nic = f.link;
  o.cl.nic.burst_bytes = default_burst;
  print_gamma(o, models);
  if (o.json)
    std::printf("{\"kind\":\"fit\",\"alpha_us\":%.3f,\"bandwidth_Gbit\":%.4f,\"exchange_efficiency\":%.4f,"
                "\"max_burst_bytes\":%.0f,\"burst_rate_Gbit\":%.4f,\"samples\":%zu,\"exchange_samples\":%zu,\"alpha_pinned\":%s,\"eta_tied\":%s,\"rms_rel_err\":%.4f}\n",
                f.link.latency_s * 1e6, f.link.bandwidth_Bps * 8 / 1e9, f.link.exchange_efficiency, max_burst,
                f.link.burst_rate_Bps * 8 / 1e9, f.samples,
                f.exchange_samples, f.alpha_pinned ? "true" : "false", f.eta_tied ? "true" : "false",
                f.rms_relative_error);
  else
    std::printf("# fit over %zu measurements (%zu with pairwise exchanges): alpha %.1f us%s, bandwidth %.4f Gbit/s, "
                "exchange efficiency %.3f%s, %s, rms relative error %.1f%%\n",
                f.samples, f.exchange_samples, f.link.latency_s * 1e6, f.alpha_pinned ? " (pinned)" : "",
                f.link.bandwidth_Bps * 8 / 1e9, f.link.exchange_efficiency,
                f.eta_tied ? " (not determined or out of range: 1)" : "",
                max_burst > 0 ? ("token buckets (up to " + std::to_string(static_cast<long long>(max_burst)) +
                                 " bytes) drained at " + std::to_string(f.link.burst_rate_Bps * 8 / 1e9) +
                                 " Gbit/s, fitted through the simulator").c_str()
                              : "no token bucket (closed-form fit)",
                100 * f.rms_relative_error);
  if (!o.compare) return 0;
  if (!o.against_file.empty()) runs = read_runs(o, o.against_file, models);  // out of sample
  if (!o.json)
    std::printf("%-9s %-11s %5s %10s %12s %12s %12s %8s\n", "topology", "codec", "ranks", "bytes", "measured_us",
                "sim_us", "closed_us", "err");
  double worst = 0;
  int within = 0, total = 0;
  for (const auto& r : runs) {
    const auto p = predict(r.topology, r.codec, r.ranks, r.n, bench::cluster_of(r, o.cl));
    const double bytes = static_cast<double>(r.n * sizeof(float)), err = (p.sim_s - r.seconds) / r.seconds;
    if (bytes >= o.min_compare_bytes) {
      ++total;
      within += std::abs(err) <= 0.15;
      worst = std::max(worst, std::abs(err));
    }
    if (o.json)
      std::printf("{\"kind\":\"compare\",\"topology\":\"%s\",\"codec\":\"%s\",\"ranks\":%d,\"bytes\":%.0f,"
                  "\"measured_us\":%.1f,\"sim_us\":%.1f,\"closed_us\":%.1f,\"rel_err\":%.4f}\n",
                  r.topology.c_str(), r.codec.name.c_str(), r.ranks, bytes, r.seconds * 1e6, p.sim_s * 1e6,
                  p.closed_s * 1e6, err);
    else
      std::printf("%-9s %-11s %5d %10.0f %12.1f %12.1f %12.1f %+7.1f%%\n", r.topology.c_str(), r.codec.name.c_str(),
                  r.ranks, bytes, r.seconds * 1e6, p.sim_s * 1e6, p.closed_s * 1e6, 100 * err);
  }
  if (o.json)
    std::printf("{\"kind\":\"compare_summary\",\"min_bytes\":%.0f,\"within_15pct\":%d,\"total\":%d,\"worst_rel_err\":%.4f}\n",
                o.min_compare_bytes, within, total, worst);
  else
    std::printf("# sizes >= %.0f bytes: %d of %d within 15%%, worst %.1f%%\n", o.min_compare_bytes, within, total, 100 * worst);
  return 0;
}

int run_speedup(const options& o) {
  auto models = codec_models(o, o.codecs);
  if (o.measure_gamma) print_gamma(o, models);
  const std::size_t n = static_cast<std::size_t>(o.params);
  if (!o.json)
    std::printf("%-9s %-11s %6s %12s %12s %9s\n", "topology", "codec", "ranks", "comm_ms", "compute_ms", "speedup");
  for (const auto& topo : o.topologies)
    for (const auto& cn : o.codecs)
      for (int size : o.ranks) {
        const auto p = predict(topo, models.at(cn), size, n, o.cl);
        const double comm = p.sim_s >= 0 ? p.sim_s : p.closed_s;
        const double sp = sim::data_parallel_speedup(size, o.compute_s, comm, o.overlap);
        if (o.json)
          std::printf("{\"kind\":\"speedup\",\"topology\":\"%s\",\"codec\":\"%s\",\"ranks\":%d,\"params\":%.0f,"
                      "\"comm_us\":%.1f,\"compute_us\":%.1f,\"overlap\":%.2f,\"speedup\":%.3f}\n",
                      topo.c_str(), cn.c_str(), size, o.params, comm * 1e6, o.compute_s * 1e6, o.overlap, sp);
        else
          std::printf("%-9s %-11s %6d %12.2f %12.2f %9.2f\n", topo.c_str(), cn.c_str(), size, comm * 1e3,
                      o.compute_s * 1e3, sp);
      }
  return 0;
}

// topology::automatic's comparison, as a call would make it.
int run_explain(const options& o) {
  // automatic compares one rank per host, a non-blocking switch and the executor's own window and
  // handshake: options that change those would describe another comparison than a call makes.
  const sim::cluster plain;
  if (o.cl.ranks_per_host != plain.ranks_per_host || o.cl.switch_bandwidth_Bps != plain.switch_bandwidth_Bps ||
      o.cl.handshake != plain.handshake || o.cl.send_ahead != plain.send_ahead || o.cl.segments_ahead != options{}.cl.segments_ahead)
    throw std::invalid_argument(
        "--explain compares what topology::automatic compares (one rank per host, a non-blocking switch, the "
        "executor's send window and headers): --ranks-per-host, --switch-gbit, --no-handshake, --send-ahead and "
        "--ahead are for predictions, not --explain");
  // A codec under error feedback is chosen for as its inner codec (automatic.hpp): ranks with and
  // without it must agree.
  std::vector<std::string> inner_names;
  for (const auto& cn : o.codecs) {
    const std::string inner = cn.size() > 3 && cn.ends_with("+ef") ? cn.substr(0, cn.size() - 3) : cn;
    if (std::find(inner_names.begin(), inner_names.end(), inner) == inner_names.end()) inner_names.push_back(inner);
  }
  auto models = codec_models(o, inner_names);
  for (auto& [name, c] : models)
    if (o.gamma.count(name)) c.rates = o.gamma.at(name);
  if (o.measure_gamma) print_gamma(o, models);
  topology::automatic a;
  a.link = o.cl.nic;
  if (o.segment_choices) a.segment_choices = *o.segment_choices;
  a.direct_sizes = o.direct_sizes;
  a.cache_bytes = o.cache_bytes;
  a.cache_link = o.cl.nic;
  a.cache_link.overhead_s = 0;
  if (o.cache_latency_s >= 0) a.cache_link.latency_s = o.cache_latency_s;
  if (o.cache_bandwidth_Bps > 0) a.cache_link.bandwidth_Bps = o.cache_bandwidth_Bps;
  a.cache_rates = o.cache_gamma;
  a.bulk_bytes = o.bulk_bytes;
  if (o.bulk_bytes) a.bulk_exchange_efficiency = o.bulk_eta;
  if (!o.json) {
    std::printf("# topology::automatic on alpha %.2f us, %.3f Gbit/s, eta %.2f, overhead %.2f us; group segment %zu bytes\n",
                o.cl.nic.latency_s * 1e6, o.cl.nic.bandwidth_Bps * 8 / 1e9, o.cl.nic.exchange_efficiency,
                o.cl.nic.overhead_s * 1e6, o.cl.segment_bytes);
    if (a.cache_bytes)
      std::printf("# up to %zu bytes per rank: alpha %.2f us, %.3f Gbit/s (the cache tier)\n", a.cache_bytes,
                  a.cache_link.latency_s * 1e6, a.cache_link.bandwidth_Bps * 8 / 1e9);
    if (a.bulk_bytes)
      std::printf("# from %zu bytes per rank: eta %.2f (the bulk tier)\n", a.bulk_bytes, a.bulk_exchange_efficiency);
  }
  // LOCKSTEP_TOPOLOGY forces what every call runs (at the group's segment): marked as the choice.
  const auto forced = topology::automatic::forced_by_environment();
  if (forced && !o.json)
    std::printf("# LOCKSTEP_TOPOLOGY=%s: every call runs it at the group's segment, whatever the predictions\n",
                topology::choice::name_of(*forced));
  for (const auto& cn : inner_names)
    for (int size : o.ranks)
      for (double bytes : o.bytes) {
        const std::size_t n = static_cast<std::size_t>(bytes) / sizeof(float);
        const auto all = a.explain(topology::operation::all_reduce, size, n, models.at(cn), o.cl.segment_bytes);
        std::size_t best = topology::automatic::pick(all, a.segment_margin);
        if (forced)
          for (std::size_t i = 0; i < all.size(); ++i)
            if (all[i].kind == *forced && all[i].segment_bytes == 0) best = i;
        if (!o.json) std::printf("%-9s %5d ranks %12.0f bytes:\n", cn.c_str(), size, bytes);
        for (std::size_t i = 0; i < all.size(); ++i) {
          const auto& c = all[i];
          const std::size_t seg = c.segment_bytes ? c.segment_bytes : o.cl.segment_bytes;
          if (o.json)
            std::printf("{\"kind\":\"explain\",\"codec\":\"%s\",\"ranks\":%d,\"bytes\":%.0f,\"topology\":\"%s\","
                        "\"segment_bytes\":%zu,\"predicted_us\":%.3f,\"chosen\":%s}\n",
                        cn.c_str(), size, bytes, c.name(), seg, c.predicted_s * 1e6, i == best ? "true" : "false");
          else
            std::printf("  %s %-18s segment %9zu  %12.1f us\n", i == best ? "*" : " ", c.name(), seg, c.predicted_s * 1e6);
        }
      }
  return 0;
}

int run_predict(const options& o) {
  auto models = codec_models(o, o.codecs);
  if (o.measure_gamma) print_gamma(o, models);
  if (!o.json)
    std::printf("%-18s %-11s %6s %12s %12s %12s %10s %10s\n", "topology", "codec", "ranks", "bytes", "sim_us",
                "closed_us", "busbw_GB/s", "sim_wall_s");
  for (double bytes : o.bytes)
    for (const auto& topo : o.topologies)
      for (const auto& cn : o.codecs)
        for (int size : o.ranks) {
          const auto t0 = std::chrono::steady_clock::now();
          const auto p = predict(topo, models.at(cn), size, static_cast<std::size_t>(bytes) / 4, o.cl);
          const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          const double t = p.sim_s >= 0 ? p.sim_s : p.closed_s;
          const double busbw = sim::allreduce_busbw(bytes, t, size);
          if (o.json)
            std::printf("{\"kind\":\"predict\",\"topology\":\"%s\",\"codec\":\"%s\",\"ranks\":%d,\"bytes\":%.0f,"
                        "\"time_us\":%.3f,\"closed_us\":%.3f,\"simulated\":%s,\"busbw_GBps\":%.6f,\"messages\":%llu,"
                        "\"alpha_us\":%.3f,\"bandwidth_Gbit\":%.4f,\"exchange_efficiency\":%.4f,\"ranks_per_host\":%d,"
                        "\"sim_wall_s\":%.3f}\n",
                        topo.c_str(), cn.c_str(), size, bytes, t * 1e6, p.closed_s * 1e6, p.sim_s >= 0 ? "true" : "false",
                        busbw / 1e9, static_cast<unsigned long long>(p.messages), o.cl.nic.latency_s * 1e6,
                        o.cl.nic.bandwidth_Bps * 8 / 1e9, o.cl.nic.exchange_efficiency, o.cl.ranks_per_host, wall);
          else
            std::printf("%-18s %-11s %6d %12.0f %12s %12.1f %10.4f %10.3f\n", topo.c_str(), cn.c_str(), size, bytes,
                        p.sim_s >= 0 ? std::to_string(p.sim_s * 1e6).c_str() : "-", p.closed_s * 1e6, busbw / 1e9, wall);
        }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    options o = parse(argc, argv);
    if (!o.fit_file.empty()) {
      run_fit(o);
      if (o.compare) return 0;
    }
    if (o.explain) return run_explain(o);
    return o.speedup ? run_speedup(o) : run_predict(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-sim: %s\n", e.what());
    return 2;
  }
}
