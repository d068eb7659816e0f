// bench/sim_fit.hpp: lockstep-sim's tooling around the library's fit (lockstep/sim/fit.hpp):
// reading the benches' --json lines, the codecs by the names the benches print, and the fit of
// links with token buckets through the simulator (Nelder-Mead), which has no closed form.
//
// A measurement is one JSON object per line with at least
//   "bytes"    fp32 payload of the all-reduce
//   "time_us"  its time
// and, to say what ran, "ranks" (or "size"), "topology" (ring, torus2d) and "codec" (fp32, bf16,
// int8, dyntree8); optionally "segment_bytes" (the executor's segment in that run).
//
// Links with a token bucket (link_params::burst_bytes > 0) have no closed form: there
// fit_by_simulation starts from the linear fit and minimises the same relative error of the
// simulator's own predictions over (alpha, beta, eta) and the rate at which credited bytes leave,
// with the bucket depth given per measurement (the links' configuration, tc's burst, not a number
// to fit); measurements at several depths pin that rate down.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <lockstep/codec.hpp>
#include <lockstep/core/error.hpp>
#include <lockstep/sim/cost_model.hpp>
#include <lockstep/sim/fit.hpp>
#include <lockstep/sim/simulator.hpp>
#include <lockstep/topology.hpp>

namespace lockstep::bench {

using sim::cluster;
using sim::codec_model;
using sim::codec_rates;
using sim::cost_terms;
using sim::fit_result;
using sim::link_params;
using sim::simulator;

// A flat JSON object: string, number, true/false/null values; nesting is not needed by the benches.
using json_object = std::map<std::string, std::string>;

inline std::optional<json_object> parse_json_line(const std::string& line) {
  json_object out;
  std::size_t i = 0;
  auto ws = [&] {
    while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
  };
  auto str = [&](std::string& s) {
    if (i >= line.size() || line[i] != '"') return false;
    for (++i; i < line.size() && line[i] != '"'; ++i) {
      if (line[i] == '\\' && i + 1 < line.size()) ++i;
      s += line[i];
    }
    if (i >= line.size()) return false;
    ++i;
    return true;
  };
  ws();
  if (i >= line.size() || line[i] != '{') return std::nullopt;
  ++i;
  for (;;) {
    ws();
    if (i < line.size() && line[i] == '}') return out;
    std::string key, value;
    if (!str(key)) return std::nullopt;
    ws();
    if (i >= line.size() || line[i] != ':') return std::nullopt;
    ++i;
    ws();
    if (i < line.size() && line[i] == '"') {
      if (!str(value)) return std::nullopt;
    } else {
      while (i < line.size() && line[i] != ',' && line[i] != '}' && !std::isspace(static_cast<unsigned char>(line[i])))
        value += line[i++];
      if (value.empty()) return std::nullopt;
    }
    out[key] = value;
    ws();
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    if (i < line.size() && line[i] == '}') return out;
    return std::nullopt;
  }
}

// The codecs lockstep ships, by the names they print (c.name(), which the benches record), each
// also under error feedback ("dyntree8+ef", error_feedback<C>::name()). Block 0: the default.
inline codec_model codec_by_name(const std::string& name, std::size_t block = 0, bool measure = false) {
  constexpr std::string_view ef = "+ef";
  const bool feedback = name.size() > ef.size() && std::string_view(name).ends_with(ef);
  const std::string base = feedback ? name.substr(0, name.size() - ef.size()) : name;
  auto make = [&](const auto& inner) {
    auto model = [&](const auto& c) { return sim::model_of(c, measure ? sim::measure_rates(c) : codec_rates{}); };
    return feedback ? model(codec::error_feedback<std::decay_t<decltype(inner)>>(inner)) : model(inner);
  };
  if (base == "fp32") return make(codec::fp32{});
  if (base == "bf16") return make(codec::bf16{});
  if (base == "int8") return block ? make(codec::int8{block}) : make(codec::int8{});
  if (base == "dyntree8") return block ? make(codec::dyntree8{block}) : make(codec::dyntree8{});
  throw error(errc::invalid_argument, "bench::codec_by_name", -1, -1,
              "unknown codec '" + name + "' (fp32, bf16, int8, dyntree8, each also as NAME+ef)");
}

// What a bench JSON line says ran: a ring or most-square torus all-reduce of n fp32 values over
// `ranks`; nullopt for lines the models do not cover (an MPI_Allreduce baseline, say, whose
// algorithm we do not know) or that lack a field.
struct line_shape {
  std::string topology;  // ring or torus2d (the most square shape, as the benches run it)
  int ranks = 1;
  std::size_t n = 0;     // fp32 values
  // n rounded down to equal chunks, as the models take it (off by < ranks values)
  std::size_t equal_n() const noexcept { return n - n % static_cast<std::size_t>(ranks); }
};

inline std::optional<line_shape> shape_of(const json_object& o) {
  auto get = [&](const char* k) -> const std::string* {
    auto it = o.find(k);
    return it == o.end() ? nullptr : &it->second;
  };
  const std::string *topo = get("topology"), *bytes = get("bytes"), *ranks = get("ranks");
  if (!ranks) ranks = get("size");
  if (!topo || !bytes || !ranks || (*topo != "ring" && *topo != "torus2d")) return std::nullopt;
  try {
    const int size = std::stoi(*ranks);
    if (size < 1) return std::nullopt;
    return line_shape{*topo, size, static_cast<std::size_t>(std::stod(*bytes)) / sizeof(float)};
  } catch (...) {
    return std::nullopt;
  }
}

// The closed-form terms of an all-reduce of that shape.
inline cost_terms terms_of(const line_shape& r, const codec_model& c, std::size_t segment_bytes, bool handshake = true,
                           bool send_ahead = false) {
  const std::size_t n = r.equal_n();
  if (r.topology == "ring") return sim::ring_terms(r.ranks, n, c, segment_bytes, handshake, send_ahead);
  const auto [rows, cols] = topology::torus2d{}.shape(r.ranks);
  return sim::torus2d_terms(rows, cols, n, c, segment_bytes, handshake, send_ahead);
}

// The closed-form terms of one measurement; nullopt where shape_of has none.
inline std::optional<cost_terms> terms_of(const json_object& o, const codec_model& c, std::size_t segment_bytes,
                                          bool handshake = true, bool send_ahead = false) {
  if (auto r = shape_of(o)) return terms_of(*r, c, segment_bytes, handshake, send_ahead);
  return std::nullopt;
}

// One measured all-reduce, as the simulator replays it.
struct measured_run : line_shape {
  codec_model codec;
  double seconds = 0;
  double burst_bytes = -1;       // the links' token bucket in this run; < 0: the cluster's
  std::size_t segment_bytes = 0;  // the executor's segment in this run; 0: the cluster's

