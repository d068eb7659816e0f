// lockstep/optim/concept.hpp: what an optimizer policy must provide.
//
// An optimizer is split the way the sweep over memory needs it: once per tensor, on the host,
// `coefficients` turns the step's learning rate and the tensor's norms into a few scalars; once per
// element, `update` applies them. The element math is LOCKSTEP_HD, so the CUDA kernels run the
// same function the host loops run.
//
//   O::name()                           short printable name ("sgd", "lars")
//   O::coeffs                           per-tensor scalars, trivially copyable (they are passed to
//                                       kernels by value)
//   o.uses_momentum()                   whether the state must hold a momentum buffer
//   o.sums(exempt)                      which sums of squares over the tensor `coefficients` needs
//                                       (nothing for SGD; ‖w‖², ‖g‖² or ‖g + βw‖² for LARS)
//   o.coefficients(ctx, sums, exempt)   the per-tensor scalars for this step
//   O::update(k, w, g, v)               one element: reads w, g, v, writes w and v (noexcept)
//
// Gradients reach the optimizer as `grad_scale · g`: the fused step all-reduces a sum and folds the
// 1/ranks of the average into the update instead of spending a pass over memory on it.
#pragma once

#include <concepts>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include "../core/config.hpp"

namespace lockstep::optim {

// Which per-tensor sums of squares an update needs before it can touch the tensor's first element.
struct sum_request {
  bool weights = false;        // Σ w²
  bool grads = false;          // Σ (s·g)²
  bool decayed_grads = false;  // Σ (s·g + decay·w)²  (Optax's LARS denominator)
  float decay = 0.0f;          // the β of decayed_grads
  LOCKSTEP_HD constexpr bool any() const noexcept { return weights || grads || decayed_grads; }
};

// Sums over one whole tensor, in fp64; gradients already multiplied by the step's grad_scale.
struct tensor_sums {
  double w2 = 0.0;
  double g2 = 0.0;
  double d2 = 0.0;
  // A tensor's sums are its blocks' added in block order (host sweep and device kernel alike).
  LOCKSTEP_HD constexpr tensor_sums& operator+=(const tensor_sums& b) noexcept {
    w2 += b.w2;
    g2 += b.g2;
    d2 += b.d2;
    return *this;
  }
};

// The sums of blocks [b0, b1), added in block order: a tensor's from its blocks', by the host sweep
// and the device kernel alike, so the order of the additions never depends on who adds.
LOCKSTEP_HD constexpr tensor_sums sum_blocks(const tensor_sums* blocks, std::size_t b0, std::size_t b1) noexcept {
  tensor_sums s;
  for (std::size_t b = b0; b < b1; ++b) s += blocks[b];
  return s;
}

// What one step tells every tensor.
struct step_context {
  float lr = 0.0f;          // this step's learning rate (from a schedule)
  float grad_scale = 1.0f;  // multiplies every gradient: 1 / ranks when the buffer holds a sum
};

template <class O>
concept optimizer =
    std::is_trivially_copyable_v<typename O::coeffs> &&
    requires(const O& o, bool exempt, const step_context& ctx, const tensor_sums& s,
             const typename O::coeffs& k, float& w, float g, float& v) {
      { O::name() } -> std::convertible_to<std::string_view>;
      { o.uses_momentum() } -> std::same_as<bool>;
      { o.sums(exempt) } -> std::same_as<sum_request>;
      { o.coefficients(ctx, s, exempt) } -> std::same_as<typename O::coeffs>;
      { O::update(k, w, g, v) } noexcept;
    };

// Spells out which requirement a type misses: the compiler prints the first failing sentence
// instead of a page of substitution failures. Use as static_assert(check_optimizer<O>()).
template <class O>
consteval bool check_optimizer() {
  static_assert(requires { O::name(); },
                "lockstep::optim: an optimizer needs a static name(), e.g. "
                "static constexpr std::string_view name() { return \"sgd\"; }");
  static_assert(requires { typename O::coeffs; },
                "lockstep::optim: an optimizer needs a nested type `coeffs`: the per-tensor scalars "
                "its element update reads");
  if constexpr (requires { typename O::coeffs; }) {
    static_assert(std::is_trivially_copyable_v<typename O::coeffs>,
                  "lockstep::optim: O::coeffs must be trivially copyable (kernels take it by value)");
    static_assert(requires(const O& o) { { o.uses_momentum() } -> std::same_as<bool>; },
                  "lockstep::optim: an optimizer needs `bool uses_momentum() const`");
    static_assert(requires(const O& o, bool e) { { o.sums(e) } -> std::same_as<sum_request>; },
                  "lockstep::optim: an optimizer needs `sum_request sums(bool exempt) const`: which "
                  "per-tensor norms its update needs");
    static_assert(requires(const O& o, const step_context& c, const tensor_sums& s, bool e) {
                    { o.coefficients(c, s, e) } -> std::same_as<typename O::coeffs>;
                  },
                  "lockstep::optim: an optimizer needs `coeffs coefficients(const step_context&, "
                  "const tensor_sums&, bool exempt) const`");
    static_assert(requires(const typename O::coeffs& k, float& w, float g, float& v) {
                    { O::update(k, w, g, v) } noexcept;
                  },
                  "lockstep::optim: an optimizer needs a static noexcept LOCKSTEP_HD "
                  "`update(const coeffs&, float& w, float g, float& v)`: the element math");
  }
  return optimizer<O>;
}

}  // namespace lockstep::optim
