// Tests for lockstep/optim/schedule.hpp: values at the warmup and decay boundaries, the linear
// scaling rule and the MLPerf ResNet-50 table.
#include <catch2/catch.hpp>

#include <cmath>

#include <lockstep/optim/schedule.hpp>

namespace optim = lockstep::optim;

TEST_CASE("warmup then polynomial decay", "[schedule]") {
  const optim::warmup_poly s{.peak = 10.0, .warmup = 5, .total = 25, .end = 1e-4, .power = 2.0};
  CHECK(s(0) == 0.0);
  CHECK(s(1) == Approx(2.0));
  CHECK(s(2.5) == Approx(5.0));
  CHECK(s(4.999) == Approx(9.998));
  CHECK(s(5) == Approx(10.0));  // the warmup ends at the peak, and the decay starts there
  // Halfway through the decay: (10 − 1e-4)·0.5² + 1e-4.
  CHECK(s(15) == Approx((10.0 - 1e-4) * 0.25 + 1e-4));
  CHECK(s(24) == Approx((10.0 - 1e-4) * 0.0025 + 1e-4));
  CHECK(s(25) == Approx(1e-4));
  CHECK(s(1000) == Approx(1e-4));  // stays at the end value
  const optim::warmup_poly linear{.peak = 1.0, .warmup = 0, .total = 10, .end = 0.0, .power = 1.0};
  CHECK(linear(0) == 1.0);  // no warmup: the peak at once
  CHECK(linear(4) == Approx(0.6));
  CHECK(linear(10) == 0.0);
  // Power 0 (a constant peak, then end): end from total on, not peak for good (found by review).
  const optim::warmup_poly flat{.peak = 2.0, .warmup = 0, .total = 100, .end = 0.5, .power = 0.0};
  CHECK(flat(99) == 2.0);
  CHECK(flat(100) == 0.5);
  CHECK(flat(1000) == 0.5);
}

TEST_CASE("warmup then cosine", "[schedule]") {
  const optim::warmup_cosine s{.peak = 2.0, .warmup = 10, .total = 110, .end = 0.0};
  CHECK(s(0) == 0.0);
  CHECK(s(5) == Approx(1.0));
  CHECK(s(10) == Approx(2.0));
  CHECK(s(60) == Approx(1.0));
  CHECK(s(35) == Approx(1.0 + std::cos(M_PI / 4)));
  CHECK(s(110) == Approx(0.0).margin(1e-12));
  CHECK(s(200) == Approx(0.0).margin(1e-12));
}

TEST_CASE("step decay at its milestones", "[schedule]") {
  const optim::step_decay s{.base = 0.1, .gamma = 0.1, .milestones = {30, 60, 80}};
  CHECK(s(0) == Approx(0.1));
  CHECK(s(29.99) == Approx(0.1));
  CHECK(s(30) == Approx(0.01));
  CHECK(s(59) == Approx(0.01));
  CHECK(s(60) == Approx(0.001));
  CHECK(s(80) == Approx(0.0001));
  CHECK(s(1e6) == Approx(0.0001));
}

TEST_CASE("linear scaling rule", "[schedule]") {
  static_assert(optim::linear_scaling(0.1, 256) == 0.1);
  CHECK(optim::linear_scaling(0.1, 8192) == Approx(3.2));
  CHECK(optim::linear_scaling(0.1, 1024, 512) == Approx(0.2));
}

TEST_CASE("MLPerf ResNet-50 LARS preset", "[schedule]") {
  using P = optim::mlperf_resnet50;
  static_assert(P::peak_lr(8192) == 10.0 && P::warmup_epochs(8192) == 5.0);
  CHECK(P::peak_lr(16383) == 10.0);
  CHECK(P::peak_lr(16384) == 25.0);
  CHECK(P::warmup_epochs(16384) == 5.0);
  CHECK(P::peak_lr(32767) == 25.0);
  CHECK(P::peak_lr(32768) == 31.2);
  CHECK(P::warmup_epochs(32768) == 25.0);
  // Batch 32k on ImageNet: 40 steps per epoch, 72 epochs.
  const auto s = P::schedule(32768, 40, 72);
  CHECK(s.warmup == 1000);
  CHECK(s.total == 2880);
  CHECK(s(500) == Approx(15.6));
  CHECK(s(1000) == Approx(31.2));
  CHECK(s(2880) == Approx(1e-4));
  CHECK(s(1940) == Approx((31.2 - 1e-4) * 0.25 + 1e-4));
  const optim::lars o = P::optimizer();
  CHECK(o.momentum == 0.9f);
  CHECK(o.weight_decay == 1e-4f);
  CHECK(o.trust == 0.001f);
  CHECK(o.denom == optim::lars::denominator::norm_sum);
  CHECK(o.lr_at == optim::lars::lr_placement::inside);
}
