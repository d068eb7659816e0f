// Tests for lockstep/optim/concept.hpp: what is and is not an optimizer, and that a user-written
// policy runs through the same sweep as the built-in ones.
#include <catch2/catch.hpp>

#include <string_view>
#include <vector>

#include <lockstep/optim/concept.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/update.hpp>

namespace optim = lockstep::optim;

namespace {

// A policy written outside the library: sign descent scaled by the tensor's RMS weight, which needs
// Σw² (so the sweep must compute norms for it).
struct sign_rms {
  struct coeffs {
    float step;
  };
  static constexpr std::string_view name() noexcept { return "sign_rms"; }
  constexpr bool uses_momentum() const noexcept { return false; }
  constexpr optim::sum_request sums(bool) const noexcept { return {.weights = true}; }
  coeffs coefficients(const optim::step_context& c, const optim::tensor_sums& s, bool) const noexcept {
    return {static_cast<float>(c.lr * (s.w2 > 0 ? 1.0 : 0.0))};
  }
  LOCKSTEP_HD static constexpr void update(const coeffs& k, float& w, float g, float&) noexcept {
    w -= g > 0 ? k.step : (g < 0 ? -k.step : 0.0f);
  }
};

struct no_update {  // everything but the element math
  struct coeffs {};
  static constexpr std::string_view name() noexcept { return "x"; }
  bool uses_momentum() const noexcept { return false; }
  optim::sum_request sums(bool) const noexcept { return {}; }
  coeffs coefficients(const optim::step_context&, const optim::tensor_sums&, bool) const noexcept { return {}; }
};

struct throwing_update : no_update {  // element math that may throw cannot run in a kernel
  static void update(const coeffs&, float&, float, float&) {}
};

struct non_trivial_coeffs : no_update {
  struct coeffs {
    std::vector<float> v;
  };
  coeffs coefficients(const optim::step_context&, const optim::tensor_sums&, bool) const { return {}; }
  static void update(const coeffs&, float&, float, float&) noexcept {}
};

}  // namespace

static_assert(optim::optimizer<optim::sgd>);
static_assert(optim::optimizer<optim::lars>);
static_assert(optim::optimizer<sign_rms>);
static_assert(!optim::optimizer<no_update>);
static_assert(!optim::optimizer<throwing_update>);
static_assert(!optim::optimizer<non_trivial_coeffs>);
static_assert(!optim::optimizer<int>);

TEST_CASE("a user-written optimizer runs through the sweep, norms included", "[optim_concept]") {
  const auto ps = optim::param_set::packed(std::vector<std::size_t>{5, 3}, {}, 1, {.block = 2});
  std::vector<float> w{1, 2, 3, 4, 5, 0, 0, 0};  // the second tensor has ‖w‖ = 0: step 0
  const std::vector<float> g{1, -1, 0, 2, -3, 1, -1, 1};
  optim::state st(ps, sign_rms{});
  CHECK(st.momentum().empty());
  optim::update(sign_rms{}, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = 0.5f});
  CHECK(w == std::vector<float>{0.5f, 2.5f, 3.0f, 3.5f, 5.5f, 0, 0, 0});
}
