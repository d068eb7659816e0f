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
// With --fc H1,H2 the classifier is preceded by two hidden FC layers with ReLU (head_cpu.hpp):
//   ... block2 -> (B,F) -> fc1 -> (B,H1) -> fc2 -> (B,H2) -> linear -> (B,10)
// (hybrid runs split fc1 and fc2 over the replicas instead: head_hybrid.hpp, replica_hybrid.hpp).
//
// Shape legend: B batch of this replica, Ci channels of block i, Si side of block i's input
// (28, 14, 7), F = c2 * 4 * 4 features out of the blocks, H1, H2 hidden widths, NC = 10 classes.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "head_cpu.hpp"
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
  float *fc1_w = nullptr, *fc1_b = nullptr, *fc2_w = nullptr, *fc2_b = nullptr;  // the head (--fc)
  float *d_fc1_w = nullptr, *d_fc1_b = nullptr, *d_fc2_w = nullptr, *d_fc2_b = nullptr;
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
  // The head's activations (after ReLU) and gradients: (B, H1), (B, H2); the features' gradient (B, F).
  std::vector<float> h1, h2, d_h1, d_h2, d_features;
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
  for (int i = 0; i < nblocks; ++i) {
    const block_buffers z = block_sizes(m.cfg, m.L, B, i);
    m.conv_out[i].assign(z.out, 0.0f);
    m.bn_out[i].assign(z.out, 0.0f);
    m.pool_out[i].assign(z.pooled, 0.0f);
    m.pool_ws[i].assign(z.pool_ws, 0);
    m.bn_mean[i].assign(z.channels, 0.0f);
    m.bn_rstd[i].assign(z.channels, 0.0f);
  }
  const std::size_t biggest = biggest_activation(m.cfg, m.L, B);
  m.logits.assign(static_cast<std::size_t>(B) * m.cfg.classes, 0.0f);
  m.probs.assign(m.logits.size(), 0.0f);
  m.input.assign(static_cast<std::size_t>(B) * m.cfg.side * m.cfg.side, 0.0f);
  m.labels.assign(static_cast<std::size_t>(B), 0);
  m.dact_a.assign(biggest, 0.0f);
  m.dact_b.assign(biggest, 0.0f);
  if (m.cfg.has_head()) {
    const auto b = static_cast<std::size_t>(B);
    m.h1.assign(b * m.cfg.fc[0], 0.0f), m.d_h1.assign(m.h1.size(), 0.0f);
    m.h2.assign(b * m.cfg.fc[1], 0.0f), m.d_h2.assign(m.h2.size(), 0.0f);
    m.d_features.assign(b * m.L.features, 0.0f);
  }
}

// The conv blocks, forward, over B images: returns the features (B, F). training: batch
// statistics over `group` (and running statistics updated); otherwise the running statistics.
inline const float* model_forward_features(model& m, const float* images, const int* labels, int B, const bn_group& group,
                                           bool training) {
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
  return x;
}

// The loss of the logits in m.logits: the mean over this replica's batch; counts correct predictions.
inline float model_loss(model& m, bool training, int* correct = nullptr) {
  return softmax_xent_forward(m.probs.data(), correct, m.logits.data(), m.labels.data(), m.B, m.cfg.classes,
                              training ? m.cfg.label_smoothing : 0.0f);
}

// Forward pass over B images; returns the mean loss of this replica's batch and counts correct
// predictions. training: batch statistics over `group` (and running statistics updated);
// otherwise the running statistics, and `group` is not used.
inline float model_forward(model& m, const float* images, const int* labels, int B, const bn_group& group,
                           bool training, int* correct = nullptr) {
  const float* x = model_forward_features(m, images, labels, B, group, training);
  if (m.cfg.has_head()) {
    const auto b = static_cast<std::size_t>(B), F = static_cast<std::size_t>(m.L.features);
    const auto H1 = static_cast<std::size_t>(m.cfg.fc[0]), H2 = static_cast<std::size_t>(m.cfg.fc[1]);
    fc_relu_forward(m.h1.data(), x, m.fc1_w, m.fc1_b, b, F, H1);
    fc_relu_forward(m.h2.data(), m.h1.data(), m.fc2_w, m.fc2_b, b, H1, H2);
    x = m.h2.data();
  }
  linear_forward(m.logits.data(), x, m.fc_w, m.fc_b, B, m.L.classifier_in, m.cfg.classes);
  return model_loss(m, training, correct);
}

