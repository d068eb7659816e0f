// lockstep/optim/bucket.hpp: buckets, the pieces of the flat gradient buffer that a bucketed step
// all-reduces one by one as backward writes them (step.hpp, begin_step).
//
//   buffer   | t0 ...... | t1 .. |pad| t2 ............ | t3 | t4 ....... |     // (element)
//   buckets  | b2 ................... | b1 ............... | b0 ......... |     // (bucket)
//
// A bucket list may be in any order (DDP keeps the order backward writes it, last layers first);
// bucket k is position k in the list, not in the buffer. Sorted by offset, the buckets must tile
// the whole buffer [0, params.size()) with no gap and no overlap (padding between tensors belongs to
// a bucket like any other element), and every tensor must lie inside one bucket: an update that
// needs a tensor's norms (LARS) can only run once all of it is reduced, and a tensor cut by a bucket
// boundary would tie two collectives together. check_buckets throws a lockstep::error naming the
// bucket (and the tensor) that breaks a rule.
#pragma once

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "../core/error.hpp"
#include "param_set.hpp"

namespace lockstep::optim {

struct bucket {
  std::size_t first = 0;  // first element, in the flat buffers
  std::size_t last = 0;   // one past the last element
};

namespace detail {
inline std::string show(std::size_t k, const bucket& b) {
  return "bucket " + std::to_string(k) + " [" + std::to_string(b.first) + ", " + std::to_string(b.last) + ")";
}
}  // namespace detail

inline void check_buckets(const param_set& ps, std::span<const bucket> buckets, const char* op, int rank) {
  auto bad = [&](const std::string& why) { return error(errc::invalid_argument, op, rank, -1, why); };
  const std::size_t n = ps.size();
  if (buckets.empty()) throw bad("no buckets: at least one must cover the " + std::to_string(n) + " elements");
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const bucket& b = buckets[k];
    // An empty parameter set steps as a no-op (optim::step's one bucket is then {0, 0}), as
    // optim::update and step_sharded take it.
    if (b.first >= b.last && n > 0) throw bad(detail::show(k, b) + " is empty");
    if (b.last > n)
      throw bad(detail::show(k, b) + " ends past the " + std::to_string(n) + " elements of the parameters");
  }
  std::vector<std::size_t> by_offset(buckets.size());  // (position in the buffer) -> bucket index
  std::iota(by_offset.begin(), by_offset.end(), std::size_t{0});
  std::sort(by_offset.begin(), by_offset.end(),
            [&](std::size_t a, std::size_t b) { return buckets[a].first < buckets[b].first; });
  std::size_t covered = 0;  // every element below this is in exactly one bucket
  for (std::size_t i = 0; i < by_offset.size(); ++i) {
    const std::size_t k = by_offset[i];
    const bucket& b = buckets[k];
    if (b.first > covered)
      throw bad("elements [" + std::to_string(covered) + ", " + std::to_string(b.first) +
                ") are in no bucket (the next one is " + detail::show(k, b) + ")");
    if (b.first < covered)
      throw bad(detail::show(k, b) + " overlaps " + detail::show(by_offset[i - 1], buckets[by_offset[i - 1]]));
    covered = b.last;
  }
  if (covered < n)
    throw bad("elements [" + std::to_string(covered) + ", " + std::to_string(n) + ") are in no bucket");
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const bucket& b = buckets[k];
    const auto [a, e] = ps.tensors_in(b.first, b.last);
    for (std::size_t t : {a, e - 1}) {
      if (a == e) break;  // a bucket of padding alone
      const tensor_desc& d = ps[t];
      if (d.offset < b.first || d.offset + d.size > b.last)
        throw bad("tensor " + std::to_string(t) + " [" + std::to_string(d.offset) + ", " +
                  std::to_string(d.offset + d.size) + ") is cut by " + detail::show(k, b) +
                  "; a tensor must lie inside one bucket");
    }
  }
}

}  // namespace lockstep::optim
