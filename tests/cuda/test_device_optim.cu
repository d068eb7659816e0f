// Multi-tensor optimizer steps on the device against the host sweep (optim/update.hpp): SGD in
// every variant bit for bit (same element function, no norms), the bf16 copy of the weights bit
// for bit, and the per-tensor sums of squares (the LARS norms) against fp64 sums taken here,
// through a probe optimizer whose coefficients are the sums themselves.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include <lockstep/device/optim.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/update.hpp>

#include "common.hpp"

using namespace lockstep;

namespace {

// Tensor sizes around the block edges, a few exempt (bias-like) ones among them.
optim::param_set shapes() {
  const std::vector<std::size_t> sizes = {64, 4096, 4097, 9408, 1, 147456, 256, 2359296 / 8, 1000, 12345};
  const std::vector<bool> exempt = {true, false, false, false, true, false, true, false, true, false};
  return optim::param_set::packed(sizes, exempt);
}

// Its coefficients are the tensor's sums; its update writes them into w and v. Pick = 0: (w2, g2),
// Pick = 1: (d2, d2).
template <int Pick>
struct probe {
  float decay = 0.25f;
  struct coeffs {
    double a, b;
  };
  static constexpr std::string_view name() noexcept { return "probe"; }
  constexpr bool uses_momentum() const noexcept { return true; }
  constexpr optim::sum_request sums(bool exempt) const noexcept {
    return exempt ? optim::sum_request{} : optim::sum_request{true, true, true, decay};
  }
  LOCKSTEP_HD constexpr coeffs coefficients(const optim::step_context&, const optim::tensor_sums& s, bool) const noexcept {
    return Pick == 0 ? coeffs{s.w2, s.g2} : coeffs{s.d2, s.d2};
  }
  LOCKSTEP_HD static constexpr void update(const coeffs& k, float& w, float, float& v) noexcept {
    w = static_cast<float>(k.a);
    v = static_cast<float>(k.b);
  }
};

template <class O>
void compare_sgd(const O& opt, optim::step_context ctx) {
  CAPTURE(opt.momentum, opt.weight_decay, opt.nesterov, opt.decay_exempt);
  const optim::param_set ps = shapes();
  const std::size_t n = ps.size();
  auto w = test::inputs(n, 1, false), g = test::inputs(n, 2, false);
  device::stream s;
  device::param_table table(ps, s.get());
  auto dw = test::to_device(w, s.get());
  auto dg = test::to_device(g, s.get());
  device::buffer<float> dv(n, s.get());
  device::buffer<std::uint16_t> dbf(n, s.get());
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dv.data(), 0, n * sizeof(float), s.get()));
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dbf.data(), 0, n * sizeof(std::uint16_t), s.get()));

  optim::state st(ps, opt);
  std::vector<std::uint16_t> bf(n, 0);
  for (int step = 0; step < 3; ++step) {  // three steps: the momentum buffer matters
    optim::update(opt, ps, std::span<float>(w), std::span<const float>(g), st, ctx, std::span<std::uint16_t>(bf));
    device::update_async(opt, table, ctx, dw.data(), dg.data(), dv.data(), s.get(), dbf.data());
  }
  CHECK(test::same_bits(test::to_host(dw.data(), n, s.get()), w));
  CHECK(test::to_host(dbf.data(), n, s.get()) == bf);
  if (opt.uses_momentum()) {
    const auto v = st.momentum();
    CHECK(test::same_bits(test::to_host(dv.data(), n, s.get()), std::vector<float>(v.begin(), v.end())));
  }
}

}  // namespace

TEST_CASE("device SGD equals the host sweep bit for bit in every variant", "[device][optim]") {
  const optim::step_context ctx{0.1f, 0.25f};
  compare_sgd(optim::sgd{}, ctx);
  compare_sgd(optim::sgd{0.9f}, ctx);
  compare_sgd(optim::sgd{0.9f, 1e-4f}, ctx);
  compare_sgd(optim::sgd{0.9f, 1e-4f, true}, ctx);
  compare_sgd(optim::sgd{0.9f, 5e-4f, false, true}, ctx);
}

TEST_CASE("device per-tensor sums of squares match fp64 sums to rounding", "[device][optim]") {
  const optim::param_set ps = shapes();
  const std::size_t n = ps.size();
  const auto w = test::inputs(n, 3, false), g = test::inputs(n, 4, false);
  const float gs = 0.5f, decay = 0.25f;
  device::stream s;
  device::param_table table(ps, s.get());
  auto dg = test::to_device(g, s.get());
  for (int pick = 0; pick < 2; ++pick) {
    auto dw = test::to_device(w, s.get());
    device::buffer<float> dv(n, s.get());
    if (pick == 0) device::update_async(probe<0>{decay}, table, {1.0f, gs}, dw.data(), dg.data(), dv.data(), s.get());
    else device::update_async(probe<1>{decay}, table, {1.0f, gs}, dw.data(), dg.data(), dv.data(), s.get());
    const auto hw = test::to_host(dw.data(), n, s.get()), hv = test::to_host(dv.data(), n, s.get());
    for (std::size_t t = 0; t < ps.tensor_count(); ++t) {
      const auto& d = ps[t];
      if (d.exempt) continue;
      double w2 = 0, g2 = 0, d2 = 0;
      for (std::size_t i = d.offset; i < d.offset + d.size; ++i) {
        w2 += double(w[i]) * w[i];
        g2 += double(gs) * g[i] * double(gs) * g[i];
        const double x = double(gs) * g[i] + double(decay) * w[i];
        d2 += x * x;
      }
      CAPTURE(t, pick);
      const double a = pick == 0 ? w2 : d2, b = pick == 0 ? g2 : d2;
      CHECK(hw[d.offset] == Approx(a).epsilon(1e-6));
      CHECK(hv[d.offset + d.size - 1] == Approx(b).epsilon(1e-6));
    }
  }
}
