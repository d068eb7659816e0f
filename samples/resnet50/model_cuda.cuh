// samples/resnet50/model_cuda.cuh: ResNet-50 v1.5 of model.hpp on an NVIDIA GPU.
//
// Purpose: the same model, parameter layout, buckets and initialisation as model.hpp (all of it
// model_layout.hpp's), the same wiring piece by piece, with every parameter, gradient and
// activation in device memory and the layers of layers_cuda.cuh. Parameters are initialised on the
// host by initial_parameters (so a seed gives the same model on both backends) and copied once;
// batch-norm running statistics stay on the host, where the group merge updates them. T is what
// convolutions and the classifier read (float, or bf16 bits whose copy of the weights the
// optimizer writes in its update pass). Everything runs on the calling thread's stream.
// Limits: one batch size at a time per model object (re-allocated on change); square images.
//
// Shape legend: B batch of this replica, S input side, NC classes; activations are NHWC.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <vector>

#include <lockstep/device/runtime.hpp>

#include "layers_cuda.cuh"
#include "model_layout.hpp"

namespace resnet::gpu {

template <class T>
using dbuf = lockstep::device::buffer<T>;

// A convolution + batch norm's activations, sized for batch B (model.hpp's conv_bn_acts).
template <class T>
struct conv_bn_acts {
  dbuf<float> conv;       // (B, OH, OW, K): the convolution's output, batch norm's input
  dbuf<T> act;            // (B, OH, OW, K): max(0, BN(conv)); not for conv3 and the projection
  dbuf<float> mean_rstd;  // (2K): mean then rstd, saved for backward
  float count = 0;        // host: rows of the group
};

template <class T>
struct block_acts {
  conv_bn_acts<T> c1, c2, c3, down;
  dbuf<T> out;  // (B, OH, OW, K): max(0, BN3(c3.conv) + shortcut)
};

template <class T>
struct model {
  config cfg;
  layout L;
  dbuf<float> params;          // (L.total): the flat block, fp32 master weights
  dbuf<float> grads;           // (L.total): same layout
  std::vector<float> running;  // host (L.running): running mean then var of each batch norm
  dbuf<bf16_t> params_bf16;    // (L.total) when T is bf16: what the convolutions read

  int B = 0;
  dbuf<float> images;  // (B, 3, S, S): the pipeline's batch
  dbuf<T> input;       // (B, S, S, 3)
  conv_bn_acts<T> stem;
  dbuf<T> pool;  // (B, S/4, S/4, 64)
  dbuf<std::uint8_t> pool_which;
  std::array<block_acts<T>, nblocks> blocks;
  dbuf<T> feat;                 // (B, 2048)
  dbuf<float> logits, probs;    // (B, NC)
  dbuf<int> labels;             // (B)
  std::vector<int> host_labels; // (B)
  dbuf<double> loss_scratch;    // B doubles + B ints (softmax_xent_forward)
  dbuf<float> bn_scratch;       // (2 * 2048): batch norm's statistics and sums
  // Gradient scratch, as in model.hpp.
  dbuf<float> g_a, g_b, g_sum, g_act, g_tmp, g_feat, g_logits;
  dbuf<T> g_conv;

  const T* weight(std::size_t offset) const {
    if constexpr (std::is_same_v<T, float>) return params.data() + offset;
    else return params_bf16.data() + offset;
  }
};

inline cudaStream_t stream() { return cuda_ctx().stream; }

// The bf16 copy of all weights (after creation and restore; during training the optimizer keeps it).
template <class T>
void model_sync_bf16(model<T>& m) {
  if constexpr (!std::is_same_v<T, float>) sample::gpu::round_bf16(m.params_bf16.data(), m.params.data(), m.L.total);
}

// Copies host parameters (a checkpoint's) into the model, and their bf16 copy.
template <class T>
void model_set_params(model<T>& m, const std::vector<float>& params) {
  if (params.size() != m.L.total) throw std::runtime_error("model_set_params: wrong number of parameters");
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(m.params.data(), params.data(), params.size() * sizeof(float),
                                        cudaMemcpyHostToDevice, stream()));
  model_sync_bf16(m);
  LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(stream()));
}

