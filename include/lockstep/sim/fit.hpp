// lockstep/sim/fit.hpp: link parameters (alpha, beta) fitted to measured all-reduce times.
//
// A measurement is one JSON object per line (the benches' --json output) with at least
//   "bytes"    fp32 payload of the all-reduce
//   "time_us"  its time
// and, to say what ran, "ranks" (or "size"), "topology" (ring, torus2d) and "codec" (fp32, bf16,
// int8, dyntree8). Each line becomes one equation of the closed-form cost model,
//   time - codec work = messages * alpha + wire_bytes * beta,
// and least squares solves for alpha and beta. Rows are weighted by 1 / time so that 64 MiB runs
// do not drown 1 MiB ones: what the fit minimises is relative error, the figure we report.
#pragma once

#include <cctype>
#include <cmath>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../codec.hpp"
#include "cost_model.hpp"

namespace lockstep::sim {

// One equation: seconds = alpha_count * alpha + beta_count * beta + fixed_s.
struct sample {
  double alpha_count = 0;
  double beta_count = 0;
  double fixed_s = 0;  // known part (codec work at the measured gamma)
  double seconds = 0;
};

struct fit_result {
  link_params link;
  double rms_relative_error = 0;
  std::size_t samples = 0;
};

inline fit_result fit_alpha_beta(const std::vector<sample>& xs) {
  // Weighted normal equations of the 2x2 problem; w = 1/seconds.
  double saa = 0, sab = 0, sbb = 0, say = 0, sby = 0;
  std::size_t used = 0;
  for (const sample& s : xs) {
    if (!(s.seconds > 0)) continue;
    const double w = 1.0 / s.seconds, a = s.alpha_count * w, b = s.beta_count * w, y = (s.seconds - s.fixed_s) * w;
    saa += a * a, sab += a * b, sbb += b * b, say += a * y, sby += b * y;
    ++used;
  }
  if (used < 2) throw std::invalid_argument("fit: need at least two measurements, got " + std::to_string(used));
  double alpha = 0, beta = 0;
  const double det = saa * sbb - sab * sab;
  if (std::abs(det) > 1e-12 * saa * sbb) {
    alpha = (say * sbb - sby * sab) / det;
    beta = (sby * saa - say * sab) / det;
  }
  // A negative latency is noise on a bandwidth-bound set: pin it at 0 and refit beta alone.
  if (!(alpha >= 0) || !(beta > 0)) {
    alpha = 0;
    beta = sby / sbb;
  }
  if (!(beta > 0)) throw std::invalid_argument("fit: the measurements do not determine a positive beta");
  fit_result f;
  f.link.latency_s = alpha;
  f.link.bandwidth_Bps = 1.0 / beta;
  f.samples = used;
  double se = 0;
  for (const sample& s : xs) {
    if (!(s.seconds > 0)) continue;
    const double pred = s.alpha_count * alpha + s.beta_count * beta + s.fixed_s;
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

// The closed-form terms of one measurement; nullopt when the line is not a lockstep all-reduce the
// model covers (an MPI_Allreduce baseline, say, whose algorithm we do not know).
inline std::optional<cost_terms> terms_of(const json_object& o, const codec_model& c, std::size_t segment_bytes) {
  auto num = [&](const char* k) -> std::optional<double> {
    auto it = o.find(k);
    if (it == o.end()) return std::nullopt;
    try {
      return std::stod(it->second);
    } catch (...) {
      return std::nullopt;
    }
  };
  auto topo = o.find("topology");
  auto ranks = num("ranks");
  if (!ranks) ranks = num("size");
  auto bytes = num("bytes");
  if (topo == o.end() || !ranks || !bytes) return std::nullopt;
  const int size = static_cast<int>(*ranks);
  std::size_t n = static_cast<std::size_t>(*bytes) / sizeof(float);
  n -= n % static_cast<std::size_t>(size);  // the closed forms want equal chunks; off by < size values
  if (topo->second == "ring") return ring_terms(size, n, c, segment_bytes);
  if (topo->second == "torus2d") {
    auto [r, cc] = square_shape(size);
    return torus2d_terms(r, cc, n, c, segment_bytes);
  }
  return std::nullopt;
}

}  // namespace lockstep::sim
