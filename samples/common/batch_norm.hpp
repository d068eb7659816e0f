// samples/common/batch_norm.hpp: batch norm whose statistics span a group of G replicas (Ying et
// al. 2018, sec. 3.3), the part both sample models share: the element math (LOCKSTEP_HD, so the
// CUDA backends run the same arithmetic), the group a replica normalises with, and the merge of
// the group's statistics (host code, G (2K + 1) floats).
//
// Forward: each replica computes its per-channel (n, mean, M2), the group gathers them and every
// replica merges them in rank order (bn_merge_stats), so all replicas of a group hold bit-identical
// statistics. Backward: the group sums the per-channel sum(dy) and sum(dy * xhat) (2K floats), and
//   dx = gamma rstd (dy - sum(dy) / n - xhat sum(dy * xhat) / n)
// with n and the sums over the group. G = 1 is plain batch norm.
#pragma once

#include <lockstep/core/config.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <span>
#include <vector>

namespace sample {

// With a = gamma rstd and c = beta - mean a, the forward is max(0, x a + c) (or x a + c without the
// ReLU); the backward needs dy (the gradient before the ReLU), xhat = (x - mean) rstd and the group's
// means of dy and dy xhat:  dx = a (dy - mean(dy) - xhat mean(dy xhat)).

struct bn_affine {
  float a, c;
};

LOCKSTEP_HD inline bn_affine bn_fold(float gamma, float beta, float mean, float rstd) {
  const float a = gamma * rstd;
  return {a, beta - mean * a};
}

// relu says whether the ReLU follows (ResNet-50 has batch norms without it); bn_relu, bn_relu_dy and
// bn_relu_dx are the same functions with it, the same arithmetic to the bit.
LOCKSTEP_HD inline float bn_apply(float x, bn_affine f, bool relu) {
  const float y = x * f.a + f.c;
  return relu ? (y > 0.0f ? y : 0.0f) : y;
}
LOCKSTEP_HD inline float bn_relu(float x, bn_affine f) { return bn_apply(x, f, true); }

// dy, the gradient before the ReLU, from g, the one after it (g itself without the ReLU).
LOCKSTEP_HD inline float bn_dy(float x, float g, bn_affine f, bool relu) {
  return !relu || x * f.a + f.c > 0.0f ? g : 0.0f;
}
LOCKSTEP_HD inline float bn_relu_dy(float x, float g, bn_affine f) { return bn_dy(x, g, f, true); }

LOCKSTEP_HD inline float bn_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

// dx = a (dy - mean(dy) - xhat mean(dy xhat)), the means over the group.
LOCKSTEP_HD inline float bn_dx(float x, float g, bn_affine f, float mean, float rstd, float mean_dy, float mean_dyx,
                               bool relu) {
  return f.a * (bn_dy(x, g, f, relu) - mean_dy - bn_xhat(x, mean, rstd) * mean_dyx);
}
LOCKSTEP_HD inline float bn_relu_dx(float x, float g, bn_affine f, float mean, float rstd, float mean_dy,
                                    float mean_dyx) {
  return bn_dx(x, g, f, mean, rstd, mean_dy, mean_dyx, true);
}

// The group a replica normalises with: how to gather and how to sum across it. size 1 with empty
// functions is local batch norm.
struct bn_group {
  int size = 1;
  std::function<void(std::span<const float> mine, std::span<float> all)> all_gather;  // all: (G, mine.size())
  std::function<void(std::span<float> values)> sum;                                   // in place, over the group
};

// The group's statistics from each replica's (n, mean[K], M2[K]) (`all`: G rows of 2K + 1 floats,
// in rank order), merged in rank order with Chan's formula
//   n = na + nb,  d = mean_b - mean_a,  mean = mean_a + d nb / n,  M2 = M2a + M2b + d^2 na nb / n
// so every replica of a group gets bit-identical results. Writes mean, rstd, the group's count and
// updates the running statistics (the running variance is the unbiased one, as torch keeps it).
// Host code, shared by both backends.
inline void bn_merge_stats(float* mean, float* rstd, float* count, float* running_mean, float* running_var,
                           std::span<const float> all, int G, int K, float momentum, float eps) {
  const std::size_t row = 1 + 2 * static_cast<std::size_t>(K);
  double n = all[0];
  std::vector<double> mu(all.begin() + 1, all.begin() + 1 + K), M2(all.begin() + 1 + K, all.begin() + row);
  for (int g = 1; g < G; ++g) {
    const float* r = all.data() + static_cast<std::size_t>(g) * row;
    const double nb = r[0], nab = n + nb;
    for (int k = 0; k < K; ++k) {
      const double d = r[1 + k] - mu[k];
      mu[k] += d * nb / nab;
      M2[k] += r[1 + K + k] + d * d * n * nb / nab;
    }
    n = nab;
  }
  *count = static_cast<float>(n);
  for (int k = 0; k < K; ++k) {
    mean[k] = static_cast<float>(mu[k]);
    rstd[k] = static_cast<float>(1.0 / std::sqrt(M2[k] / n + eps));
    running_mean[k] = (1 - momentum) * running_mean[k] + momentum * mean[k];
    running_var[k] = (1 - momentum) * running_var[k] + momentum * static_cast<float>(M2[k] / std::max(n - 1, 1.0));
  }
}

}  // namespace sample
