// lockstep/device/step.hpp: the fused data-parallel step on device buffers: optim::begin_step and
// optim::step (optim/step.hpp: one all-reduce per bucket, the update as its epilogue) with a
// device::plan, stream ordered, no host synchronisation until wait().
//
//   device::param_table table(params, g.stream());                     // once
//   device::plan<optim::sgd> p{.opt = opt, .table = table, .weights = w, .grads = gr, .momentum = v};
//   auto s = optim::begin_step(g, topology::ring{}, codec, p, buckets, lr);
//   backward(..., [&](std::size_t k) { s.bucket_ready(k); });  s.wait();
//
// The bucket bookkeeping, the checks and the completion of tensors are optim/'s; this header is
// only the engine that turns "these elements (or tensors) are final" into kernels:
//   SGD (no norms): the coefficients are enqueued once, when the step begins; every final range
//        [lo, hi) then gets the update kernel over its elements only.
//   LARS (norms): a run of tensors a..b whose gradients are final gets its sums, coefficients and
//        update: three kernels over exactly their blocks.
// Against the host step, weights agree bit for bit for SGD (the same element function and
// all-reduce result) and to fp64 rounding of the norms for LARS (device/optim.hpp says why).
#pragma once

#include "config.hpp"

#include <cstdint>
#include <span>

#include "../optim/plan.hpp"
#include "../optim/step.hpp"
#include "optim.hpp"
#include "space.hpp"

namespace lockstep::device {

template <class O>
struct plan {
  O opt;                                  // the optimizer policy
  param_table& table;                     // the param_set's device twin (its params() are the tensors)
  std::span<float> weights;               // (element) device fp32 master weights, updated in place
  std::span<float> grads;                 // (element) device gradients, reduced in place
  float* momentum = nullptr;              // (element) device momentum, null for an optimizer without
  std::uint16_t* weights_bf16 = nullptr;  // (element) device bf16 copy of the new weights, or null
  optim::averaging average = optim::averaging::in_update;
};

template <class O>
class engine : public optim::engine_base {
 public:
  template <class G>
  engine(const plan<O>& p, float lr, G& g)
      : engine_base(p.opt, p.table.params(), p.grads, p.average),
        sw_(p.opt, p.table, {lr, optim::grad_scale(p.average, g.size())}, p.weights.data(), p.grads.data(), p.momentum,
            p.weights_bf16, g.stream()) {  // the group's stream, where the epilogues enqueue
    optim::detail::check_sizes("device::step", params().size(), p.weights.size(), p.grads.size(), 0);
    // Coefficients of an optimizer without norms depend on lr only: once, ahead of the all-reduces.
    if (!norms()) sw_.coefficients(0, params().tensor_count(), false);
  }
  void range(std::size_t lo, std::size_t hi) {
    const auto [a, b] = params().tensors_in(lo, hi);  // the blocks that hold [lo, hi): those of its tensors
    sw_.update(a, b, lo, hi);
  }
  void tensors(std::size_t a, std::size_t b) {
    sw_.coefficients(a, b, true);
    sw_.update(a, b, params()[a].offset, params()[b - 1].offset + params()[b - 1].size);
  }
  void finish() noexcept {}

 private:
  sweep<O> sw_;
};

}  // namespace lockstep::device

namespace lockstep::optim {

// The device plan's step: optim::begin_step and optim::step over the device engine.
template <class O>
struct engine_for<device::plan<O>> {
  using type = device::engine<O>;
};

}  // namespace lockstep::optim
