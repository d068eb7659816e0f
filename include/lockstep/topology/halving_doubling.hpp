// lockstep/topology/halving_doubling.hpp: Rabenseifner's all-reduce (Thakur, Rabenseifner & Gropp
// 2005): reduce-scatter by recursive halving, all-gather by recursive doubling.
//
// With N = 2^k ranks, reduce-scatter step j (distance d = N/2, N/4, .., 1) pairs rank r with
// r ^ d: of the block of 2d chunks both still hold, each keeps the half its own rank falls in and
// sends the other half to its partner, which adds it. After k steps rank r owns chunk r. The
// all-gather runs the same pairs in reverse (d = 1, 2, .., N/2), each sending all it holds.
// Cost: 2 log2(N) alpha + 2(N-1)/N S beta, the ring's bandwidth term in 2 log2 N steps.
//
// Other group sizes fold the extra ranks in, as MPICH does. With p the largest power of two
// <= N and m = N - p, each of the first m even ranks e = 2v lends its data to its odd neighbour
// e + 1 and sits out; the p remaining ranks run the power-of-two algorithm as "virtual" ranks
// v = 0..p-1, virtual rank v standing for chunks [2v, 2v + 2) where v < m and for chunk v + m
// otherwise, so every virtual rank's chunks are contiguous and in rank order. In detail:
//   reduce-scatter: e sends e + 1 every chunk but its own, e (chunks [0, e) then [e + 1, N), two
//   messages); the virtual ranks halve; e + 1 then holds chunks e and e + 1 reduced, except that
//   chunk e lacks e's own contribution: it sends that partial sum to e, which adds its own.
//   all-gather: e sends its chunk to e + 1; the virtual ranks double; e + 1 sends e the rest.
// Every rank still ends owning chunk r; a folded pair costs two steps more in each phase.
#pragma once

#include <cstdint>
#include <string>

#include "../core/error.hpp"
#include "schedule.hpp"

namespace lockstep::topology {

namespace detail {

// The fold of a group of `size` ranks onto p = 2^k virtual ones (see above).
struct fold {
  int size = 1, p = 1, extra = 0;  // extra = size - p folded pairs

  explicit constexpr fold(int n) noexcept : size(n) {
    while (p * 2 <= n) p *= 2;
    extra = n - p;
  }
  // Virtual rank of a real rank; -1 for a rank that sits out (even, below 2 * extra).
  constexpr int virtual_of(int r) const noexcept { return r < 2 * extra ? (r % 2 ? r / 2 : -1) : r - extra; }
  constexpr int real_of(int v) const noexcept { return v < extra ? 2 * v + 1 : v + extra; }
  // First chunk virtual rank v stands for (v = p: one past the last).
  constexpr std::uint32_t first_chunk(int v) const noexcept {
    return static_cast<std::uint32_t>(v < extra ? 2 * v : v + extra);
  }
  // Chunks of virtual ranks [a, b).
  constexpr chunk_span chunks(int a, int b) const noexcept { return {first_chunk(a), first_chunk(b) - first_chunk(a)}; }
  int steps() const noexcept {
    int k = 0;
    while ((1 << k) < p) ++k;
    return k;
  }
};

inline schedule one_chunk_each(int rank, int size) {
  return {rank, size, static_cast<std::uint32_t>(size), {}, {static_cast<std::uint32_t>(rank), 1}};
}

inline void push(schedule& s, int send_peer, chunk_span send, int recv_peer, chunk_span recv, action act, phase ph) {
  if (send.empty()) send_peer = -1, send = {};
  if (recv.empty()) recv_peer = -1, recv = {};
  if (send_peer < 0 && recv_peer < 0) return;
  s.steps.push_back({send_peer, send, recv_peer, recv, act, ph});
}

// Reduce-scatter by recursive halving with the fold; rank r ends owning chunk r.
inline schedule halving_reduce_scatter(int rank, int size) {
  schedule s = one_chunk_each(rank, size);
  const fold f(size);
  const auto r32 = static_cast<std::uint32_t>(rank), n32 = static_cast<std::uint32_t>(size);
  const int v = f.virtual_of(rank);
  if (v < 0) {  // sits out: lend all but our own chunk, take our chunk's partial sum back
    push(s, rank + 1, {0, r32}, -1, {}, action::reduce, phase::reduce_scatter);
    push(s, rank + 1, {r32 + 1, n32 - r32 - 1}, -1, {}, action::reduce, phase::reduce_scatter);
    push(s, -1, {}, rank + 1, {r32, 1}, action::reduce, phase::reduce_scatter);
    return s;
  }
  const bool lender = rank < 2 * f.extra;  // our even neighbour lends to us
  if (lender) {
    push(s, -1, {}, rank - 1, {0, r32 - 1}, action::reduce, phase::reduce_scatter);
    push(s, -1, {}, rank - 1, {r32, n32 - r32}, action::reduce, phase::reduce_scatter);
  }
  for (int d = f.p / 2; d >= 1; d /= 2) {
    const int lo = v & ~(2 * d - 1), peer = f.real_of(v ^ d);
    const bool upper = v & d;
    const chunk_span low = f.chunks(lo, lo + d), high = f.chunks(lo + d, lo + 2 * d);
    push(s, peer, upper ? low : high, peer, upper ? high : low, action::reduce, phase::reduce_scatter);
  }
  if (lender) push(s, rank - 1, {r32 - 1, 1}, -1, {}, action::reduce, phase::reduce_scatter);
  return s;
}

// All-gather by recursive doubling with the fold; starts from "rank r owns chunk r".
inline schedule doubling_all_gather(int rank, int size) {
  schedule s = one_chunk_each(rank, size);
  const fold f(size);
  const auto r32 = static_cast<std::uint32_t>(rank), n32 = static_cast<std::uint32_t>(size);
  const int v = f.virtual_of(rank);
  if (v < 0) {
    push(s, rank + 1, {r32, 1}, -1, {}, action::copy, phase::all_gather);
    push(s, -1, {}, rank + 1, {0, r32}, action::copy, phase::all_gather);
    push(s, -1, {}, rank + 1, {r32 + 1, n32 - r32 - 1}, action::copy, phase::all_gather);
    return s;
  }
  const bool lender = rank < 2 * f.extra;
  if (lender) push(s, -1, {}, rank - 1, {r32 - 1, 1}, action::copy, phase::all_gather);
  for (int d = 1; d < f.p; d *= 2) {
    const int mine = v & ~(d - 1), theirs = mine ^ d, peer = f.real_of(v ^ d);
    push(s, peer, f.chunks(mine, mine + d), peer, f.chunks(theirs, theirs + d), action::copy, phase::all_gather);
  }
  if (lender) {
    push(s, rank - 1, {0, r32 - 1}, -1, {}, action::copy, phase::all_gather);
    push(s, rank - 1, {r32, n32 - r32}, -1, {}, action::copy, phase::all_gather);
  }
  return s;
}

}  // namespace detail

struct halving_doubling {
  std::string name() const { return "halving_doubling"; }
  void validate(int size, int rank = -1) const {
    if (size < 1)
      throw error(errc::invalid_argument, "halving_doubling", rank, -1, "group size " + std::to_string(size));
  }
  schedule reduce_scatter(int rank, int size) const {
    validate(size, rank);
    return detail::halving_reduce_scatter(rank, size);
  }
  schedule all_gather(int rank, int size) const {
    validate(size, rank);
    return detail::doubling_all_gather(rank, size);
  }
};

}  // namespace lockstep::topology
