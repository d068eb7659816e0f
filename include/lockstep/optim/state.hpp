// lockstep/optim/state.hpp: what an optimizer keeps between steps, for one param_set on one rank.
//
// The momentum buffer matches the weights element for element (fp32, same offsets, gaps unused).
// The sharded step only reads and writes the rank's own chunk of it, and leaves the rest at zero.
// The scratch vectors are reused by every step so that a step allocates nothing proportional to the
// model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "concept.hpp"
#include "param_set.hpp"

namespace lockstep::optim {

class state {
 public:
  state() = default;
  // The momentum buffer is allocated, zeroed, only when the optimizer uses one.
  template <optimizer O>
  state(const param_set& ps, const O& opt)
      : momentum_(opt.uses_momentum() ? ps.size() : 0, 0.0f),
        block_sums_(ps.block_count()) {}

  std::span<float> momentum() noexcept { return momentum_; }
  std::span<const float> momentum() const noexcept { return momentum_; }
  std::uint64_t steps() const noexcept { return steps_; }  // updates applied so far

  // For the sweeps: per-block sums, sized by the constructor.
  std::span<tensor_sums> block_sums() noexcept { return block_sums_; }
  void count_step() noexcept { ++steps_; }

 private:
  std::vector<float> momentum_;          // (element)
  std::vector<tensor_sums> block_sums_;  // (tensor, block)
  std::uint64_t steps_ = 0;
};

}  // namespace lockstep::optim
