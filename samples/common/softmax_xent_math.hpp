// samples/common/softmax_xent_math.hpp: the element math of softmax cross-entropy with label
// smoothing, LOCKSTEP_HD so that the CPU and CUDA backends of the samples share it.
#pragma once

#include <lockstep/core/config.hpp>

#include <cmath>

namespace sample {


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

}  // namespace sample
