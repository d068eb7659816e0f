// lockstep/optim/step.hpp: one synchronous data-parallel step: the gradients of every rank are
// reduced and the optimizer turns them into new weights, as the all-reduce's epilogue.
//
//   optim::step(g, topology::ring{}, codec, opt, params, weights, grads, st, lr, weights_bf16);
//   optim::step_sharded(g, topology::ring{}, codec, opt, params, weights, grads, st, lr);
//
// Both all-reduce a *sum* and fold the 1/ranks of the average into the update (grad_scale): an
// average costs the executor a pass over the rank's chunk, the update reads every gradient anyway.
// Afterwards `grads` holds the summed gradients (step) or this rank's chunk of them (step_sharded).
//
// step — every rank updates every tensor. Passes over memory, in order:
//   1. all_reduce(sum) of grads with `codec`; its epilogue runs as each element range becomes final
//      on this rank (this rank's chunk after the reduce-scatter, then each gathered chunk):
//        SGD:  the update of the range: read w, g, v; write w, v, bf16.          20 B/param
//        LARS: the tensors this range completes (all of their elements now final) are updated in
//              waves: per-block sums of w², g² (reads w, g), then the update (w, g again, from
//              cache, and v).                                                    20 B/param
//              A tensor cut by a chunk boundary is finished by the range holding its last part.
//   Nothing runs after the all-reduce: there is no pass over the gradients between the last
//   receive and the update.
//
// step_sharded — each rank updates only its chunk [rank·n/size, (rank+1)·n/size):
//   1. reduce_scatter_inplace(sum) of grads with `codec`; epilogue on the rank's chunk:
//        SGD:  the update of the chunk (20 B/param of the chunk).
//        LARS: per-block sums over the chunk: reads w, g (8 B/param of the chunk).
//   2. LARS only: all_reduce (ring of `topo`, fp32) of 3 floats per tensor — the partial sums of
//      w², g², (g + βw)² — so every rank knows every tensor's norms; then the update of the chunk
//      (20 B/param of the chunk).
//   3. all_gather_inplace of the weights, always fp32: a lossy codec would round the master
//      weights themselves. Its epilogue writes the bf16 copy of the gathered chunks.
// The sharded result equals step's up to fp32 rounding: a tensor cut by a chunk boundary has its
// norms added from two fp32 partial sums instead of one fp64 sum.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../codec/bf16.hpp"
#include "../codec/fp32.hpp"
#include "../collective/collectives.hpp"
#include "../core/thread_pool.hpp"
#include "completion.hpp"
#include "concept.hpp"
#include "param_set.hpp"
#include "state.hpp"
#include "update.hpp"

