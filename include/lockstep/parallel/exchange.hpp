// lockstep/parallel/exchange.hpp: the two ways rows travel in a model-parallel layer, each cut
// into the scheme's rounds (parallel/scheme.hpp) and overlapped with the caller's computation.
//
//   gather_rows   every rank's own rows reach every rank (column-split forward: X; row-split
//                 backward: dY). All rounds are posted at once (they run in call order on the
//                 group's worker, or on its stream); round r is computed on as soon as it has
//                 arrived, while the rounds after it are still moving.
//   reduce_rows   partial results for all rows are summed into their owners' rows (column-split
//                 backward: dX; row-split forward: Y). Round r is computed, then posted, and round
//                 r + 1 is computed while it moves; `overlap` runs once every round is posted.
//
// Both are written once against parallel/lanes.hpp: on a host group "computed on as soon as it
// has arrived" is a wait for the round's request, on a stream-ordered group an event between the
// group's stream and the compute stream, with nothing done at call time.
//
// A round whose rows are consecutive in the whole batch's order (every round of gather_all and
// by_rank) moves in place; by_slice's rounds are gathered into a staging buffer and copied out.
// A round with one rank taking part is a broadcast from it (gathering) or a reduce_scatter_v with
// one non-zero count (reducing): the reduce to that rank. Values cross the wire through the
// layer's codec and are summed in fp32. Every request is waited for (or, on a stream, every queued
// use of a buffer is behind the join) before the buffers it uses go, errors included.
#pragma once

#include <cstring>
#include <span>
#include <vector>

#include "../collective/collectives.hpp"
#include "batch.hpp"
#include "lanes.hpp"
#include "scheme.hpp"

