// samples/common/softmax_xent.hpp: softmax cross-entropy with label smoothing over a batch on the
// CPU, and the top-k hits the trainers report (top-1 and top-5).
//
// Shape legend: B rows (images), NC classes.
#pragma once

#include <algorithm>

#include "softmax_xent_math.hpp"

namespace sample {

// q = (1 - smoothing) onehot(label) + smoothing / NC (label smoothing, Szegedy et al. 2016).

inline float softmax_xent_forward(float* probs,         // (B, NC)
                                  int* correct,         // (1): argmax hits, or null
                                  const float* logits,  // (B, NC)
                                  const int* labels,    // (B)
                                  int B, int NC, float smoothing) {
  double total = 0;
  int hits = 0;
  for (int b = 0; b < B; ++b) {
    int argmax;
    total += xent_row(probs + b * NC, &argmax, logits + b * NC, labels[b], NC, smoothing);
    hits += argmax == labels[b];
  }
  if (correct) *correct = hits;
  return static_cast<float>(total / B);
}

inline void softmax_xent_backward(float* dlogits,      // (B, NC), overwritten
                                  const float* probs,  // (B, NC) from forward
                                  const int* labels,   // (B)
                                  int B, int NC, float smoothing) {
  const float scale = 1.0f / B;  // the loss is a mean over this replica's batch
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < NC; ++c) dlogits[b * NC + c] = xent_grad(probs[b * NC + c], c, labels[b], NC, smoothing, scale);
}

// How many rows have their label among the k largest logits (ties: a logit equal to the label's
// counts against it only when it comes earlier, as torch.topk's order on ties is unspecified).
inline int topk_hits(const float* logits,  // (B, NC)
                     const int* labels,    // (B)
                     int B, int NC, int k) {
  int hits = 0;
  for (int b = 0; b < B; ++b) {
    const float* z = logits + static_cast<std::size_t>(b) * NC;
    const int y = labels[b];
    int above = 0;
    for (int c = 0; c < NC; ++c) above += z[c] > z[y] || (z[c] == z[y] && c < y);
    hits += above < k;
  }
  return hits;
}

}  // namespace sample