namespace lockstep::optim {

namespace detail {

inline error step_error(const char* op, int rank, const std::string& why) {
  return error(errc::invalid_argument, op, rank, -1, why);
}

template <class Tr, class T, class C, optimizer O>
void step_impl(group<Tr>& g, const T& topo, C& codec, const O& opt, const param_set& ps, std::span<float> weights,
               std::span<float> grads, state& st, float lr, std::span<std::uint16_t> weights_bf16,
               thread_pool& pool) {
  detail::check_buffers("optim::step", opt, ps, weights.size(), grads.size(), weights_bf16.size(), st);
  const std::size_t n = ps.size();
  const step_context ctx{lr, 1.0f / static_cast<float>(g.size())};
  detail::sweep<O> sw(opt, ps, weights.data(), grads.data(), st, ctx,
                      weights_bf16.empty() ? nullptr : weights_bf16.data(), pool);

  if (!needs_any_sums(opt, ps)) {
    sw.prepare_normless();
    all_reduce(g, grads.first(n), topo, codec, reduce_op::sum,
               [&](std::size_t first, std::size_t count) { sw.apply_range(first, first + count); });
  } else {
    // A tensor is updated by the epilogue call that makes its last elements final.
    completion done(ps, "optim::step");
    std::vector<std::size_t> ready;
    all_reduce(g, grads.first(n), topo, codec, reduce_op::sum, [&](std::size_t first, std::size_t count) {
      const auto [a, b] = done.report(first, first + count, g.rank());
      ready.clear();
      for (std::size_t t = a; t < b; ++t) ready.push_back(t);
      sw.run(ready);
    });
    done.check_all_reported(g.rank());
  }
  st.count_step();
}

template <class Tr, class T, class C, optimizer O>
void step_sharded_impl(group<Tr>& g, const T& topo, C& codec, const O& opt, const param_set& ps,
                       std::span<float> weights, std::span<float> grads, state& st, float lr,
                       std::span<std::uint16_t> weights_bf16, thread_pool& pool) {
  detail::check_buffers("optim::step_sharded", opt, ps, weights.size(), grads.size(), weights_bf16.size(), st);
  const std::size_t n = ps.size();
  const int rank = g.rank();
  const auto [lo, hi] = chunk_range(n, static_cast<std::size_t>(g.size()), static_cast<std::size_t>(rank));
  const step_context ctx{lr, 1.0f / static_cast<float>(g.size())};
  std::uint16_t* bf = weights_bf16.empty() ? nullptr : weights_bf16.data();
  detail::sweep<O> sw(opt, ps, weights.data(), grads.data(), st, ctx, bf, pool);

  std::vector<std::size_t> own;  // tensors with elements in [lo, hi)
  for (auto [a, b] = ps.tensors_in(lo, hi); a < b; ++a) own.push_back(a);
  std::size_t reported = 0;
  auto check_range = [&](std::size_t first, std::size_t count) {
    if (first < lo || first + count > hi)
      throw detail::step_error("optim::step_sharded", rank,
                               "reduce_scatter reported [" + std::to_string(first) + ", " + std::to_string(first + count) +
                                   ") final, outside this rank's chunk [" + std::to_string(lo) + ", " +
                                   std::to_string(hi) + ")");
    reported += count;
  };

  if (!needs_any_sums(opt, ps)) {
    sw.prepare_normless();
    reduce_scatter_inplace(g, grads.first(n), topo, codec, reduce_op::sum, [&](std::size_t first, std::size_t count) {
      check_range(first, count);
      sw.apply_range(first, first + count);
    });
  } else {
    sw.clear_block_sums(own, lo, hi);
    reduce_scatter_inplace(g, grads.first(n), topo, codec, reduce_op::sum, [&](std::size_t first, std::size_t count) {
      check_range(first, count);
      sw.block_sums(own, first, first + count, true);
    });
    // (tensor, {w², g², d²}): this rank's part of every tensor's sums, then everyone's.
    std::vector<float> partial(3 * ps.tensor_count(), 0.0f);
    for (std::size_t t : own) {
      if (!sw.needs_sums(t)) continue;
      const tensor_sums s = sw.tensor_total(t, lo, hi);
      partial[3 * t] = static_cast<float>(s.w2);
      partial[3 * t + 1] = static_cast<float>(s.g2);
      partial[3 * t + 2] = static_cast<float>(s.d2);
    }
    codec::fp32 exact;
    all_reduce(g, std::span<float>(partial), topo, exact, reduce_op::sum);
    for (std::size_t t : own)
      sw.set_coeffs(t, sw.needs_sums(t) ? tensor_sums{partial[3 * t], partial[3 * t + 1], partial[3 * t + 2]}
                                        : tensor_sums{});
    sw.apply(own, lo, hi);
  }
  if (reported != hi - lo)
    throw detail::step_error("optim::step_sharded", rank,
                             "reduce_scatter reported " + std::to_string(reported) + " of the chunk's " +
                                 std::to_string(hi - lo) + " elements final");

  codec::fp32 exact;
  all_gather_inplace(g, weights.first(n), topo, exact, [&](std::size_t first, std::size_t count) {
    if (!bf || (first >= lo && first + count <= hi)) return;  // our own chunk's copy is written
    const std::size_t last = first + count;
    std::vector<std::pair<std::size_t, std::size_t>> spans;
    for (auto [a, b] = ps.tensors_in(first, last); a < b; ++a) {
      const std::size_t x = std::max(ps[a].offset, first), y = std::min(ps[a].offset + ps[a].size, last);
      for (std::size_t s = x; s < y; s += ps.policy().task) spans.push_back({s, std::min(y, s + ps.policy().task)});
    }
    pool.parallel_for(spans.size(), [&](std::size_t i) {
      for (std::size_t e = spans[i].first; e < spans[i].second; ++e)
        bf[e] = codec::bf16_from_bits(std::bit_cast<std::uint32_t>(weights[e]));
    });
  });
  st.count_step();
}

}  // namespace detail

// The fused step: all-reduce of the gradients, the update as its epilogue. Every rank must call it
// with the same param_set, optimizer, topology, codec and learning rate.
template <class Tr, class T, class C, class O>
void step(group<Tr>& g, const T& topo, C& codec, const O& opt, const param_set& ps, std::span<float> weights,
          std::span<float> grads, state& st, float lr, std::span<std::uint16_t> weights_bf16 = {},
          thread_pool& pool = thread_pool::shared()) {
  static_assert(check_optimizer<O>());
  if constexpr (optimizer<O>) detail::step_impl(g, topo, codec, opt, ps, weights, grads, st, lr, weights_bf16, pool);
}

// The sharded step: reduce-scatter, update of this rank's chunk, all-gather of the weights.
template <class Tr, class T, class C, class O>
void step_sharded(group<Tr>& g, const T& topo, C& codec, const O& opt, const param_set& ps,
                  std::span<float> weights, std::span<float> grads, state& st, float lr,
                  std::span<std::uint16_t> weights_bf16 = {}, thread_pool& pool = thread_pool::shared()) {
  static_assert(check_optimizer<O>());
  if constexpr (optimizer<O>)
    detail::step_sharded_impl(g, topo, codec, opt, ps, weights, grads, st, lr, weights_bf16, pool);
}

}  // namespace lockstep::optim
