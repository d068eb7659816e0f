// lockstep/topology/recursive_doubling.hpp: the latency-optimal forms for the smallest messages.
//
// all_reduce by recursive doubling: with N = 2^k, step j (distance d = 1, 2, .., N/2) pairs rank r
// with r ^ d and the two *exchange* the whole buffer (topology::is_exchange): each sends what it
// holds and adds what it receives, so after k steps every rank holds the whole sum. k steps
// instead of halving-doubling's 2k, at the price of sending the whole buffer every step:
// log2(N) alpha + log2(N) S beta, which wins only while alpha dominates (a few KiB).
// Other group sizes fold as halving_doubling does (MPICH's recursive doubling): each of the first
// m = N - p even ranks sends its whole buffer to its odd neighbour first and receives the result
// from it at the end; that costs two steps of S bytes.
// broadcast by a binomial tree: the root's buffer reaches 2, 4, 8, .. ranks, log2 N steps of S.
// reduce_scatter and all_gather are halving_doubling's (already log2 N steps for those ops).
//
// Lossy codecs: an exchange leaves both ends with the same bits (each adds the decoded images of
// both sides' values), the result is quantised once more by every rank alike before the folded
// ranks are sent it, so every rank ends bitwise equal; a value is quantised more often here than
// on the other topologies (docs/codecs.md, "Error of a collective").
#pragma once

#include <cstdint>
#include <string>

#include "../core/error.hpp"
#include "halving_doubling.hpp"
#include "schedule.hpp"

namespace lockstep::topology {

struct recursive_doubling {
  std::string name() const { return "recursive_doubling"; }
  void validate(int size, int rank = -1) const {
    if (size < 1)
      throw error(errc::invalid_argument, "recursive_doubling", rank, -1, "group size " + std::to_string(size));
  }
  schedule reduce_scatter(int rank, int size) const {
    validate(size, rank);
    return detail::halving_reduce_scatter(rank, size);
  }
  schedule all_gather(int rank, int size) const {
    validate(size, rank);
    return detail::doubling_all_gather(rank, size);
  }

  // The buffer is one chunk (a step is then one message, not one per rank's chunk). Every rank of
  // the power-of-two core owns (and ends with) it; a folded rank owns nothing and receives it.
  schedule all_reduce(int rank, int size) const {
    validate(size, rank);
    const detail::fold f(size);
    const chunk_span all{0, 1};
    schedule s{rank, size, 1, {}, all};
    const int v = f.virtual_of(rank);
    if (v < 0) {
      s.owned = {};
      detail::push(s, rank + 1, all, -1, {}, action::reduce, phase::reduce_scatter);
      detail::push(s, -1, {}, rank + 1, all, action::copy, phase::all_gather);
      return s;
    }
    const bool lender = rank < 2 * f.extra;
    if (lender) detail::push(s, -1, {}, rank - 1, all, action::reduce, phase::reduce_scatter);
    for (int d = 1; d < f.p; d *= 2) {
      const int peer = f.real_of(v ^ d);
      detail::push(s, peer, all, peer, all, action::reduce, phase::reduce_scatter);
    }
    if (lender) detail::push(s, rank - 1, all, -1, {}, action::copy, phase::all_gather);
    return s;
  }

  // Binomial tree from `root` (MPICH's): relative rank q = rank - root receives from q - lowbit(q)
  // and then sends to q + d for d = lowbit(q)/2, .., 1 (the root: from the top power of two down).
  // One chunk, as all_reduce.
  schedule broadcast(int root, int rank, int size) const {
    validate(size, rank);
    const chunk_span all{0, 1};
    schedule s{rank, size, 1, {}, all};
    const int q = (rank - root + size) % size;
    int top = 1;
    while (top < size) top *= 2;
    int d = q ? (q & -q) : top;
    if (q) detail::push(s, -1, {}, (q - d + root) % size, all, action::copy, phase::scatter);
    for (d /= 2; d >= 1; d /= 2)
      if (q + d < size) detail::push(s, (q + d + root) % size, all, -1, {}, action::copy, phase::scatter);
    return s;
  }
};

}  // namespace lockstep::topology
