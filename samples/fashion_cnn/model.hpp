// samples/fashion_cnn/model.hpp: a small CNN for 28x28 grey images, all parameters in one block.
//
// Purpose: the model of lockstep-train-fashion. Three blocks of conv3x3 - batch norm - ReLU -
// maxpool2x2 and a linear classifier:
//   (B,1,28,28) -> block0 -> (B,c0,14,14) -> block1 -> (B,c1,7,7) -> block2 -> (B,c2,4,4) -> linear -> (B,10)
// With channels (32, 64, 128): 113,386 parameters, about 7.4 M multiply-adds per image forward.
// Parameters live in one flat block laid out block by block, so gradients are one flat buffer and
// each block's gradients are one contiguous bucket: the trainer starts reducing a bucket as soon as
// backward has written it, while backward goes on with the blocks before it.
// Limits: CPU (layers_cpu.hpp); one batch size at a time per model object (re-allocated on change).
//
// Shape legend: B batch of this replica, Ci channels of block i, Si side of block i's input
// (28, 14, 7), F = c2 * 4 * 4 features into the classifier, NC = 10 classes.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "layers_cpu.hpp"
#include "model_layout.hpp"

namespace fashion {

// Everything of one replica's model: parameters, gradients, batch-norm running statistics, and
// the activations of the last forward pass.
struct model {
  config cfg;
  layout L;
  std::vector<float> params;   // (L.total): the flat block
  std::vector<float> grads;    // (L.total): same layout
  std::vector<float> running;  // (2 * sum Ci): running mean then running var of each block

  // Pointers into params / grads by tensor, in layout order.
  std::array<float*, nblocks> conv_w, bn_gamma, bn_beta, d_conv_w, d_bn_gamma, d_bn_beta;
  float *fc_w, *fc_b, *d_fc_w, *d_fc_b;
  std::array<float*, nblocks> run_mean, run_var;