  measured_run() = default;
  measured_run(line_shape shape, codec_model c, double s, double burst = -1, std::size_t segment = 0)
      : line_shape(std::move(shape)), codec(std::move(c)), seconds(s), burst_bytes(burst), segment_bytes(segment) {}
};

// cl as the run had it: its own token bucket and segment size, where it recorded them.
inline cluster cluster_of(const measured_run& m, cluster cl) {
  if (m.burst_bytes >= 0) cl.nic.burst_bytes = m.burst_bytes;
  if (m.segment_bytes > 0) cl.segment_bytes = m.segment_bytes;
  return cl;
}

// The simulator's time for an all-reduce of that shape on cluster cl (with the run's own bucket
// and segment size).
inline double simulate(const measured_run& m, const cluster& cl) {
  simulator s(cluster_of(m, cl), m.codec);
  const std::size_t n = m.equal_n();
  if (m.topology == "ring") return s.all_reduce(topology::ring{}, m.ranks, n).time_s;
  if (m.topology == "torus2d") return s.all_reduce(topology::torus2d{}, m.ranks, n).time_s;
  if (m.topology == "halving_doubling") return s.all_reduce(topology::halving_doubling{}, m.ranks, n).time_s;
  if (m.topology == "recursive_doubling") return s.all_reduce(topology::recursive_doubling{}, m.ranks, n).time_s;
  if (m.topology == "direct") return s.all_reduce(topology::direct{}, m.ranks, n).time_s;
  throw error(errc::invalid_argument, "bench::simulate", -1, -1,
              "no schedule for topology '" + m.topology + "' (ring, torus2d, halving_doubling, recursive_doubling, direct)");
}

// The measurement a JSON line describes, with its codec model from `models` (by name), burst_bytes
// as given and the segment size the bench recorded ("segment_bytes"; lines without it: 0, the
// cluster's); nullopt where shape_of has none, or without a known codec or a time. A recorded
// segment size that is not a positive whole number of bytes is an error, not another segment.
inline std::optional<measured_run> run_of(const json_object& o, const std::map<std::string, codec_model>& models,
                                          double burst_bytes = -1) {
  auto shape = shape_of(o);
  auto codec = o.find("codec"), t = o.find("time_us"), seg = o.find("segment_bytes");
  if (!shape || codec == o.end() || t == o.end()) return std::nullopt;
  auto it = models.find(codec->second);
  if (it == models.end()) return std::nullopt;
  std::size_t segment = 0;
  if (seg != o.end()) {
    const std::string& v = seg->second;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), segment);
    if (ec != std::errc{} || end != v.data() + v.size() || segment == 0)
      throw error(errc::invalid_argument, "bench::run_of", -1, -1,
                  "segment_bytes \"" + v + "\" is not a positive number of bytes");
  }
  try {
    return measured_run{*shape, it->second, std::stod(t->second) * 1e-6, burst_bytes, segment};
  } catch (...) {
    return std::nullopt;
  }
}

