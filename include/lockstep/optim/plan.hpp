// lockstep/optim/plan.hpp: everything a step's update needs, named once, instead of a row of
// positional arguments.
//
//   optim::plan<optim::lars> p{.opt = opt, .params = ps, .st = st, .weights = w, .grads = g};
//   optim::step(g, topology::ring{}, codec, p, lr);                    // one bucket, blocking
//   auto s = optim::begin_step(g, topology::ring{}, codec, p, buckets, lr);   // per bucket (step.hpp)
//
// A plan says *what* is updated and *how the average is taken*; the collective side of a step
// (group, topology, codec, buckets) stays with the call, as it does for all_reduce. A plan holds
// references and spans only, so it is cheap to build every step; everything it names must outlive
// the step that uses it.
//
// The device step takes a plan of the same shape (device::plan, device/step.hpp): `opt` by value
// as here (kernels take it by value), `device::param_table&` where this has `param_set&` and most
// of `state` (the param_set's device twin, with the per-block sums and per-tensor coefficients a
// device sweep needs), a device momentum pointer for `st`'s buffer, device spans for weights,
// grads and the bf16 copy, the group's stream in place of the thread pool, and `average` with the
// same two meanings.
#pragma once

#include <cstdint>
#include <span>

#include "../core/thread_pool.hpp"
#include "concept.hpp"
#include "param_set.hpp"
#include "state.hpp"

namespace lockstep::optim {

// Where the 1/ranks of the gradient average is applied.
enum class averaging {
  // The collective sums; the update multiplies every gradient by grad_scale = 1/ranks inside its
  // element math, which reads each gradient anyway. No extra pass; afterwards grads holds the sum.
  in_update,
  // The collective averages (reduce_op::average: the executor divides its owned chunk by ranks
  // before the gather, and a lossy codec quantises the average); the update uses grad_scale = 1.
  // This is all_reduce(average) followed by optim::update bit for bit; afterwards grads holds the
  // average. x / ranks and x * (1/ranks) differ in the last bit unless ranks is a power of two.
  in_collective,
};

// The gradient multiplier of an update in a group of `ranks` (host and device plans alike).
constexpr float grad_scale(averaging a, int ranks) noexcept {
  return a == averaging::in_update ? 1.0f / static_cast<float>(ranks) : 1.0f;
}

template <class O>
struct plan {
  O opt;                                        // the optimizer policy (a few scalars)
  const param_set& params;                      // the tensors inside the flat buffers
  state& st;                                    // momentum and per-block scratch for `params`
  std::span<float> weights;                     // (element) fp32 master weights, updated in place
  std::span<float> grads;                       // (element) this rank's gradients, reduced in place
  std::span<std::uint16_t> weights_bf16 = {};   // (element) bf16 copy of the new weights, or empty
  thread_pool& pool = thread_pool::shared();    // runs the sweeps' tasks
  averaging average = averaging::in_update;

  // The gradient multiplier of the update in a group of `ranks`.
  float grad_scale(int ranks) const noexcept {
    return optim::grad_scale(average, ranks);
  }
};

}  // namespace lockstep::optim
