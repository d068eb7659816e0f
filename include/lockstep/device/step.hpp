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
// Compared with the host step, weights agree bit for bit for SGD (same element function, same
// all-reduce result) and to fp64 rounding of the norms for LARS (the device adds a block's squares
// in a tree, the host in eight lanes; see device/optim.hpp).
#pragma once

#include "config.hpp"

#include <cstdint>
#include <span>
#include <string>

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
std::size_t plan_elements(const plan<O>& p) noexcept {
  return p.table.params().size();
}

template <class O>
class engine {
 public:
  template <class G>
  engine(const plan<O>& p, float lr, G& g)
      : p_(p), ps_(p.table.params()), stream_(g.stream()),
        ctx_{lr, optim::grad_scale(p.average, g.size())},
        norms_(optim::needs_any_sums(p.opt, ps_)) {
    const std::size_t n = ps_.size();
    auto bad = [&](const std::string& why) { return error(errc::invalid_argument, "device::step", -1, -1, why); };
    if (p.weights.size() < n) throw bad("weights hold " + std::to_string(p.weights.size()) + " of the " + std::to_string(n) + " parameters");
    if (p.grads.size() < n) throw bad("gradients hold " + std::to_string(p.grads.size()) + " of the " + std::to_string(n) + " parameters");
    detail::check_momentum(p.opt, p.momentum, "device::step");
    // Coefficients of an optimizer without norms depend on lr only: once, ahead of the all-reduces.
    if (!norms_)
      detail::enqueue_coefficients(p.opt, p.table, ctx_, false, 0, ps_.tensor_count(), p.weights.data(), p.grads.data(), stream());
  }
  const optim::param_set& params() const noexcept { return ps_; }
  bool norms() const noexcept { return norms_; }
  reduce_op reduction() const noexcept {
    return optim::detail::reduction_of(p_.average);
  }
  std::span<float> grads() const noexcept { return p_.grads; }
  void range(std::size_t lo, std::size_t hi) {
    const auto [a, b] = ps_.tensors_in(lo, hi);  // the blocks that hold [lo, hi): those of its tensors
    update(a, b, lo, hi);
  }
  void tensors(std::size_t a, std::size_t b) {
    detail::enqueue_coefficients(p_.opt, p_.table, ctx_, true, a, b, p_.weights.data(), p_.grads.data(), stream());
    update(a, b, ps_[a].offset, ps_[b - 1].offset + ps_[b - 1].size);
  }
  void finish() noexcept {}

 private:
  cudaStream_t stream() const noexcept { return stream_; }  // the group's: the epilogues enqueue there
  void update(std::size_t a, std::size_t b, std::size_t lo, std::size_t hi) {
    detail::enqueue_update(p_.opt, p_.table, a, b, lo, hi, p_.weights.data(), p_.grads.data(), p_.momentum,
                           p_.weights_bf16, stream());
  }

  plan<O> p_;
  const optim::param_set& ps_;
  cudaStream_t stream_;
  optim::step_context ctx_;
  bool norms_;
};

}  // namespace lockstep::device

namespace lockstep::optim {

// The device plan's begin_step: the same bucketed step over the device engine.
template <class Tr, class T, class C, class O>
  requires std::same_as<transport::space_of<Tr>, device::cuda_space>
bucketed_step<Tr, T, C, device::engine<O>> begin_step(group<Tr>& g, const T& topo, C& codec, const device::plan<O>& p,
                                                      std::span<const bucket> buckets, float lr) {
  static_assert(check_optimizer<O>());
  return bucketed_step<Tr, T, C, device::engine<O>>(g, topo, codec, p, buckets, lr);
}

}  // namespace lockstep::optim