// A model with the parameters of model.hpp's model_create for the same seed, on the device.
template <class T>
model<T> model_create(const config& cfg, std::uint64_t seed) {
  model<T> m;
  m.cfg = cfg;
  m.L = make_layout(cfg);
  std::vector<float> host;
  initial_parameters(cfg, m.L, seed, host, m.running);
  m.params = dbuf<float>(m.L.total, stream());
  m.grads = dbuf<float>(m.L.total, stream());
  LOCKSTEP_SAMPLE_CHECK(cudaMemsetAsync(m.grads.data(), 0, m.L.total * sizeof(float), stream()));
  if constexpr (!std::is_same_v<T, float>) m.params_bf16 = dbuf<bf16_t>(m.L.total, stream());
  m.bn_scratch = dbuf<float>(2 * static_cast<std::size_t>(features), stream());
  model_set_params(m, host);
  return m;
}

template <class T>
void acts_resize(conv_bn_acts<T>& a, const conv_bn& c, int B, bool relu) {
  a.conv = dbuf<float>(out_elems(c, B), stream());
  if (relu) a.act = dbuf<T>(out_elems(c, B), stream());
  a.mean_rstd = dbuf<float>(2 * static_cast<std::size_t>(c.K), stream());
}

template <class T>
void model_resize(model<T>& m, int B) {
  if (m.B == B) return;
  const auto s = stream();
  m.B = B;
  const layout& L = m.L;
  const std::size_t nb = static_cast<std::size_t>(B);
  m.images = dbuf<float>(nb * 3 * m.cfg.size * m.cfg.size, s);
  m.input = dbuf<T>(nb * m.cfg.size * m.cfg.size * 3, s);
  acts_resize(m.stem, L.stem, B, true);
  const std::size_t pooled = nb * L.pool_side * L.pool_side * stem_channels;
  m.pool = dbuf<T>(pooled, s);
  m.pool_which = dbuf<std::uint8_t>(pooled, s);
  for (int b = 0; b < nblocks; ++b) {
    const block_info& bi = L.blocks[b];
    block_acts<T>& a = m.blocks[b];
    acts_resize(a.c1, bi.c1, B, true);
    acts_resize(a.c2, bi.c2, B, true);
    acts_resize(a.c3, bi.c3, B, false);
    if (bi.has_down) acts_resize(a.down, bi.down, B, false);
    a.out = dbuf<T>(out_elems(bi.c3, B), s);
  }
  const std::size_t nl = nb * m.cfg.classes, biggest = gradient_elems(L, B);
  m.feat = dbuf<T>(nb * features, s);
  m.logits = dbuf<float>(nl, s);
  m.probs = dbuf<float>(nl, s);
  m.labels = dbuf<int>(nb, s);
  m.host_labels.assign(nb, 0);
  m.loss_scratch = dbuf<double>(2 * nb, s);  // B doubles, then B ints
  for (auto* g : {&m.g_a, &m.g_b, &m.g_sum, &m.g_act, &m.g_tmp}) *g = dbuf<float>(biggest, s);
  m.g_conv = dbuf<T>(biggest, s);
  m.g_feat = dbuf<float>(nb * features, s);
  m.g_logits = dbuf<float>(nl, s);
}

inline conv_desc shape_of(const conv_bn& c, int B) { return {B, c.C, c.H, c.W, c.K, c.R, c.S}; }

// ----------------------------------------------------------------------------------------------
// conv + batch norm (+ ReLU), as model.hpp's.

template <class T>
void conv_bn_forward(conv_bn_acts<T>& a, const T* x, const conv_bn& c, model<T>& m, bool relu, const bn_group& group,
                     bool training) {
  const int B = m.B;
  conv_forward(a.conv.data(), x, m.weight(c.w), shape_of(c, B));
  const std::size_t N = static_cast<std::size_t>(B) * c.OH() * c.OW();
  float* rm = m.running.data() + c.run;
  float* rv = rm + c.K;
  const float* gamma = m.params.data() + c.gamma;
  const float* beta = m.params.data() + c.beta;
  if (relu)
    batchnorm_forward(a.act.data(), a.mean_rstd.data(), &a.count, rm, rv, a.conv.data(), gamma, beta, N, c.K, true,
                      group, training, m.bn_scratch.data(), m.cfg.bn_momentum, m.cfg.bn_eps);
  else
    batchnorm_stats(a.mean_rstd.data(), &a.count, rm, rv, a.conv.data(), N, c.K, group, training, m.bn_scratch.data(),
                    m.cfg.bn_momentum, m.cfg.bn_eps);
}