namespace detail {
// Nelder-Mead from x0 with first steps `step`; the best point and fn there.
template <class F>
std::pair<std::array<double, 4>, double> nelder_mead(const std::array<double, 4>& x0, const std::array<double, 4>& step,
                                                     F&& fn) {
  constexpr std::size_t dims = 4;
  using point = std::array<double, dims>;
  std::array<point, dims + 1> simplex;
  simplex.fill(x0);
  for (std::size_t d = 0; d < dims; ++d) simplex[d + 1][d] += step[d];
  std::array<double, dims + 1> f{};
  for (std::size_t i = 0; i <= dims; ++i) f[i] = fn(simplex[i]);
  for (int it = 0; it < 600; ++it) {
    std::array<std::size_t, dims + 1> idx{};
    for (std::size_t i = 0; i <= dims; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return f[a] < f[b]; });
    const std::size_t best = idx[0], worst = idx[dims], second = idx[dims - 1];
    if (f[worst] - f[best] < 1e-7) break;
    point c{};
    for (std::size_t k = 0; k < dims; ++k)
      for (std::size_t d = 0; d < dims; ++d) c[d] += simplex[idx[k]][d] / dims;
    auto along = [&](double t) {
      point q;
      for (std::size_t d = 0; d < dims; ++d) q[d] = c[d] + t * (simplex[worst][d] - c[d]);
      return q;
    };
    const point r = along(-1.0);
    const double fr = fn(r);
    if (fr < f[best]) {
      const point e = along(-2.0);
      const double fe = fn(e);
      if (fe < fr) simplex[worst] = e, f[worst] = fe;
      else simplex[worst] = r, f[worst] = fr;
    } else if (fr < f[second]) {
      simplex[worst] = r, f[worst] = fr;
    } else {
      const point k = along(0.5);
      const double fk = fn(k);
      if (fk < f[worst]) {
        simplex[worst] = k, f[worst] = fk;
      } else {
        for (std::size_t j = 1; j <= dims; ++j) {
          const std::size_t i = idx[j];
          for (std::size_t d = 0; d < dims; ++d) simplex[i][d] = simplex[best][d] + 0.5 * (simplex[i][d] - simplex[best][d]);
          f[i] = fn(simplex[i]);
        }
      }
    }
  }
  const std::size_t best = static_cast<std::size_t>(std::min_element(f.begin(), f.end()) - f.begin());
  return {simplex[best], f[best]};
}
}  // namespace detail