  // Activations, sized for batch B.
  int B = 0;
  std::array<std::vector<float>, nblocks> conv_out;  // (B, Ci, Si, Si)
  std::array<std::vector<float>, nblocks> bn_out;    // (B, Ci, Si, Si) after ReLU
  std::array<std::vector<float>, nblocks> pool_out;  // (B, Ci, Si/2, Si/2)
  std::array<std::vector<std::uint8_t>, nblocks> pool_ws;
  std::array<std::vector<float>, nblocks> bn_mean, bn_rstd;  // (Ci)
  std::array<float, nblocks> bn_count{};
  std::vector<float> logits, probs;  // (B, NC)
  std::vector<float> input;          // (B, 1, 28, 28), copy of the last batch
  std::vector<int> labels;           // (B)
  // Gradient scratch for activations, the largest size any block needs, two so that one block's
  // output gradient and input gradient can coexist.
  std::vector<float> dact_a, dact_b;
};

inline void model_bind(model& m) { bind_tensors(m, m.params.data(), m.grads.data(), m.running.data()); }

// A model with freshly initialised parameters (initial_parameters, model_layout.hpp).
inline model model_create(const config& cfg, std::uint64_t seed) {
  model m;
  m.cfg = cfg;
  m.L = make_layout(cfg);
  initial_parameters(cfg, m.L, seed, m.params, m.running);
  m.grads.assign(m.L.total, 0.0f);
  model_bind(m);
  return m;
}

inline void model_resize(model& m, int B) {
  if (m.B == B) return;
  m.B = B;
  std::size_t biggest = 0;
  int C = 1;
  for (int i = 0; i < nblocks; ++i) {
    const int K = m.cfg.channels[i], S = m.L.side_in[i], P = pooled(S);
    const std::size_t n = static_cast<std::size_t>(B) * K * S * S;
    m.conv_out[i].assign(n, 0.0f);
    m.bn_out[i].assign(n, 0.0f);
    m.pool_out[i].assign(static_cast<std::size_t>(B) * K * P * P, 0.0f);
    m.pool_ws[i].assign(maxpool_workspace_bytes(B, K, S, S), 0);
    m.bn_mean[i].assign(static_cast<std::size_t>(K), 0.0f);
    m.bn_rstd[i].assign(static_cast<std::size_t>(K), 0.0f);
    biggest = std::max({biggest, n, static_cast<std::size_t>(B) * C * S * S});
    C = K;
  }
  m.logits.assign(static_cast<std::size_t>(B) * m.cfg.classes, 0.0f);
  m.probs.assign(m.logits.size(), 0.0f);
  m.input.assign(static_cast<std::size_t>(B) * m.cfg.side * m.cfg.side, 0.0f);
  m.labels.assign(static_cast<std::size_t>(B), 0);
  m.dact_a.assign(biggest, 0.0f);
  m.dact_b.assign(biggest, 0.0f);
}

// Forward pass over B images; returns the mean loss of this replica's batch and counts correct
// predictions. training: batch statistics over `group` (and running statistics updated);
// otherwise the running statistics, and `group` is not used.
inline float model_forward(model& m, const float* images, const int* labels, int B, const bn_group& group,
                           bool training, int* correct = nullptr) {
  model_resize(m, B);
  std::copy(images, images + m.input.size(), m.input.begin());
  std::copy(labels, labels + B, m.labels.begin());
  const float* x = m.input.data();
  int C = 1;
  for (int i = 0; i < nblocks; ++i) {
    const int K = m.cfg.channels[i], S = m.L.side_in[i];
    conv_forward(m.conv_out[i].data(), x, m.conv_w[i], B, C, S, S, K);
    batchnorm_relu_forward(m.bn_out[i].data(), m.bn_mean[i].data(), m.bn_rstd[i].data(), &m.bn_count[i],
                           m.run_mean[i], m.run_var[i], m.conv_out[i].data(), m.bn_gamma[i], m.bn_beta[i], B, K,
                           S * S, group, training, m.cfg.bn_momentum);
    maxpool_forward(m.pool_out[i].data(), m.pool_ws[i].data(), m.bn_out[i].data(), B, K, S, S);
    x = m.pool_out[i].data();
    C = K;
  }
  linear_forward(m.logits.data(), x, m.fc_w, m.fc_b, B, m.L.features, m.cfg.classes);
  return softmax_xent_forward(m.probs.data(), correct, m.logits.data(), m.labels.data(), B, m.cfg.classes,
                              training ? m.cfg.label_smoothing : 0.0f);
}

// Backward pass of the last training forward: writes every gradient of m.grads (the gradient of
// this replica's mean loss) and calls bucket_ready(b) as soon as bucket b is final, the classifier
// first and block 0 last.
inline void model_backward(model& m, const bn_group& group, const std::function<void(int)>& bucket_ready = {}) {
  const int B = m.B;
  float* dout = m.dact_a.data();  // gradient of the current layer's output
  float* dinp = m.dact_b.data();  // gradient of its input
  softmax_xent_backward(dout, m.probs.data(), m.labels.data(), B, m.cfg.classes, m.cfg.label_smoothing);
  linear_backward(dinp, m.d_fc_w, m.d_fc_b, dout, m.pool_out[nblocks - 1].data(), m.fc_w, B, m.L.features,
                  m.cfg.classes);
  if (bucket_ready) bucket_ready(nblocks);
  std::swap(dout, dinp);
  for (int i = nblocks - 1; i >= 0; --i) {
    const int K = m.cfg.channels[i], S = m.L.side_in[i], C = i ? m.cfg.channels[i - 1] : 1;
    maxpool_backward(dinp, dout, m.pool_ws[i].data(), B, K, S, S);
    std::swap(dout, dinp);
    batchnorm_relu_backward(dinp, m.d_bn_gamma[i], m.d_bn_beta[i], dout, m.conv_out[i].data(), m.bn_mean[i].data(),
                            m.bn_rstd[i].data(), m.bn_count[i], m.bn_gamma[i], m.bn_beta[i], B, K, S * S, group);
    std::swap(dout, dinp);
    const float* x = i ? m.pool_out[i - 1].data() : m.input.data();
    conv_backward(i ? dinp : nullptr, m.d_conv_w[i], dout, x, m.conv_w[i], B, C, S, S, K);
    if (bucket_ready) bucket_ready(i);
    std::swap(dout, dinp);
  }
}

}  // namespace fashion
