// lockstep/device/step.hpp: the fused data-parallel step on device buffers: all-reduce of the
// gradients with the optimizer update as its epilogue, stream ordered, no host synchronisation.
//
//   device::param_table table(params, g.stream());                     // once
//   auto r = device::step_async(g, topology::ring{}, codec, opt, table, lr, weights, grads, momentum);
//   ... enqueue the next forward on g.stream() ...  r.wait();          // or never: the stream orders
//
// The device form of optim::step (optim/step.hpp), with the same contract: the all-reduce sums,
// the update folds 1/ranks in (grad_scale), afterwards `grads` holds the summed gradients.
//   SGD (no norms): the coefficients are enqueued once, before the all-reduce; every epilogue
//        range [first, first + count) then gets the update kernel over its elements only.
//   LARS (norms): an epilogue range completes a run of consecutive tensors (optim::completion,
//        the host step's bookkeeping); their sums, coefficients and update are three kernels over
//        exactly their blocks, enqueued when the range becomes final.
// The epilogue runs while the executor enqueues the all-reduce, so every decision here is made on
// the host from the schedule; the GPU only sees kernels in stream order.
//
// Compared with the host step, weights agree bit for bit for SGD (same element function, same
// all-reduce result) and to fp64 rounding of the norms for LARS (the device adds a block's squares
// in a tree, the host in eight lanes; see device/optim.hpp).
#pragma once

#include "config.hpp"

#include <cstdint>
#include <span>
#include <string>

#include "../optim/completion.hpp"
#include "../optim/concept.hpp"
#include "../collective/collectives.hpp"
#include "optim.hpp"
#include "space.hpp"

namespace lockstep::device {

template <transport::transport Tr, topology::topology T, codec::codec C, optim::optimizer O>
  requires std::same_as<transport::space_of<Tr>, cuda_space>
request step_async(group<Tr>& g, const T& topo, C& codec, const O& opt, param_table& table, float lr,
                   std::span<float> weights, std::span<float> grads, float* momentum,
                   std::uint16_t* weights_bf16 = nullptr) {
  const optim::param_set& ps = table.params();
  const std::size_t n = ps.size();
  auto bad = [&](const std::string& why) { return error(errc::invalid_argument, "device::step", g.rank(), -1, why); };
  if (weights.size() < n) throw bad("weights hold " + std::to_string(weights.size()) + " of the " + std::to_string(n) + " parameters");
  if (grads.size() < n) throw bad("gradients hold " + std::to_string(grads.size()) + " of the " + std::to_string(n) + " parameters");
  detail::check_momentum(opt, momentum, "device::step");

  const optim::step_context ctx{lr, 1.0f / static_cast<float>(g.size())};
  float* const w = weights.data();
  const float* const gr = grads.data();
  const std::size_t nb = table.block_count(), nt = table.tensor_count();

  if (!optim::needs_any_sums(opt, ps)) {
    // Coefficients depend on lr and the optimizer only: once, ahead of the all-reduce.
    detail::enqueue_coefficients(opt, table, ctx, false, 0, nt, 0, nb, w, gr, g.stream());
    auto ep = [&, s = g.stream()](std::size_t first, std::size_t count) {
      // The blocks that hold [first, first + count): those of the tensors it touches.
      const auto [a, b] = ps.tensors_in(first, first + count);
      if (a < b) detail::enqueue_update(opt, table, ps.first_block(a), ps.first_block(b - 1) + ps.block_count(b - 1), first,
                                        first + count, w, gr, momentum, weights_bf16, s);
    };
    return all_reduce_async(g, grads.first(n), topo, codec, reduce_op::sum, ep);
  }

  optim::completion done(ps, "device::step");
  auto ep = [&, s = g.stream()](std::size_t first, std::size_t count) {
    const auto [a, b] = done.report(first, first + count, g.rank());
    if (a == b) return;
    const std::size_t b0 = ps.first_block(a), b1 = ps.first_block(b - 1) + ps.block_count(b - 1);
    detail::enqueue_coefficients(opt, table, ctx, true, a, b, b0, b1, w, gr, s);
    detail::enqueue_update(opt, table, b0, b1, ps[a].offset, ps[b - 1].offset + ps[b - 1].size, w, gr, momentum,
                           weights_bf16, s);
  };
  request r = all_reduce_async(g, grads.first(n), topo, codec, reduce_op::sum, ep);
  done.check_all_reported(g.rank());
  return r;
}

template <transport::transport Tr, topology::topology T, codec::codec C, optim::optimizer O>
  requires std::same_as<transport::space_of<Tr>, cuda_space>
void step(group<Tr>& g, const T& topo, C& codec, const O& opt, param_table& table, float lr, std::span<float> weights,
          std::span<float> grads, float* momentum, std::uint16_t* weights_bf16 = nullptr) {
  step_async(g, topo, codec, opt, table, lr, weights, grads, momentum, weights_bf16).wait();
}

}  // namespace lockstep::device