// (alpha, beta, eta, burst rate) that minimise the rms relative error of simulate() over `runs`.
// The search runs in coordinates where every value is allowed (alpha = a^2 us, bandwidth = e^w
// Gbit/s, eta = 0.05 + 0.95 / (1 + e^-y), burst rate = bandwidth (1 + e^z)), so no clamp leaves a
// flat region to stall in; and since alpha and the burst rate trade against each other, Nelder-
// Mead starts from 9 points (alpha 0.1, 0.5, 2 ms x burst rate 1.5, 4, 16 x bandwidth, bandwidth
// and eta from `start`), restarts each from its best until that gains nothing, and keeps the best
// of all. eta is held at 1 (eta_tied) when no run has a pairwise exchange; with fit_burst_rate
// false the burst rate stays start.burst_rate_Bps (a measured figure, or 0: at once; raised just
// above the bandwidth where the fit puts the bandwidth at or above it). The buckets''
// depths (cl.nic.burst_bytes or each run's) and everything else of cl stay as given. Runs with a
// time <= 0 or fewer than one rank are refused.
inline fit_result fit_by_simulation(const std::vector<measured_run>& runs, cluster cl, const link_params& start,
                                    bool fit_burst_rate = true) {
  auto bad = [](const std::string& why) { return error(errc::invalid_argument, "bench::fit_by_simulation", -1, -1, why); };
  if (runs.size() < 2) throw bad("need at least two measurements, got " + std::to_string(runs.size()));
  std::size_t exchanges = 0;
  for (const measured_run& m : runs) {
    if (!(m.seconds > 0) || m.ranks < 1)
      throw bad("a " + m.topology + " " + m.codec.name + " measurement with " + std::to_string(m.ranks) +
                " ranks and " + std::to_string(m.seconds) + " s: it needs a rank and a time > 0");
    const auto [rows, cols] = topology::torus2d{}.shape(m.ranks);
    exchanges += m.ranks == 2 || (m.topology == "torus2d" && (rows == 2 || cols == 2));
  }
  const bool tie_eta = exchanges == 0;
  using point = std::array<double, 4>;
  auto link_of = [&](const point& x) {
    link_params l = cl.nic;
    l.latency_s = x[0] * x[0] * 1e-6;
    l.bandwidth_Bps = std::exp(x[1]) * 1e9 / 8;
    l.exchange_efficiency = tie_eta ? 1.0 : 0.05 + 0.95 / (1 + std::exp(-x[2]));
    // z kept within +-30: 1 + e^z stays above 1 (the simulator wants a burst rate above the
    // bandwidth) and finite (e^30 ~ 1e13: "at once" for any link)
    l.burst_rate_Bps = fit_burst_rate ? l.bandwidth_Bps * (1 + std::exp(std::clamp(x[3], -30.0, 30.0))) : start.burst_rate_Bps;
    if (!fit_burst_rate && l.burst_rate_Bps > 0 && l.burst_rate_Bps <= l.bandwidth_Bps)
      l.burst_rate_Bps = std::nextafter(l.bandwidth_Bps, HUGE_VAL);  // the simulator wants it above
    return l;
  };
  auto rms_error = [&](const point& x) {
    cl.nic = link_of(x);
    double se = 0;
    try {
      for (const measured_run& m : runs) {
        const double e = (simulate(m, cl) - m.seconds) / m.seconds;
        se += e * e;
      }
    } catch (const lockstep::error& e) {
      if (e.code() != errc::invalid_argument) throw;
      return HUGE_VAL;  // a point the simulator refuses (a burst rate below the bandwidth) is no fit
    }
    return std::sqrt(se / static_cast<double>(runs.size()));
  };
  if (!(start.bandwidth_Bps > 0)) throw bad("the start needs a bandwidth > 0, not " + std::to_string(start.bandwidth_Bps));
  const double eta0 = std::clamp(start.exchange_efficiency, 0.06, 0.99);
  const point step{3.0, 0.1, 0.5, 1.0};
  point best{};
  double fbest = HUGE_VAL;
  for (double alpha_us : {100.0, 500.0, 2000.0})
    for (double ratio : {1.5, 4.0, 16.0}) {
      if (!fit_burst_rate && ratio != 4.0) continue;  // the rate is given: one start per alpha
      point x{std::sqrt(alpha_us), std::log(start.bandwidth_Bps * 8 / 1e9), -std::log(0.95 / (eta0 - 0.05) - 1),
              std::log(ratio - 1)};
      double fx = rms_error(x);
      for (int restart = 0; restart < 8; ++restart) {
        const auto [y, fy] = detail::nelder_mead(x, step, rms_error);
        const bool gained = fy < fx - 1e-6;
        if (fy < fx) x = y, fx = fy;
        if (!gained) break;
      }
      if (fx < fbest) best = x, fbest = fx;
    }
  fit_result r;
  r.link = link_of(best);
  r.rms_relative_error = fbest;
  r.samples = runs.size();
  r.exchange_samples = exchanges;
  r.alpha_pinned = false;  // alpha = a^2 >= 0 by construction: nothing to pin
  r.eta_tied = tie_eta;
  return r;
}

}  // namespace lockstep::bench