// The conv blocks, backward, from the features' gradient `dfeatures` (B, F); calls
// bucket_ready(i) as soon as block i's gradients are final, block 0 last.
inline void model_backward_features(model& m, const float* dfeatures, const bn_group& group,
                                    const std::function<void(int)>& bucket_ready = {}) {
  const int B = m.B;
  float* dout = m.dact_a.data();  // gradient of the current layer's output
  float* dinp = m.dact_b.data();  // gradient of its input
  if (dfeatures == dinp) std::swap(dout, dinp);  // already in the scratch (the classifier's backward)
  else if (dfeatures != dout) std::copy(dfeatures, dfeatures + static_cast<std::size_t>(B) * m.L.features, dout);
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

// Backward pass of the last training forward: writes every gradient of m.grads (the gradient of
// this replica's mean loss) and calls bucket_ready(b) as soon as bucket b is final, the classifier
// first and block 0 last (with the head: the head bucket, fc2, fc1, then the blocks; a bucket is
// reported only once backward no longer reads its weights, since its update may start at once).
inline void model_backward(model& m, const bn_group& group, const std::function<void(int)>& bucket_ready = {}) {
  const int B = m.B;
  float* dout = m.dact_a.data();
  softmax_xent_backward(dout, m.probs.data(), m.labels.data(), B, m.cfg.classes, m.cfg.label_smoothing);
  if (!m.cfg.has_head()) {
    float* dinp = m.dact_b.data();
    linear_backward(dinp, m.d_fc_w, m.d_fc_b, dout, m.pool_out[nblocks - 1].data(), m.fc_w, B, m.L.features,
                    m.cfg.classes);
    if (bucket_ready) bucket_ready(nblocks);
    model_backward_features(m, dinp, group, bucket_ready);
    return;
  }
  const auto b = static_cast<std::size_t>(B), F = static_cast<std::size_t>(m.L.features);
  const auto H1 = static_cast<std::size_t>(m.cfg.fc[0]), H2 = static_cast<std::size_t>(m.cfg.fc[1]);
  linear_backward(m.d_h2.data(), m.d_fc_w, m.d_fc_b, dout, m.h2.data(), m.fc_w, B, m.L.classifier_in, m.cfg.classes);
  bias_relu_backward(m.d_h2.data(), m.d_fc2_b, m.h2.data(), b, H2);
  if (bucket_ready) bucket_ready(nblocks);  // fc2.b, fc.w, fc.b
  sgemm({true, false, H1, H2, b, m.h1.data(), H1, m.d_h2.data(), H2, 0.0f, m.d_fc2_w, H2});
  sgemm({false, true, b, H1, H2, m.d_h2.data(), H2, m.fc2_w, H2, 0.0f, m.d_h1.data(), H1});
  if (bucket_ready) bucket_ready(nblocks + 2);  // fc2.w
  fc_relu_backward(m.d_features.data(), m.d_fc1_w, m.d_fc1_b, m.d_h1.data(), m.pool_out[nblocks - 1].data(), m.h1.data(),
                   m.fc1_w, b, F, H1);
  if (bucket_ready) bucket_ready(nblocks + 1);  // fc1.w, fc1.b
  model_backward_features(m, m.d_features.data(), group, bucket_ready);
}

// The CPU backend of the hybrid head's orchestration (head_hybrid.hpp): oneDNN and the loops of
// head_cpu.hpp on host memory.
struct cpu_backend {
  using model_type = model;
  using buffer = std::vector<float>;
  static float* resize(buffer& b, std::size_t n) {
    b.assign(n, 0.0f);
    return b.data();
  }
  static void sgemm(const lockstep::parallel::gemm_args& a) { fashion::sgemm(a); }
  static void bias_relu_forward(float* y, const float* b, std::size_t rows, std::size_t n) {
    fashion::bias_relu_forward(y, b, rows, n);
  }
  static void bias_relu_backward(float* dy, float* db, const float* y, std::size_t rows, std::size_t n) {
    fashion::bias_relu_backward(dy, db, y, rows, n);
  }
  static void linear_forward(float* out, const float* inp, const float* w, const float* b, int B, int F, int NC) {
    fashion::linear_forward(out, inp, w, b, B, F, NC);
  }
  static void linear_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                              int B, int F, int NC) {
    fashion::linear_backward(dinp, dw, db, dout, inp, w, B, F, NC);
  }
  static void copy(float* dst, const float* src, std::size_t n) { std::copy(src, src + n, dst); }
};

}  // namespace fashion
