// lockstep/optim/schedule.hpp: learning-rate schedules, the linear scaling rule and the MLPerf
// ResNet-50 LARS preset.
//
// A schedule is a value callable as lr(t), t in steps (fractions allowed, so epochs work as well
// when every length is given in epochs). They compute in fp64 and are plain data: print them, copy
// them to every rank, and every rank gets the same learning rate.
//
//   warmup_poly   lr = peak·t/W                                 for t < W (W = warmup)
//                 lr = (peak − end)·(1 − (t − W)/(T − W))^p + end  for W ≤ t ≤ T, end after T
//   warmup_cosine lr = peak·t/W, then end + (peak − end)·½(1 + cos(π·(t − W)/(T − W))), end after T
//   step_decay    lr = base·γ^k, k = number of milestones ≤ t (torch's MultiStepLR)
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <vector>

#include "lars.hpp"

namespace lockstep::optim {

template <class S>
concept lr_schedule = requires(const S& s, double t) {
  { s(t) } -> std::convertible_to<double>;
};

namespace detail {
// Linear warmup from 0, shared by the schedules below: lr(0) = 0, lr(W) = peak.
constexpr double warmup_ramp(double peak, double warmup, double t) noexcept { return peak * t / warmup; }
}  // namespace detail

// Linear warmup, then polynomial decay from peak to end over [warmup, total]. power 2 and
// end 1e-4 are MLPerf's (TF's polynomial_decay); power 1 is a linear decay.
struct warmup_poly {
  double peak = 0.1;
  double warmup = 0;  // steps; 0 = no warmup
  double total = 1;   // steps; the decay reaches `end` here and stays
  double end = 0.0;
  double power = 2.0;

  double operator()(double t) const noexcept {
    if (t < warmup) return detail::warmup_ramp(peak, warmup, t);
    const double span = total - warmup;
    // From total on, end, whatever the power (power 0 would otherwise hold peak for good).
    if (span <= 0 || t >= total) return end;
    const double frac = std::clamp((t - warmup) / span, 0.0, 1.0);
    return (peak - end) * std::pow(1.0 - frac, power) + end;
  }
};

// Linear warmup, then half a cosine from peak to end over [warmup, total].
struct warmup_cosine {
  double peak = 0.1;
  double warmup = 0;
  double total = 1;
  double end = 0.0;

  double operator()(double t) const noexcept {
    if (t < warmup) return detail::warmup_ramp(peak, warmup, t);
    const double span = total - warmup;
    // From total on, end (the same as the cosine gives there; said once, as warmup_poly says it).
    if (span <= 0 || t >= total) return end;
    const double frac = std::clamp((t - warmup) / span, 0.0, 1.0);
    return end + (peak - end) * 0.5 * (1.0 + std::cos(std::numbers::pi * frac));
  }
};

// base·γ^k where k counts the milestones already reached (t ≥ milestone), milestones ascending.
struct step_decay {
  double base = 0.1;
  double gamma = 0.1;
  std::vector<double> milestones;

  double operator()(double t) const noexcept {
    const auto k = std::upper_bound(milestones.begin(), milestones.end(), t) - milestones.begin();
    return base * std::pow(gamma, static_cast<double>(k));
  }
};

// The linear scaling rule (Goyal et al. 2017): the learning rate grows with the global batch.
constexpr double linear_scaling(double base_lr, double batch, double reference_batch = 256) noexcept {
  return base_lr * batch / reference_batch;
}

static_assert(lr_schedule<warmup_poly> && lr_schedule<warmup_cosine> && lr_schedule<step_decay>);

// The MLPerf ResNet-50 LARS recipe (TF reference, lars_util.py): peak LR and warmup epochs chosen
// by the global batch, polynomial decay of power 2 to 1e-4, LARS with m = 0.9, β = 1e-4, η = 0.001.
struct mlperf_resnet50 {
  //   batch      peak   warmup epochs
  //   < 16k      10.0    5
  //   < 32k      25.0    5
  //   ≥ 32k      31.2   25
  static constexpr double peak_lr(std::int64_t batch) noexcept {
    return batch < 16384 ? 10.0 : batch < 32768 ? 25.0 : 31.2;
  }
  static constexpr double warmup_epochs(std::int64_t batch) noexcept {
    return batch < 32768 ? 5.0 : 25.0;
  }
  static constexpr double end_lr = 1e-4;
  static constexpr double label_smoothing = 0.1;

  // The schedule in steps: steps_per_epoch = ceil(1281167 / batch) for ImageNet.
  static warmup_poly schedule(std::int64_t batch, double steps_per_epoch, double train_epochs) noexcept {
    return {peak_lr(batch), warmup_epochs(batch) * steps_per_epoch, train_epochs * steps_per_epoch, end_lr, 2.0};
  }
  static constexpr lars optimizer() noexcept { return lars{}; }  // lars's defaults are MLPerf's
};

}  // namespace lockstep::optim
