// lockstep/optim/sgd.hpp: stochastic gradient descent with momentum, as torch.optim.SGD computes it.
//
//   d ← s·g + β·w                      (β: weight_decay, s: grad_scale)
//   v ← m·v + d                        (m: momentum; no buffer when m = 0)
//   w ← w − lr·(nesterov ? d + m·v : v)
//
// torch's dampening is not offered (it is 0 in every recipe lockstep targets). torch starts the
// buffer as a copy of d on the first step; a zero buffer gives the same m·0 + d.
// decay_exempt = true drops weight decay on tensors flagged exempt (biases, batch-norm γ/β) as many
// ResNet recipes do; the default false is torch's, where one parameter group decays everything.
#pragma once

#include <string_view>

#include "../core/config.hpp"
#include "concept.hpp"

namespace lockstep::optim {

struct sgd {
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool decay_exempt = false;  // exempt tensors get no weight decay

  struct coeffs {
    float lr;
    float grad_scale;
    float momentum;
    float decay;
    bool nesterov;
  };

  static constexpr std::string_view name() noexcept { return "sgd"; }
  LOCKSTEP_HD constexpr bool uses_momentum() const noexcept { return momentum != 0.0f; }
  LOCKSTEP_HD constexpr sum_request sums(bool) const noexcept { return {}; }

  LOCKSTEP_HD constexpr coeffs coefficients(const step_context& c, const tensor_sums&, bool exempt) const noexcept {
    return {c.lr, c.grad_scale, momentum, (decay_exempt && exempt) ? 0.0f : weight_decay, nesterov};
  }

  // The element math. Without momentum v is neither read nor written.
  LOCKSTEP_HD static constexpr void update(const coeffs& k, float& w, float g, float& v) noexcept {
    float d = k.grad_scale * g + k.decay * w;
    if (k.momentum != 0.0f) {
      v = k.momentum * v + d;
      d = k.nesterov ? d + k.momentum * v : v;
    }
    w = w - k.lr * d;
  }
};

static_assert(check_optimizer<sgd>());

}  // namespace lockstep::optim
