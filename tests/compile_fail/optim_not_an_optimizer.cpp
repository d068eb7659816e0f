// Must not compile: a policy without element math passed to optim::update. tests/meson.build checks
// that the compiler's message names the missing piece in a sentence (concept.hpp, check_optimizer).
#include <string_view>
#include <vector>

#include <lockstep/optim/update.hpp>

namespace optim = lockstep::optim;

struct no_update {
  struct coeffs {};
  static constexpr std::string_view name() noexcept { return "no_update"; }
  bool uses_momentum() const noexcept { return false; }
  optim::sum_request sums(bool) const noexcept { return {}; }
  coeffs coefficients(const optim::step_context&, const optim::tensor_sums&, bool) const noexcept { return {}; }
};

int main() {
  const auto ps = optim::param_set::packed(std::vector<std::size_t>{4});
  std::vector<float> w(4), g(4);
  optim::state st;
  optim::update(no_update{}, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = 1});
}
