// Tests for lockstep/optim/sgd.hpp: torch.optim.SGD's results (golden/sgd_golden.inc, regenerated
// by golden/gen_sgd.py) for momentum, Nesterov and weight decay, run through the multi-tensor sweep
// over a padded flat buffer; the element math on its own; the exempt option.
#include <catch2/catch.hpp>

#include <cmath>
#include <algorithm>
#include <vector>

#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/update.hpp>

#include "golden/sgd_golden.inc"

namespace optim = lockstep::optim;

namespace {

// Error relative to the size of the values involved (about 1 here); a cancellation that leaves a
// tiny result does not inflate it the way a count of units in the last place would.
double err(float a, float b) { return std::fabs(double(a) - double(b)) / std::max(1.0, std::fabs(double(b))); }

constexpr float gap_marker = 12345.0f;  // padding between tensors must never be written

}  // namespace

TEST_CASE("SGD matches torch.optim.SGD over three steps", "[sgd][golden]") {
  using namespace sgd_golden;
  const std::vector<std::size_t> sz(std::begin(sizes), std::end(sizes));
  // Small tasks so that tensors are cut into several pieces.
  const auto ps = optim::param_set::packed(sz, {}, 16, {.block = 8, .task = 10, .wave = 40});
  REQUIRE(ps.size() > total);  // the layout has gaps

  for (const golden_case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      const optim::sgd opt{.momentum = c.momentum, .weight_decay = c.weight_decay, .nesterov = c.nesterov};
      optim::state st(ps, opt);
      std::vector<float> w(ps.size(), gap_marker), g(ps.size(), gap_marker);
      auto scatter = [&](const float* flat, std::vector<float>& out) {
        std::size_t k = 0;
        for (const auto& t : ps.tensors())
          for (std::size_t i = 0; i < t.size; ++i) out[t.offset + i] = flat[k++];
      };
      scatter(w0, w);
      lockstep::thread_pool pool(3);
      double worst_w = 0, worst_v = 0;
      for (int s = 0; s < steps; ++s) {
        scatter(grads[s], g);
        optim::update(opt, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = lr[s]}, {}, pool);
        std::size_t k = 0;
        for (const auto& t : ps.tensors())
          for (std::size_t i = 0; i < t.size; ++i, ++k) {
            worst_w = std::max(worst_w, err(w[t.offset + i], c.w[s][k]));
            if (c.momentum != 0.0f) worst_v = std::max(worst_v, err(st.momentum()[t.offset + i], c.v[s][k]));
          }
      }
      // torch rounds w − lr·d and g + β·w once (FMA) and m·v + d twice; lockstep leaves the choice
      // to the compiler (GCC contracts all three where the ISA has FMA). That is a few fp32
      // roundings apart over three steps; a wrong formula is off by 1e-3 or more.
      INFO("worst relative error: w " << worst_w << ", v " << worst_v);
      CHECK(worst_w <= 1e-6);
      CHECK(worst_v <= 1e-6);
      for (std::size_t i = 0; i < ps.size(); ++i) {
        bool inside = false;
        for (const auto& t : ps.tensors()) inside = inside || (i >= t.offset && i < t.offset + t.size);
        if (!inside) REQUIRE(w[i] == gap_marker);
      }
      CHECK(st.steps() == steps);
      if (c.momentum == 0.0f) CHECK(st.momentum().empty());
    }
  }
}

TEST_CASE("SGD element math follows the formula", "[sgd]") {
  // d = 0.5·2 + 0.1·1 = 1.1; v = 0.9·0.5 + 1.1 = 1.55; w = 1 − 0.1·1.55 = 0.845.
  optim::sgd::coeffs k{.lr = 0.1f, .grad_scale = 0.5f, .momentum = 0.9f, .decay = 0.1f, .nesterov = false};
  float w = 1.0f, v = 0.5f;
  optim::sgd::update(k, w, 2.0f, v);
  CHECK(v == Approx(1.55f));
  CHECK(w == Approx(0.845f));
  // Nesterov: w = 1 − 0.1·(1.1 + 0.9·1.55) = 0.7505.
  k.nesterov = true;
  w = 1.0f;
  v = 0.5f;
  optim::sgd::update(k, w, 2.0f, v);
  CHECK(v == Approx(1.55f));
  CHECK(w == Approx(0.7505f));
  // No momentum: v is not touched.
  k.momentum = 0.0f;
  w = 1.0f;
  v = 42.0f;
  optim::sgd::update(k, w, 2.0f, v);
  CHECK(v == 42.0f);
  CHECK(w == Approx(1.0f - 0.1f * 1.1f));
}

TEST_CASE("SGD decay_exempt drops weight decay on exempt tensors only", "[sgd]") {
  const std::vector<std::size_t> sz{100, 30};
  const auto ps = optim::param_set::packed(sz, {}, 1);  // no flags: nothing exempt
  const auto ps_ex = optim::param_set::packed(sz, {false, true}, 1);
  std::vector<float> w0(ps.size()), g(ps.size());
  for (std::size_t i = 0; i < w0.size(); ++i) {
    w0[i] = std::sin(0.3f * float(i));
    g[i] = std::cos(0.7f * float(i));
  }
  const optim::sgd decays{.momentum = 0.9f, .weight_decay = 0.1f, .decay_exempt = true};
  const optim::sgd no_decay{.momentum = 0.9f, .weight_decay = 0.0f};
  std::vector<float> a = w0, b = w0, c = w0;
  optim::state sa(ps_ex, decays), sb(ps_ex, no_decay), sc(ps, decays);
  optim::update(decays, ps_ex, std::span<float>(a), std::span<const float>(g), sa, {.lr = 0.1f});
  optim::update(no_decay, ps_ex, std::span<float>(b), std::span<const float>(g), sb, {.lr = 0.1f});
  optim::update(decays, ps, std::span<float>(c), std::span<const float>(g), sc, {.lr = 0.1f});
  for (std::size_t i = 100; i < 130; ++i) REQUIRE(a[i] == b[i]);  // exempt: as if β = 0
  for (std::size_t i = 100; i < 130; ++i) REQUIRE(c[i] != b[i]);  // without the flag β applies
  for (std::size_t i = 0; i < 100; ++i) REQUIRE(a[i] == c[i]);    // the other tensor decays
}