// dx (null: not needed) from dout, the gradient of a.act or of BN(a.conv). have_sums: the batch
// norm's sums are in m.bn_scratch already (bn_add_relu_backward_sums made them).
template <class T>
void conv_bn_backward(float* dx, const float* dout, const conv_bn_acts<T>& a, const T* x, const conv_bn& c,
                      model<T>& m, bool relu, const bn_group& group, bool have_sums = false) {
  const int B = m.B;
  const std::size_t N = static_cast<std::size_t>(B) * c.OH() * c.OW();
  float* dgamma = m.grads.data() + c.gamma;
  float* dbeta = m.grads.data() + c.beta;
  const float* gamma = m.params.data() + c.gamma;
  const float* beta = m.params.data() + c.beta;
  if (have_sums)
    batchnorm_backward_dx(m.g_conv.data(), dgamma, dbeta, m.bn_scratch.data(), dout, a.conv.data(),
                          a.mean_rstd.data(), a.count, gamma, beta, N, c.K, relu, group);
  else
    batchnorm_backward(m.g_conv.data(), dgamma, dbeta, dout, a.conv.data(), a.mean_rstd.data(), a.count, gamma, beta,
                       N, c.K, relu, group, m.bn_scratch.data());
  conv_backward(dx, m.grads.data() + c.w, m.g_conv.data(), x, m.weight(c.w), shape_of(c, B));
}

// ----------------------------------------------------------------------------------------------
// bottleneck, as model.hpp's.

template <class T>
void bottleneck_forward(block_acts<T>& a, const T* x, const block_info& bi, model<T>& m, const bn_group& group,
                        bool training) {
  conv_bn_forward(a.c1, x, bi.c1, m, true, group, training);
  conv_bn_forward(a.c2, a.c1.act.data(), bi.c2, m, true, group, training);
  conv_bn_forward(a.c3, a.c2.act.data(), bi.c3, m, false, group, training);
  const std::size_t N = static_cast<std::size_t>(m.B) * bi.c3.OH() * bi.c3.OW();
  const float* p = m.params.data();
  if (bi.has_down) {
    conv_bn_forward(a.down, x, bi.down, m, false, group, training);
    bn_add_bn_relu_forward(a.out.data(), a.c3.conv.data(), p + bi.c3.gamma, p + bi.c3.beta, a.c3.mean_rstd.data(),
                           a.down.conv.data(), p + bi.down.gamma, p + bi.down.beta, a.down.mean_rstd.data(), N,
                           bi.c3.K);
  } else {
    bn_add_relu_forward(a.out.data(), a.c3.conv.data(), p + bi.c3.gamma, p + bi.c3.beta, a.c3.mean_rstd.data(), x, N,
                        bi.c3.K);
  }
}

// The gradient of the block's input in two parts (model.hpp's bottleneck_backward_parts): dx
// through conv1, and the returned shortcut part, which the block before adds in its first pass.
template <class T>
const float* bottleneck_backward_parts(float* dx, const float* dout, const float* dout2, const block_acts<T>& a,
                                       const T* x, const block_info& bi, model<T>& m, const bn_group& group) {
  const std::size_t N = static_cast<std::size_t>(m.B) * bi.c3.OH() * bi.c3.OW();
  bn_add_relu_backward_sums(m.g_sum.data(), m.bn_scratch.data(), dout, dout2, a.out.data(), a.c3.conv.data(),
                            a.c3.mean_rstd.data(), N, bi.c3.K);
  conv_bn_backward(m.g_act.data(), m.g_sum.data(), a.c3, a.c2.act.data(), bi.c3, m, false, group, true);
  conv_bn_backward(m.g_act.data(), m.g_act.data(), a.c2, a.c1.act.data(), bi.c2, m, true, group);
  conv_bn_backward(dx, m.g_act.data(), a.c1, x, bi.c1, m, true, group);
  if (!bi.has_down) return m.g_sum.data();
  conv_bn_backward(m.g_tmp.data(), m.g_sum.data(), a.down, x, bi.down, m, false, group);
  return m.g_tmp.data();
}

// dx: the whole gradient of the block's input x, from dout, the gradient of a.out.
template <class T>
void bottleneck_backward(float* dx, const float* dout, const block_acts<T>& a, const T* x, const block_info& bi,
                         model<T>& m, const bn_group& group) {
  const float* shortcut = bottleneck_backward_parts(dx, dout, nullptr, a, x, bi, m, group);
  add_into(dx, shortcut, static_cast<std::size_t>(m.B) * bi.c1.H * bi.c1.W * bi.c1.C);
}