namespace lockstep::parallel::detail {

// Where a round's rows are: m rows, in rank order; `start` is the first one's row in the whole
// batch when they are consecutive there.
struct round_place {
  std::size_t m = 0;
  std::size_t start = 0;
  bool in_place = true;
  int contributors = 0, root = -1;
};

inline round_place place(const batch& b, const round_blocks& r) {
  round_place p;
  bool any = false;
  std::size_t next = 0;
  for (std::size_t k = 0; k < r.size(); ++k) {
    if (r[k].size() == 0) continue;
    const std::size_t s = b.first[k] + r[k].lo;
    if (!any) p.start = s;
    else if (s != next) p.in_place = false;
    any = true;
    next = s + r[k].size();
    p.m += r[k].size();
    ++p.contributors;
    p.root = static_cast<int>(k);
  }
  return p;
}

// Copies a round's rows between rank order (`packed`, m x width) and the whole batch's order
// (`whole`, total x width), in either direction, on the compute lane.
template <class L>
void scatter_rows(L& lanes, const batch& b, const round_blocks& r, std::size_t width, const float* packed, float* whole) {
  for (std::size_t k = 0; k < r.size(); ++k) {
    const std::size_t n = r[k].size() * width;
    if (n) lanes.compute_copy(whole + (b.first[k] + r[k].lo) * width, packed, n * sizeof(float));
    packed += n;
  }
}
template <class L>
void pack_rows(L& lanes, const batch& b, const round_blocks& r, std::size_t width, const float* whole, float* packed) {
  for (std::size_t k = 0; k < r.size(); ++k) {
    const std::size_t n = r[k].size() * width;
    if (n) lanes.compute_copy(packed, whole + (b.first[k] + r[k].lo) * width, n * sizeof(float));
    packed += n;
  }
}

inline std::vector<std::size_t> counts_of(const round_blocks& r, std::size_t width) {
  std::vector<std::size_t> c(r.size());
  for (std::size_t k = 0; k < r.size(); ++k) c[k] = r[k].size() * width;
  return c;
}

// Where this rank's block of round r starts in the round's rank order (rows).
inline std::size_t rows_before(const round_blocks& r, std::size_t me) {
  std::size_t before = 0;
  for (std::size_t k = 0; k < me; ++k) before += r[k].size();
  return before;
}

// own: this rank's rows (rows x w_in); all_in: the whole batch (total x w_in), filled here;
// all_out: total x w_out, written by compute(in_rows, m, out_rows) round by round on the compute
// lane (parallel/lanes.hpp).
template <class G, class L, class T, class C, class Compute>
void gather_rows(G& g, L& lanes, const T& topo, C& codec, const batch& b, const std::vector<round_blocks>& rounds,
                 std::size_t w_in, std::span<const float> own, std::span<float> all_in, std::size_t w_out,
                 std::span<float> all_out, Compute&& compute) {
  const auto me = static_cast<std::size_t>(g.rank());
  const std::size_t R = rounds.size();
  std::vector<round_place> at(R);
  std::vector<float*> staged(R, nullptr);  // (round) by_slice's rounds only: m x w_in
  std::vector<std::vector<std::size_t>> counts(R);
  for (std::size_t r = 0; r < R; ++r) {
    at[r] = place(b, rounds[r]);
    if (at[r].m == 0) continue;
    float* buf = all_in.data() + at[r].start * w_in;
    if (!at[r].in_place) buf = staged[r] = lanes.staging(at[r].m * w_in);
    // This rank's block goes where the collective expects it: its offset in the round's rank order.
    const row_block mine = rounds[r][me];
    if (mine.size())
      lanes.wire_copy(buf + rows_before(rounds[r], me) * w_in, own.data() + mine.lo * w_in, mine.size() * w_in * sizeof(float));
    const std::span<float> span(buf, at[r].m * w_in);
    if (at[r].contributors == 1) lanes.posted(r, broadcast_async(g, span, at[r].root, topo, codec));
    else {
      counts[r] = counts_of(rounds[r], w_in);
      lanes.posted(r, all_gather_v_inplace_async(g, span, std::span<const std::size_t>(counts[r]), topo, codec));
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    if (at[r].m == 0) continue;
    lanes.arrived(r);
    if (at[r].in_place) {
      compute(all_in.data() + at[r].start * w_in, at[r].m, all_out.data() + at[r].start * w_out);
    } else {
      scatter_rows(lanes, b, rounds[r], w_in, staged[r], all_in.data());
      float* out = lanes.compute_staging(at[r].m * w_out);
      compute(staged[r], at[r].m, out);
      scatter_rows(lanes, b, rounds[r], w_out, out, all_out.data());
    }
  }
}

// all_in: the whole batch (total x w_in); own_out: this rank's rows (rows x w_out), written with
// the sum over ranks of compute(in_rows, m, partial_rows) for its rows; overlap() runs on the
// compute lane while the last rounds move.
template <class G, class L, class T, class C, class Compute, class Overlap>
void reduce_rows(G& g, L& lanes, const T& topo, C& codec, const batch& b, const std::vector<round_blocks>& rounds,
                 std::size_t w_in, std::span<const float> all_in, std::size_t w_out, std::span<float> own_out,
                 Compute&& compute, Overlap&& overlap) {
  const auto me = static_cast<std::size_t>(g.rank());
  const std::size_t R = rounds.size();
  std::vector<round_place> at(R);
  std::vector<float*> partial(R, nullptr);  // (round): m x w_out
  std::vector<std::vector<std::size_t>> counts(R);
  for (std::size_t r = 0; r < R; ++r) {
    at[r] = place(b, rounds[r]);
    if (at[r].m == 0) continue;
    const float* in = all_in.data() + at[r].start * w_in;
    if (!at[r].in_place) {
      float* staged = lanes.compute_staging(at[r].m * w_in);
      pack_rows(lanes, b, rounds[r], w_in, all_in.data(), staged);
      in = staged;
    }
    partial[r] = lanes.compute_staging(at[r].m * w_out);  // the wire reads it after handed()
    compute(in, at[r].m, partial[r]);
    counts[r] = counts_of(rounds[r], w_out);
    lanes.handed();
    lanes.posted(r, reduce_scatter_v_inplace_async(g, std::span<float>(partial[r], at[r].m * w_out),
                                                   std::span<const std::size_t>(counts[r]), topo, codec));
  }
  overlap();
  for (std::size_t r = 0; r < R; ++r) {
    if (at[r].m == 0) continue;
    lanes.landed(r);
    const row_block mine = rounds[r][me];
    if (mine.size())
      lanes.wire_copy(own_out.data() + mine.lo * w_out, partial[r] + rows_before(rounds[r], me) * w_out,
                      mine.size() * w_out * sizeof(float));
  }
}

}  // namespace lockstep::parallel::detail
