// lockstep/sim/fit.hpp: link parameters (alpha, beta, eta) fitted to measured all-reduce times.
//
// A measurement is one JSON object per line (the benches' --json output) with at least
//   "bytes"    fp32 payload of the all-reduce
//   "time_us"  its time
// and, to say what ran, "ranks" (or "size"), "topology" (ring, torus2d) and "codec" (fp32, bf16,
// int8, dyntree8). Each line becomes one equation of the closed-form cost model,
//   time - codec work = messages * alpha + oneway_bytes * beta + exchange_bytes * beta_x,
// beta_x = beta / eta (link_params::exchange_efficiency), and least squares solves for the three,
// still a linear problem. Rows are weighted by 1 / time so that 64 MiB runs do not drown 1 MiB
// ones: what the fit minimises is relative error, the figure we report.
// Guards: a negative alpha is pinned at 0; an eta outside (0, 1] (beta_x <= 0 or beta_x < beta),
// or data without both one-way and exchange bytes (eta not determined), ties beta_x = beta
// (eta = 1); after either the rest is refitted.
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
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../codec.hpp"
#include "cost_model.hpp"
#include "simulator.hpp"

namespace lockstep::sim {

// One equation: seconds = alpha_count * alpha + beta_count * beta + exchange_count * beta / eta + fixed_s.
struct sample {
  double alpha_count = 0;
  double beta_count = 0;      // one-way wire bytes
  double fixed_s = 0;         // known part (codec work at the measured gamma)
  double seconds = 0;
  double exchange_count = 0;  // wire bytes of pairwise exchanges
};

// The equation of a measurement whose closed-form terms are t and codec rates g.
inline sample sample_of(const cost_terms& t, const codec_rates& g, double seconds) {
  return {t.messages, t.oneway_bytes, t.compute_time(g), seconds, t.exchange_bytes};
}

struct fit_result {
  link_params link;
  double rms_relative_error = 0;
  std::size_t samples = 0;
  std::size_t exchange_samples = 0;  // rows with exchange bytes
  bool alpha_pinned = false;         // alpha came out negative: fitted with alpha = 0
  bool eta_tied = false;             // eta not determined or outside (0, 1]: fitted with eta = 1
};

namespace detail {
// Weighted least squares over the columns picked by `use` (alpha, beta, beta_x); with `tie` the
// exchange bytes join the beta column. Returns false where the normal equations are singular.
inline bool solve_link(const std::vector<sample>& xs, bool pin_alpha, bool tie, std::array<double, 3>& p) {
  std::vector<int> cols;
  if (!pin_alpha) cols.push_back(0);
  cols.push_back(1);
  if (!tie) cols.push_back(2);
  const std::size_t k = cols.size();
  double m[3][4] = {};
  for (const sample& s : xs) {
    if (!(s.seconds > 0)) continue;
    const double w = 1.0 / s.seconds;
    const double all[3] = {s.alpha_count * w, (s.beta_count + (tie ? s.exchange_count : 0.0)) * w, s.exchange_count * w};
    const double y = (s.seconds - s.fixed_s) * w;
    for (std::size_t i = 0; i < k; ++i) {
      for (std::size_t j = 0; j < k; ++j) m[i][j] += all[cols[i]] * all[cols[j]];
      m[i][k] += all[cols[i]] * y;
    }
  }
  // Scale columns so alpha (~1e-4 s) and beta (~1e-8 s/B) are comparable, then Gauss-Jordan.
  double scale[3] = {0, 0, 0};
  for (std::size_t i = 0; i < k; ++i) scale[i] = m[i][i] > 0 ? 1.0 / std::sqrt(m[i][i]) : 0.0;
  for (std::size_t i = 0; i < k; ++i) {
    if (scale[i] == 0) return false;
    for (std::size_t j = 0; j < k; ++j) m[i][j] *= scale[i] * scale[j];
    m[i][k] *= scale[i];
  }
  for (std::size_t c = 0; c < k; ++c) {
    std::size_t piv = c;
    for (std::size_t r = c + 1; r < k; ++r)
      if (std::abs(m[r][c]) > std::abs(m[piv][c])) piv = r;
    if (std::abs(m[piv][c]) < 1e-12) return false;
    for (std::size_t j = 0; j <= k; ++j) std::swap(m[c][j], m[piv][j]);
    for (std::size_t r = 0; r < k; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (std::size_t j = c; j <= k; ++j) m[r][j] -= f * m[c][j];
    }
  }
  p = {0, 0, 0};
  for (std::size_t i = 0; i < k; ++i) p[static_cast<std::size_t>(cols[i])] = m[i][k] / m[i][i] * scale[i];
  if (tie) p[2] = p[1];
  return true;
}
}  // namespace detail

inline fit_result fit_alpha_beta(const std::vector<sample>& xs) {
  std::size_t used = 0, exch = 0, oneway = 0;
  for (const sample& s : xs) {
    if (!(s.seconds > 0)) continue;
    ++used;
    exch += s.exchange_count > 0;
    oneway += s.beta_count > 0;
  }
  if (used < 2) throw std::invalid_argument("fit: need at least two measurements, got " + std::to_string(used));
  // eta needs rows of both kinds (one-way bytes alone say nothing of it; exchange bytes alone
  // cannot tell beta from beta / eta), and three equations for three unknowns.
  bool tie = exch == 0 || oneway == 0 || used < 3, pin = false;
  std::array<double, 3> p{};
  for (int round = 0; round < 4; ++round) {
    if (!detail::solve_link(xs, pin, tie, p)) {
      if (!tie) {
        tie = true;
        continue;
      }
      if (!pin) {
        pin = true;
        continue;
      }
      throw std::invalid_argument("fit: the measurements do not determine the link parameters");
    }
    // eta = beta / beta_x must lie in (0, 1]: otherwise tie it at 1 and refit.
    if (!tie && !(p[1] > 0 && p[2] >= p[1])) {
      tie = true;
      continue;
    }
    // A negative latency is noise on a bandwidth-bound set: pin it at 0 and refit the rest.
    if (!pin && !(p[0] >= 0 && p[1] > 0)) {
      pin = true;
      continue;
    }
    break;
  }
  const double alpha = p[0], beta = p[1], beta_x = p[2];
  if (!(beta > 0) || !(beta_x >= beta)) throw std::invalid_argument("fit: the measurements do not determine a positive beta");
  fit_result f;
  f.link.latency_s = alpha;
  f.link.bandwidth_Bps = 1.0 / beta;
  f.link.exchange_efficiency = tie ? 1.0 : beta / beta_x;
  f.samples = used;
  f.exchange_samples = exch;
  f.alpha_pinned = pin;
  f.eta_tied = tie;
  double se = 0;
  for (const sample& s : xs) {
    if (!(s.seconds > 0)) continue;
    const double pred = s.alpha_count * alpha + s.beta_count * beta + s.exchange_count * beta_x + s.fixed_s;
    se += (pred - s.seconds) * (pred - s.seconds) / (s.seconds * s.seconds);
  }
  f.rms_relative_error = std::sqrt(se / static_cast<double>(used));
  return f;
}

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

// The codecs lockstep ships, by the names the benches print. Block 0: the codec's default.
inline codec_model codec_by_name(const std::string& name, std::size_t block = 0, bool measure = false) {
  auto make = [&](const auto& c) { return model_of(c, measure ? measure_rates(c) : codec_rates{}); };
  if (name == "fp32") return make(codec::fp32{});
  if (name == "bf16") return make(codec::bf16{});
  if (name == "int8") return block ? make(codec::int8{block}) : make(codec::int8{});
  if (name == "dyntree8") return block ? make(codec::dyntree8{block}) : make(codec::dyntree8{});
  throw std::invalid_argument("unknown codec '" + name + "' (fp32, bf16, int8, dyntree8)");
}

// Most square R x C with R <= C, as topology::torus2d{} picks it.
inline std::pair<int, int> square_shape(int size) {
  int r = 1;
  for (int d = 1; d * d <= size; ++d)
    if (size % d == 0) r = d;
  return {r, size / r};
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
  if (r.topology == "ring") return ring_terms(r.ranks, n, c, segment_bytes, handshake, send_ahead);
  auto [rows, cols] = square_shape(r.ranks);
  return torus2d_terms(rows, cols, n, c, segment_bytes, handshake, send_ahead);
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
  if (m.topology != "torus2d") throw std::invalid_argument("simulate: no schedule for topology '" + m.topology + "'");
  auto [r, c] = square_shape(m.ranks);
  return s.all_reduce(topology::torus2d{r, c}, m.ranks, n).time_s;
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
      throw std::invalid_argument("segment_bytes \"" + v + "\" is not a positive number of bytes");
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
  if (runs.size() < 2) throw std::invalid_argument("fit: need at least two measurements, got " + std::to_string(runs.size()));
  std::size_t exchanges = 0;
  for (const measured_run& m : runs) {
    if (!(m.seconds > 0) || m.ranks < 1)
      throw std::invalid_argument("fit: a " + m.topology + " " + m.codec.name + " measurement with " +
                                  std::to_string(m.ranks) + " ranks and " + std::to_string(m.seconds) + " s");
    const auto [rows, cols] = square_shape(m.ranks);
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
  auto error = [&](const point& x) {
    cl.nic = link_of(x);
    double se = 0;
    try {
      for (const measured_run& m : runs) {
        const double e = (simulate(m, cl) - m.seconds) / m.seconds;
        se += e * e;
      }
    } catch (const std::invalid_argument&) {
      return HUGE_VAL;  // a point the simulator refuses is no fit
    }
    return std::sqrt(se / static_cast<double>(runs.size()));
  };
  if (!(start.bandwidth_Bps > 0)) throw std::invalid_argument("fit: the start needs a bandwidth > 0");
  const double eta0 = std::clamp(start.exchange_efficiency, 0.06, 0.99);
  const point step{3.0, 0.1, 0.5, 1.0};
  point best{};
  double fbest = HUGE_VAL;
  for (double alpha_us : {100.0, 500.0, 2000.0})
    for (double ratio : {1.5, 4.0, 16.0}) {
      if (!fit_burst_rate && ratio != 4.0) continue;  // the rate is given: one start per alpha
      point x{std::sqrt(alpha_us), std::log(start.bandwidth_Bps * 8 / 1e9), -std::log(0.95 / (eta0 - 0.05) - 1),
              std::log(ratio - 1)};
      double fx = error(x);
      for (int restart = 0; restart < 8; ++restart) {
        const auto [y, fy] = detail::nelder_mead(x, step, error);
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

}  // namespace lockstep::sim
