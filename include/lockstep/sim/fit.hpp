// lockstep/sim/fit.hpp: link parameters (alpha, beta, eta) fitted to measured all-reduce times.
//
// Each measurement becomes one equation of the closed-form cost model (sim/cost_model.hpp),
//   time - codec work = messages * alpha + oneway_bytes * beta + exchange_bytes * beta_x,
// beta_x = beta / eta (link_params::exchange_efficiency), and least squares solves for the three,
// still a linear problem. Rows are weighted by 1 / time so that 64 MiB runs do not drown 1 MiB
// ones: what the fit minimises is relative error, the figure we report.
// Guards: a negative alpha is pinned at 0; an eta outside (0, 1] (beta_x <= 0 or beta_x < beta),
// or data without both one-way and exchange bytes (eta not determined), ties beta_x = beta
// (eta = 1); after either the rest is refitted.
//
// Reading measurements (the benches' JSON lines), naming codecs and fitting links with token
// buckets through the simulator (Nelder-Mead) are tooling, not library: bench/sim_fit.hpp, used by
// lockstep-sim.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "cost_model.hpp"

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
// One equation of a weighted least-squares problem, x . p = y, both sides already multiplied by
// the row's weight.
struct wls_row {
  std::array<double, 3> x{};
  double y = 0;
};

// The p over the first k columns (k <= 3) that minimises the rows' summed squared residuals: the
// normal equations with their columns scaled to a unit diagonal (alpha ~1e-6 s, beta ~1e-10 s/B
// and gamma ~1e-10 s per value differ by orders), then Gauss-Jordan with partial pivoting. False
// where they are singular: a column without weight, or columns that (nearly) coincide, below
// min_pivot after scaling (the data do not tell them apart). The one solver of the link's fit
// (fit_alpha_beta) and the calibration's (collective/calibrate.hpp).
inline bool least_squares(const std::vector<wls_row>& rows, std::size_t k, std::array<double, 3>& p,
                          double min_pivot = 1e-12) {
  if (k == 0 || k > 3) return false;
  double m[3][4] = {};
  for (const wls_row& r : rows)
    for (std::size_t i = 0; i < k; ++i) {
      for (std::size_t j = 0; j < k; ++j) m[i][j] += r.x[i] * r.x[j];
      m[i][k] += r.x[i] * r.y;
    }
  double scale[3] = {0, 0, 0};
  for (std::size_t i = 0; i < k; ++i) {
    if (!(m[i][i] > 0)) return false;
    scale[i] = 1.0 / std::sqrt(m[i][i]);
  }
  for (std::size_t i = 0; i < k; ++i) {
    for (std::size_t j = 0; j < k; ++j) m[i][j] *= scale[i] * scale[j];
    m[i][k] *= scale[i];
  }
  for (std::size_t c = 0; c < k; ++c) {
    std::size_t piv = c;
    for (std::size_t r = c + 1; r < k; ++r)
      if (std::abs(m[r][c]) > std::abs(m[piv][c])) piv = r;
    if (std::abs(m[piv][c]) < min_pivot) return false;
    for (std::size_t j = 0; j <= k; ++j) std::swap(m[c][j], m[piv][j]);
    for (std::size_t r = 0; r < k; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (std::size_t j = c; j <= k; ++j) m[r][j] -= f * m[c][j];
    }
  }
  p = {0, 0, 0};
  for (std::size_t i = 0; i < k; ++i) p[i] = m[i][k] / m[i][i] * scale[i];
  return std::isfinite(p[0]) && std::isfinite(p[1]) && std::isfinite(p[2]);
}

// Weighted least squares (weights 1 / time) over the link's columns picked by pin_alpha and tie
// (alpha, beta, beta_x); with `tie` the exchange bytes join the beta column. Returns false where
// the normal equations are singular.
inline bool solve_link(const std::vector<sample>& xs, bool pin_alpha, bool tie, std::array<double, 3>& p) {
  std::vector<int> cols;
  if (!pin_alpha) cols.push_back(0);
  cols.push_back(1);
  if (!tie) cols.push_back(2);
  std::vector<wls_row> rows;
  for (const sample& s : xs) {
    if (!(s.seconds > 0)) continue;
    const double w = 1.0 / s.seconds;
    const double all[3] = {s.alpha_count * w, (s.beta_count + (tie ? s.exchange_count : 0.0)) * w, s.exchange_count * w};
    wls_row r;
    for (std::size_t i = 0; i < cols.size(); ++i) r.x[i] = all[cols[i]];
    r.y = (s.seconds - s.fixed_s) * w;
    rows.push_back(r);
  }
  std::array<double, 3> q{};
  if (!least_squares(rows, cols.size(), q)) return false;
  p = {0, 0, 0};
  for (std::size_t i = 0; i < cols.size(); ++i) p[static_cast<std::size_t>(cols[i])] = q[i];
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
  auto bad = [](const std::string& why) { return error(errc::invalid_argument, "sim::fit_alpha_beta", -1, -1, why); };
  if (used < 2) throw bad("need at least two measurements with a time > 0, got " + std::to_string(used));
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
      throw bad("the measurements do not determine the link parameters (" + std::to_string(used) +
                " rows; vary the message count and the bytes independently)");
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
  if (!(beta > 0) || !(beta_x >= beta)) throw bad("the measurements do not determine a positive beta");
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

}  // namespace lockstep::sim
