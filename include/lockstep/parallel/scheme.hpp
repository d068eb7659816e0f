// lockstep/parallel/scheme.hpp: Krizhevsky's three ways (2014, section 3) to bring every rank the
// rows of the whole batch for a model-parallel layer, as policy tags. A scheme cuts the exchange
// into rounds; in each round rank k takes part with rows [lo, hi) of its own batch:
//
//   tag          paper  rounds  round r                              collective of a round
//   gather_all   (a)    1       every rank all its rows              all_gather_v / reduce_scatter_v
//   by_rank      (b)    K       rank r all its rows, the others none broadcast from r / reduce to r
//   by_slice     (c)    K       every rank the r-th 1/K of its rows  all_gather_v / reduce_scatter_v
//
// (a) moves everything, then computes. (b) and (c) compute on round r while round r + 1 is in
// flight; (c) keeps the ratio of communication to computation of a round constant as K grows
// (the paper's choice for large K). Every round is one collective, so the bytes on the wire are
// the same for all three (except (b)'s reduce to one rank, a chain on a ring: see docs/design.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../collective/executor.hpp"  // chunk_range

namespace lockstep::parallel {

// Rows [lo, hi) of one rank's own batch.
struct row_block {
  std::size_t lo = 0, hi = 0;
  constexpr std::size_t size() const noexcept { return hi - lo; }
};
using round_blocks = std::vector<row_block>;  // (rank)

struct gather_all {  // (a): one round of everything
  static constexpr std::uint32_t id = 1;
  static constexpr const char* name() noexcept { return "gather_all"; }
  static std::vector<round_blocks> rounds(const std::vector<std::size_t>& rows) {
    round_blocks r(rows.size());
    for (std::size_t k = 0; k < rows.size(); ++k) r[k] = {0, rows[k]};
    return {r};
  }
};

struct by_rank {  // (b): round r is rank r's rows
  static constexpr std::uint32_t id = 2;
  static constexpr const char* name() noexcept { return "by_rank"; }
  static std::vector<round_blocks> rounds(const std::vector<std::size_t>& rows) {
    std::vector<round_blocks> out(rows.size(), round_blocks(rows.size()));
    for (std::size_t r = 0; r < rows.size(); ++r) out[r][r] = {0, rows[r]};
    return out;
  }
};

struct by_slice {  // (c): round r is the r-th 1/K of every rank's rows
  static constexpr std::uint32_t id = 3;
  static constexpr const char* name() noexcept { return "by_slice"; }
  static std::vector<round_blocks> rounds(const std::vector<std::size_t>& rows) {
    const std::size_t K = rows.size();
    std::vector<round_blocks> out(K, round_blocks(K));
    for (std::size_t r = 0; r < K; ++r)
      for (std::size_t k = 0; k < K; ++k) {
        const auto [lo, hi] = chunk_range(rows[k], K, r);
        out[r][k] = {lo, hi};
      }
    return out;
  }
};

template <class S>
concept scheme = requires(const std::vector<std::size_t>& rows) {
  { S::id } -> std::convertible_to<std::uint32_t>;
  { S::name() } -> std::convertible_to<const char*>;
  { S::rounds(rows) } -> std::same_as<std::vector<round_blocks>>;
};

inline const char* scheme_name(std::uint32_t id) noexcept {
  switch (id) {
    case gather_all::id: return "gather_all (a)";
    case by_rank::id: return "by_rank (b)";
    case by_slice::id: return "by_slice (c)";
  }
  return "an unknown scheme";
}

}  // namespace lockstep::parallel
