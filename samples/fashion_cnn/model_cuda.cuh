// samples/fashion_cnn/model_cuda.cuh: the Fashion-MNIST CNN of model.hpp on an NVIDIA GPU.
//
// Purpose: the same model, parameter layout, buckets and initialisation as model.hpp, with every
// parameter, gradient and activation in device memory and the layers of layers_cuda.cuh. The
// parameters are initialised on the host by initial_parameters (so a seed gives the same model on
// both backends) and copied once. Batch-norm running statistics stay on the host, where
// the group merge updates them. Everything runs on the calling thread's stream (cuda_ctx()).
// With --fc H1,H2 the head of model.hpp (fc1, fc2 with ReLU, then the classifier) on cuBLAS and
// layers_cuda.cuh's bias + ReLU kernels, in the same layout and bucket order.
// Limits: one batch size at a time per model object (re-allocated on change).
#pragma once

#include <algorithm>
#include <array>
#include <stdexcept>
#include <cstdint>
#include <functional>
#include <vector>

#include <lockstep/device/runtime.hpp>

#include "layers_cuda.cuh"
#include "model_layout.hpp"

namespace fashion::gpu {

template <class T>
using dbuf = lockstep::device::buffer<T>;

struct model {
  config cfg;
  layout L;
  dbuf<float> params, grads;   // (L.total): the flat block, as in model.hpp
  std::vector<float> running;  // host: running mean then running var of each block

  std::array<float*, nblocks> conv_w, bn_gamma, bn_beta, d_conv_w, d_bn_gamma, d_bn_beta;
  float *fc_w, *fc_b, *d_fc_w, *d_fc_b;
  float *fc1_w = nullptr, *fc1_b = nullptr, *fc2_w = nullptr, *fc2_b = nullptr;  // the head (--fc)
  float *d_fc1_w = nullptr, *d_fc1_b = nullptr, *d_fc2_w = nullptr, *d_fc2_b = nullptr;
  std::array<float*, nblocks> run_mean, run_var;

