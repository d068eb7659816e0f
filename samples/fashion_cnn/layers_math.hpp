// samples/fashion_cnn/layers_math.hpp: the element math of the sample's own kernels, written once
// for both backends.
//
// Purpose: the oneDNN backend (layers_cpu.hpp) and the cuDNN backend (layers_cuda.cuh) differ in
// who runs convolutions and matrix products, but max pooling, batch norm + ReLU and the loss are
// own kernels on both. Their per-element arithmetic lives here as LOCKSTEP_HD functions, so the CPU
// tests (finite differences, distributed BN against whole-batch BN) cover what the GPU runs, and
// the two backends can only differ in summation order. The merge of batch-norm statistics across a
// group runs on the host for both backends (G (2K + 1) floats).
// Limits: 2x2 max pooling with stride 2 (odd sizes round up); ReLU fused after batch norm.
#pragma once

#include <lockstep/core/config.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace fashion {

// ----------------------------------------------------------------------------------------------
// maxpool2x2

LOCKSTEP_HD inline int pooled(int n) { return (n + 1) / 2; }

// Output cell (oy, ox) of one H x W plane: the largest of the (up to) four cells of its window,
// the first in row-major order on ties; `which` (0..3) says which one won.
LOCKSTEP_HD inline float maxpool_cell(const float* plane, int H, int W, int oy, int ox, std::uint8_t* which) {
  float best = plane[(2 * oy) * W + 2 * ox];
  std::uint8_t w = 0;
  for (std::uint8_t k = 1; k < 4; ++k) {
    const int iy = 2 * oy + (k >> 1), ix = 2 * ox + (k & 1);
    if (iy < H && ix < W && plane[iy * W + ix] > best) best = plane[iy * W + ix], w = k;
  }
  *which = w;
  return best;
}

// One byte per output cell: which of the four won (0..3), kept for the backward pass.
inline std::size_t maxpool_workspace_bytes(int B, int C, int H, int W) {
  return static_cast<std::size_t>(B) * C * pooled(H) * pooled(W);
}

// Where in its H x W plane the winner of output cell (oy, ox) was: its gradient goes there.
LOCKSTEP_HD inline int maxpool_source(int W, int oy, int ox, int which) {
  return (2 * oy + (which >> 1)) * W + 2 * ox + (which & 1);
}

// ----------------------------------------------------------------------------------------------
// batch norm + ReLU. With a = gamma rstd and c = beta - mean a, the forward is max(0, x a + c);
// the backward needs dy (the gradient before the ReLU), xhat = (x - mean) rstd and the group's
// means of dy and dy xhat:  dx = a (dy - mean(dy) - xhat mean(dy xhat)).

struct bn_affine {
  float a, c;
};

LOCKSTEP_HD inline bn_affine bn_fold(float gamma, float beta, float mean, float rstd) {
  const float a = gamma * rstd;
  return {a, beta - mean * a};
}

LOCKSTEP_HD inline float bn_relu(float x, bn_affine f) {
  const float y = x * f.a + f.c;
  return y > 0.0f ? y : 0.0f;
}

// The gradient before the ReLU, from the one after it.
LOCKSTEP_HD inline float bn_relu_dy(float x, float g, bn_affine f) { return x * f.a + f.c > 0.0f ? g : 0.0f; }

LOCKSTEP_HD inline float bn_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

LOCKSTEP_HD inline float bn_relu_dx(float x, float g, bn_affine f, float mean, float rstd, float mean_dy,
                                    float mean_dyx) {
  return f.a * (bn_relu_dy(x, g, f) - mean_dy - bn_xhat(x, mean, rstd) * mean_dyx);
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

// ----------------------------------------------------------------------------------------------
// softmax cross-entropy with label smoothing: the target is q = (1 - s) onehot(label) + s / NC.

LOCKSTEP_HD inline float xent_target(int c, int label, int NC, float smoothing) {
  return smoothing / NC + (c == label ? 1.0f - smoothing : 0.0f);
}

// One row: writes p = softmax(z) and the index of the largest logit (the first on ties), returns
// -sum_c q_c log p_c. In double, so that the loss of a confident model is not rounded to zero.
LOCKSTEP_HD inline double xent_row(float* p, int* argmax, const float* z, int label, int NC, float smoothing) {
  int best = 0;
  for (int c = 1; c < NC; ++c)
    if (z[c] > z[best]) best = c;
  const float zmax = z[best];
  double sum = 0;
  for (int c = 0; c < NC; ++c) sum += exp(static_cast<double>(z[c] - zmax));
  const double log_sum = log(sum);
  double loss = 0;
  for (int c = 0; c < NC; ++c) {
    const double logp = z[c] - zmax - log_sum;
    p[c] = static_cast<float>(exp(logp));
    // the target in double here (the loss is reported), in float in the gradient (xent_grad)
    const double q = smoothing / NC + (c == label ? 1.0 - smoothing : 0.0);
    loss -= q * logp;
  }
  *argmax = best;
  return loss;
}

// d loss / d z_c for a loss that is the mean over B rows (scale = 1 / B).
LOCKSTEP_HD inline float xent_grad(float p, int c, int label, int NC, float smoothing, float scale) {
  return (p - xent_target(c, label, NC, smoothing)) * scale;
}

}  // namespace fashion