// ----------------------------------------------------------------------------------------------
// The whole network.

template <class T>
const T* block_input(const model<T>& m, int b) {
  return b == 0 ? m.pool.data() : m.blocks[b - 1].out.data();
}

// Forward pass to the logits (m.logits) over B images (host, NCHW fp32, normalised); labels (host)
// are copied for the loss.
template <class T>
void model_logits(model<T>& m, const float* images, const int* labels, int B, const bn_group& group, bool training) {
  const auto s = stream();
  model_resize(m, B);
  const layout& L = m.L;
  const int S = m.cfg.size;
  std::copy(labels, labels + B, m.host_labels.begin());
  LOCKSTEP_SAMPLE_CHECK(
      cudaMemcpyAsync(m.images.data(), images, m.images.size() * sizeof(float), cudaMemcpyHostToDevice, s));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(m.labels.data(), labels, B * sizeof(int), cudaMemcpyHostToDevice, s));
  nchw_to_nhwc(m.input.data(), m.images.data(), B, 3, S, S);
  conv_bn_forward(m.stem, m.input.data(), L.stem, m, true, group, training);
  maxpool3x3_forward(m.pool.data(), m.pool_which.data(), m.stem.act.data(), B, L.stem.OH(), L.stem.OW(), stem_channels);
  for (int b = 0; b < nblocks; ++b) bottleneck_forward(m.blocks[b], block_input(m, b), L.blocks[b], m, group, training);
  global_avgpool_forward(m.feat.data(), m.blocks[nblocks - 1].out.data(), B, L.final_side * L.final_side, features);
  linear_forward(m.logits.data(), m.feat.data(), m.weight(L.fc_w), m.params.data() + L.fc_b, B, features,
                 m.cfg.classes);
}

// As model.hpp's model_forward (top-1 hits only; evaluation takes the logits to the host).
template <class T>
float model_forward(model<T>& m, const float* images, const int* labels, int B, const bn_group& group, bool training,
                    int* top1 = nullptr) {
  model_logits(m, images, labels, B, group, training);
  return softmax_xent_forward(m.probs.data(), top1, m.logits.data(), m.labels.data(), m.host_labels.data(), B,
                              m.cfg.classes, training ? m.cfg.label_smoothing : 0.0f, m.loss_scratch.data());
}

// As model.hpp's model_backward: bucket_ready(b) is called once bucket b's gradients are enqueued
// on the stream (the classifier (nblocks + 1) first, then the bottlenecks, the stem (0) last); work
// ordered after it on the same stream sees them final.
template <class T>
void model_backward(model<T>& m, const bn_group& group, const std::function<void(int)>& bucket_ready = {}) {
  const int B = m.B;
  const layout& L = m.L;
  softmax_xent_backward(m.g_logits.data(), m.probs.data(), m.labels.data(), B, m.cfg.classes, m.cfg.label_smoothing);
  linear_backward(m.g_feat.data(), m.grads.data() + L.fc_w, m.grads.data() + L.fc_b, m.g_logits.data(), m.feat.data(),
                  m.weight(L.fc_w), B, features, m.cfg.classes);
  if (bucket_ready) bucket_ready(nblocks + 1);
  float* dout = m.g_a.data();
  float* dinp = m.g_b.data();
  global_avgpool_backward(dout, m.g_feat.data(), B, L.final_side * L.final_side, features);
  const float* dshort = nullptr;
  for (int b = nblocks - 1; b >= 0; --b) {
    dshort = bottleneck_backward_parts(dinp, dout, dshort, m.blocks[b], block_input(m, b), L.blocks[b], m, group);
    if (bucket_ready) bucket_ready(b + 1);
    std::swap(dout, dinp);
  }
  add_into(dout, dshort, static_cast<std::size_t>(B) * L.pool_side * L.pool_side * stem_channels);
  maxpool3x3_backward(m.g_act.data(), dout, m.pool_which.data(), B, L.stem.OH(), L.stem.OW(), stem_channels);
  conv_bn_backward(nullptr, m.g_act.data(), m.stem, m.input.data(), L.stem, m, true, group);
  if (bucket_ready) bucket_ready(0);
}

}  // namespace resnet::gpu