  int B = 0;
  std::array<dbuf<float>, nblocks> conv_out, bn_out, pool_out;
  std::array<dbuf<std::uint8_t>, nblocks> pool_ws;
  std::array<dbuf<float>, nblocks> bn_mean_rstd;  // (2 Ci): mean then rstd, saved for backward
  std::array<float, nblocks> bn_count{};
  dbuf<float> bn_scratch;                          // (2 max Ci)
  dbuf<float> logits, probs, input;
  dbuf<int> labels;
  std::vector<int> host_labels;
  dbuf<double> loss_scratch;  // B doubles + B ints (softmax_xent_forward)
  dbuf<float> dact_a, dact_b;
  // The head's activations (after ReLU) and gradients: (B, H1), (B, H2); the features' gradient (B, F).
  dbuf<float> h1, h2, d_h1, d_h2, d_features;
};

inline void model_bind(model& m) { bind_tensors(m, m.params.data(), m.grads.data(), m.running.data()); }

// Copies host parameters (a checkpoint's) into the model.
inline void model_set_params(model& m, const std::vector<float>& params) {
  auto s = cuda_ctx().stream;
  if (params.size() != m.L.total) throw std::runtime_error("model_set_params: wrong number of parameters");
  LOCKSTEP_SAMPLE_CHECK(
      cudaMemcpyAsync(m.params.data(), params.data(), params.size() * sizeof(float), cudaMemcpyHostToDevice, s));
  LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
}

// A model with freshly initialised parameters: those of model.hpp's model_create for the same
// seed (initial_parameters), copied to the device; gradients zero.
inline model model_create(const config& cfg, std::uint64_t seed) {
  auto s = cuda_ctx().stream;
  model m;
  m.cfg = cfg;
  m.L = make_layout(cfg);
  std::vector<float> host;
  initial_parameters(cfg, m.L, seed, host, m.running);
  m.params = dbuf<float>(m.L.total, s);
  m.grads = dbuf<float>(m.L.total, s);
  LOCKSTEP_SAMPLE_CHECK(cudaMemsetAsync(m.grads.data(), 0, m.L.total * sizeof(float), s));
  int widest = 0;
  for (int c : cfg.channels) widest = std::max(widest, c);
  m.bn_scratch = dbuf<float>(2 * static_cast<std::size_t>(widest), s);
  model_bind(m);
  model_set_params(m, host);
  return m;
}

inline void model_resize(model& m, int B) {
  if (m.B == B) return;
  auto s = cuda_ctx().stream;
  m.B = B;
  for (int i = 0; i < nblocks; ++i) {
    const block_buffers z = block_sizes(m.cfg, m.L, B, i);
    m.conv_out[i] = dbuf<float>(z.out, s);
    m.bn_out[i] = dbuf<float>(z.out, s);
    m.pool_out[i] = dbuf<float>(z.pooled, s);
    m.pool_ws[i] = dbuf<std::uint8_t>(z.pool_ws, s);
    m.bn_mean_rstd[i] = dbuf<float>(2 * z.channels, s);
  }
  const std::size_t biggest = biggest_activation(m.cfg, m.L, B);
  const std::size_t nl = static_cast<std::size_t>(B) * m.cfg.classes;
  m.logits = dbuf<float>(nl, s);
  m.probs = dbuf<float>(nl, s);
  m.input = dbuf<float>(static_cast<std::size_t>(B) * m.cfg.side * m.cfg.side, s);
  m.labels = dbuf<int>(static_cast<std::size_t>(B), s);
  m.host_labels.assign(static_cast<std::size_t>(B), 0);
  m.loss_scratch = dbuf<double>(static_cast<std::size_t>(B) * 2, s);  // B doubles, then B ints
  m.dact_a = dbuf<float>(biggest, s);
  m.dact_b = dbuf<float>(biggest, s);
  if (m.cfg.has_head()) {
    const auto b = static_cast<std::size_t>(B);
    m.h1 = dbuf<float>(b * m.cfg.fc[0], s), m.d_h1 = dbuf<float>(m.h1.size(), s);
    m.h2 = dbuf<float>(b * m.cfg.fc[1], s), m.d_h2 = dbuf<float>(m.h2.size(), s);
    m.d_features = dbuf<float>(b * m.L.features, s);
  }
}

// As model.hpp's model_forward_features: the conv blocks over B images (host memory, copied to
// the device); returns the features (B, F), device memory.
inline const float* model_forward_features(model& m, const float* images, const int* labels, int B, const bn_group& group,
                                           bool training) {
  auto s = cuda_ctx().stream;
  model_resize(m, B);
  std::copy(labels, labels + B, m.host_labels.begin());
  LOCKSTEP_SAMPLE_CHECK(
      cudaMemcpyAsync(m.input.data(), images, m.input.size() * sizeof(float), cudaMemcpyHostToDevice, s));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(m.labels.data(), labels, B * sizeof(int), cudaMemcpyHostToDevice, s));
  const float* x = m.input.data();
  int C = 1;
  for (int i = 0; i < nblocks; ++i) {
    const int K = m.cfg.channels[i], S = m.L.side_in[i];
    conv_forward(m.conv_out[i].data(), x, m.conv_w[i], B, C, S, S, K);
    batchnorm_relu_forward(m.bn_out[i].data(), m.bn_mean_rstd[i].data(), &m.bn_count[i], m.run_mean[i], m.run_var[i],
                           m.conv_out[i].data(), m.bn_gamma[i], m.bn_beta[i], B, K, S * S, group, training,
                           m.bn_scratch.data(), m.cfg.bn_momentum);
    maxpool_forward(m.pool_out[i].data(), m.pool_ws[i].data(), m.bn_out[i].data(), B, K, S, S);
    x = m.pool_out[i].data();
    C = K;
  }
  return x;
}

