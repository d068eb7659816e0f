// lockstep/optim/lars.hpp: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017), the
// optimizer of ResNet-50 at batch 32k (Ying et al. 2018, MLPerf).
//
// Per tensor, with η = trust, β = weight_decay, m = momentum, s = grad_scale:
//   λ = η‖w‖ / (‖s·g‖ + β‖w‖ + ε)            denominator::norm_sum (TF / MLPerf, default)
//   λ = η‖w‖ / (‖s·g + β·w‖ + ε)             denominator::decayed_norm (Optax)
//   λ = 1 when ‖w‖ = 0 or the gradient norm of the denominator is 0
//   d = s·g + β·w
//   lr_placement::inside (TF / MLPerf, default):  v ← m·v + lr·λ·d;  w ← w − (nesterov ? m·v + lr·λ·d : v)
//   lr_placement::outside (torch LARC):           v ← m·v + λ·d;     w ← w − lr·(nesterov ? m·v + λ·d : v)
// The two placements agree while lr is constant and differ when it changes: inside, the buffer
// remembers past learning rates; outside, a new lr rescales the whole buffer at once.
// Exempt tensors (biases, batch-norm γ and β) get λ = 1 and β = 0: plain momentum SGD.
#pragma once

#include <cmath>
#include <string_view>

#include "../core/config.hpp"
#include "concept.hpp"

namespace lockstep::optim {

struct lars {
  enum class denominator { norm_sum, decayed_norm };
  enum class lr_placement { inside, outside };

  float momentum = 0.9f;
  float weight_decay = 1e-4f;
  float trust = 0.001f;  // η
  float epsilon = 0.0f;
  bool nesterov = false;
  denominator denom = denominator::norm_sum;
  lr_placement lr_at = lr_placement::inside;

  struct coeffs {
    float scale;       // multiplies d into the buffer: lr·λ (inside) or λ (outside)
    float lr_outer;    // multiplies the buffer into w: 1 (inside) or lr (outside)
    float grad_scale;
    float momentum;
    float decay;
    bool nesterov;
  };

  static constexpr std::string_view name() noexcept { return "lars"; }
  LOCKSTEP_HD constexpr bool uses_momentum() const noexcept { return momentum != 0.0f; }

  LOCKSTEP_HD constexpr sum_request sums(bool exempt) const noexcept {
    if (exempt) return {};
    if (denom == denominator::decayed_norm) return {true, false, true, weight_decay};
    return {true, true, false, 0.0f};
  }

  // λ from the tensor's sums; fp64 so that the ratio adds no rounding of its own. LOCKSTEP_HD: the
  // device sweep computes coefficients on the GPU with this same function.
  LOCKSTEP_HD double trust_ratio(const tensor_sums& s) const noexcept {
    const double wn = std::sqrt(s.w2);
    const double gn = std::sqrt(denom == denominator::decayed_norm ? s.d2 : s.g2);
    if (wn == 0.0 || gn == 0.0) return 1.0;
    const double den = denom == denominator::decayed_norm ? gn + double(epsilon)
                                                          : gn + double(weight_decay) * wn + double(epsilon);
    return double(trust) * wn / den;
  }

  LOCKSTEP_HD coeffs coefficients(const step_context& c, const tensor_sums& s, bool exempt) const noexcept {
    const double lambda = exempt ? 1.0 : trust_ratio(s);
    const float decay = exempt ? 0.0f : weight_decay;
    if (lr_at == lr_placement::inside)
      return {static_cast<float>(double(c.lr) * lambda), 1.0f, c.grad_scale, momentum, decay, nesterov};
    return {static_cast<float>(lambda), c.lr, c.grad_scale, momentum, decay, nesterov};
  }

  // The element math; lr_outer = 1 makes the last product exact, so one body serves both placements.
  LOCKSTEP_HD static constexpr void update(const coeffs& k, float& w, float g, float& v) noexcept {
    const float d = k.grad_scale * g + k.decay * w;
    const float step = k.scale * d;
    float u = step;
    if (k.momentum != 0.0f) {
      v = k.momentum * v + step;
      u = k.nesterov ? k.momentum * v + step : v;
    }
    w = w - k.lr_outer * u;
  }
};

static_assert(check_optimizer<lars>());

}  // namespace lockstep::optim
