// Tests for lockstep/optim/update.hpp: the multi-tensor sweep around the element math — the bf16
// copy, independence from threads and task sizes, grad_scale, and the checks on buffers and state.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <vector>

#include <lockstep/codec/bf16.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/update.hpp>

namespace optim = lockstep::optim;

namespace {

const std::vector<std::size_t> sizes{1000, 3, 64, 4097, 17, 250};
const std::vector<bool> exempt{false, true, false, false, true, false};

struct buffers {
  std::vector<float> w, g;
  explicit buffers(std::size_t n) : w(n, -7.0f), g(n, -7.0f) {
    for (std::size_t i = 0; i < n; ++i) {
      w[i] = std::sin(0.013f * float(i)) + 0.1f;
      g[i] = std::cos(0.29f * float(i)) * 0.01f;
    }
  }
};

template <class O>
std::vector<float> run(const O& opt, optim::sweep_policy pol, unsigned threads, int steps = 3) {
  const auto ps = optim::param_set::packed(sizes, exempt, 16, pol);
  buffers b(ps.size());
  optim::state st(ps, opt);
  lockstep::thread_pool pool(threads);
  for (int s = 0; s < steps; ++s)
    optim::update(opt, ps, std::span<float>(b.w), std::span<const float>(b.g), st, {.lr = 0.5f}, {}, pool);
  return b.w;
}

}  // namespace

TEST_CASE("the sweep gives the same bits for any threads, tasks and waves", "[update]") {
  const optim::sgd sgd{.momentum = 0.9f, .weight_decay = 1e-3f, .nesterov = true};
  const auto a = run(sgd, {.block = 4096, .task = 1 << 16, .wave = 1 << 19}, 1);
  CHECK(a == run(sgd, {.block = 4096, .task = 5, .wave = 100}, 4));
  CHECK(a == run(sgd, {.block = 4096, .task = 333, .wave = 100}, 2));
  const optim::lars lars{};
  const auto b = run(lars, {.block = 256, .task = 1 << 16, .wave = 1 << 19}, 1);
  CHECK(b == run(lars, {.block = 256, .task = 5, .wave = 100}, 4));
  // Another block size sums the norms in another order: equal to fp32 rounding, not bitwise.
  const auto c = run(lars, {.block = 64, .task = 1 << 16, .wave = 1 << 19}, 1);
  for (std::size_t i = 0; i < b.size(); ++i) REQUIRE(c[i] == Approx(b[i]).epsilon(1e-6));
}

TEST_CASE("the bf16 copy is the rounded new weights, written in the same sweep", "[update]") {
  const auto ps = optim::param_set::packed(sizes, exempt, 16);
  for (int which = 0; which < 2; ++which) {
    buffers b(ps.size());
    std::vector<std::uint16_t> bf(ps.size(), 0xdead);
    const optim::sgd sgd{.momentum = 0.9f};
    const optim::lars lars{};
    optim::state st = which ? optim::state(ps, lars) : optim::state(ps, sgd);
    if (which) optim::update(lars, ps, std::span<float>(b.w), std::span<const float>(b.g), st, {.lr = 3.0f}, bf);
    else optim::update(sgd, ps, std::span<float>(b.w), std::span<const float>(b.g), st, {.lr = 0.1f}, bf);
    for (const auto& t : ps.tensors())
      for (std::size_t i = t.offset; i < t.offset + t.size; ++i)
        REQUIRE(bf[i] == lockstep::codec::bf16_from_bits(std::bit_cast<std::uint32_t>(b.w[i])));
    CHECK(bf[ps[0].size] == 0xdead);  // padding after the first tensor is not written
  }
}

TEST_CASE("grad_scale multiplies every gradient", "[update]") {
  const auto ps = optim::param_set::packed(sizes, exempt, 16);
  for (int which = 0; which < 2; ++which) {
    buffers a(ps.size()), b(ps.size());
    for (float& x : b.g) x *= 0.25f;  // exact: a power of two
    const optim::sgd sgd{.momentum = 0.9f, .weight_decay = 1e-2f};
    const optim::lars lars{.denom = optim::lars::denominator::decayed_norm};
    auto step = [&](buffers& x, float scale) {
      optim::state st = which ? optim::state(ps, lars) : optim::state(ps, sgd);
      for (int s = 0; s < 2; ++s) {
        if (which) optim::update(lars, ps, std::span<float>(x.w), std::span<const float>(x.g), st, {.lr = 2.0f, .grad_scale = scale});
        else optim::update(sgd, ps, std::span<float>(x.w), std::span<const float>(x.g), st, {.lr = 2.0f, .grad_scale = scale});
      }
    };
    step(a, 0.25f);
    step(b, 1.0f);
    CHECK(a.w == b.w);
  }
}

TEST_CASE("buffers and state that do not fit the param_set are rejected", "[update]") {
  const auto ps = optim::param_set::packed(sizes, exempt, 16);
  const optim::sgd sgd{.momentum = 0.9f};
  buffers b(ps.size());
  std::vector<float> small(ps.size() - 1);
  optim::state st(ps, sgd);
  CHECK_THROWS_WITH(optim::update(sgd, ps, std::span<float>(small), std::span<const float>(b.g), st, {.lr = 1}),
                    Catch::Contains("weights hold"));
  CHECK_THROWS_WITH(optim::update(sgd, ps, std::span<float>(b.w), std::span<const float>(small), st, {.lr = 1}),
                    Catch::Contains("gradients hold"));
  std::vector<std::uint16_t> bf(3);
  CHECK_THROWS_WITH(optim::update(sgd, ps, std::span<float>(b.w), std::span<const float>(b.g), st, {.lr = 1}, bf),
                    Catch::Contains("bf16 copy"));
  optim::state no_momentum(ps, optim::sgd{});
  CHECK_THROWS_WITH(optim::update(sgd, ps, std::span<float>(b.w), std::span<const float>(b.g), no_momentum, {.lr = 1}),
                    Catch::Contains("no momentum buffer"));
  const auto other = optim::param_set::packed(std::vector<std::size_t>{ps.size()}, {}, 16);
  optim::state wrong(other, sgd);
  CHECK_THROWS_WITH(optim::update(sgd, ps, std::span<float>(b.w), std::span<const float>(b.g), wrong, {.lr = 1}),
                    Catch::Contains("another param_set"));
}