// The loss of the logits in m.logits: the mean over this replica's batch; counts correct predictions.
inline float model_loss(model& m, bool training, int* correct = nullptr) {
  return softmax_xent_forward(m.probs.data(), correct, m.logits.data(), m.labels.data(), m.host_labels.data(), m.B,
                              m.cfg.classes, training ? m.cfg.label_smoothing : 0.0f, m.loss_scratch.data());
}

// As model.hpp's model_forward; images and labels are host memory (copied to the device).
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

// As model.hpp's model_backward_features: the conv blocks, backward, from the features' gradient
// dfeatures (B, F, device); bucket_ready(i) once block i's gradients are enqueued, block 0 last.
inline void model_backward_features(model& m, const float* dfeatures, const bn_group& group,
                                    const std::function<void(int)>& bucket_ready = {}) {
  const int B = m.B;
  float* dout = m.dact_a.data();
  float* dinp = m.dact_b.data();
  if (dfeatures == dinp) std::swap(dout, dinp);  // already in the scratch (the classifier's backward)
  else if (dfeatures != dout)
    LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(dout, dfeatures, static_cast<std::size_t>(B) * m.L.features * sizeof(float),
                                          cudaMemcpyDeviceToDevice, cuda_ctx().stream));
  for (int i = nblocks - 1; i >= 0; --i) {
    const int K = m.cfg.channels[i], S = m.L.side_in[i], C = i ? m.cfg.channels[i - 1] : 1;
    maxpool_backward(dinp, dout, m.pool_ws[i].data(), B, K, S, S);
    std::swap(dout, dinp);
    batchnorm_relu_backward(dinp, m.d_bn_gamma[i], m.d_bn_beta[i], dout, m.conv_out[i].data(),
                            m.bn_mean_rstd[i].data(), m.bn_count[i], m.bn_gamma[i], m.bn_beta[i], B, K, S * S, group,
                            m.bn_scratch.data());
    std::swap(dout, dinp);
    const float* x = i ? m.pool_out[i - 1].data() : m.input.data();
    conv_backward(i ? dinp : nullptr, m.d_conv_w[i], dout, x, m.conv_w[i], B, C, S, S, K);
    if (bucket_ready) bucket_ready(i);
    std::swap(dout, dinp);
  }
}

// As model.hpp's model_backward: bucket_ready(b) is called once bucket b's gradients are enqueued
// on the stream (the classifier first, block 0 last; with the head: the head bucket, fc2, fc1,
// then the blocks, each once no later work reads its weights); work ordered after it on the same
// stream sees them final.
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

// The GPU backend of the hybrid head's orchestration (head_hybrid.hpp): cuBLAS and
// layers_cuda.cuh's kernels on device memory, everything on this thread's stream (cuda_ctx()),
// which the split layers' products join.
struct backend {
  using model_type = model;
  using buffer = dbuf<float>;
  static float* resize(buffer& b, std::size_t n) {  // uninitialised; grows only
    if (b.size() < n) b = dbuf<float>(n, cuda_ctx().stream);
    return b.data();
  }
  static void sgemm(const lockstep::parallel::gemm_args& a) { gpu::sgemm(a); }
  static void bias_relu_forward(float* y, const float* b, std::size_t rows, std::size_t n) {
    gpu::bias_relu_forward(y, b, rows, n);
  }
  static void bias_relu_backward(float* dy, float* db, const float* y, std::size_t rows, std::size_t n) {
    gpu::bias_relu_backward(dy, db, y, rows, n);
  }
  static void linear_forward(float* out, const float* inp, const float* w, const float* b, int B, int F, int NC) {
    gpu::linear_forward(out, inp, w, b, B, F, NC);
  }
  static void linear_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                              int B, int F, int NC) {
    gpu::linear_backward(dinp, dw, db, dout, inp, w, B, F, NC);
  }
  static void copy(float* dst, const float* src, std::size_t n) {
    if (n)
      LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, cuda_ctx().stream));
  }
  static cudaStream_t compute_stream() { return cuda_ctx().stream; }
};

}  // namespace fashion::gpu
