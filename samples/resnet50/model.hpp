// samples/resnet50/model.hpp: ResNet-50 v1.5 on the CPU (oneDNN), all parameters in one block.
//
// Purpose: the model of lockstep-train-resnet50: the wiring of layers_cpu.hpp's layers into the
// stem, sixteen bottlenecks and the head, forward and backward, one function per piece:
//   (B,S,S,3) -> stem: conv7x7/2 - BN - ReLU - maxpool3x3/2 -> (B,S/4,S/4,64)
//             -> stages of 3,4,6,3 bottlenecks -> (B,S/32,S/32,2048)
//             -> global average pool -> (B,2048) -> linear -> (B,classes)
// About 4.1 G multiply-adds per 224x224 image forward. Backward writes the gradients into one flat
// buffer laid out as the parameters, and calls bucket_ready(b) the moment bucket b (the classifier
// first, then bottleneck 15 ... 0, the stem last) is final: the trainer starts that bucket's
// all-reduce and update while backward goes on with the layers before it.
// T is what the convolutions and the classifier read: float (--precision fp32) or bf16 bits
// (--precision bf16: bf16 inputs and weights, fp32 accumulation; the weights' bf16 copy is written
// by the optimizer's update pass, batch norm, the loss and the master weights stay fp32).
// Limits: one batch size at a time per model object (re-allocated on change); square images.
//
// Shape legend: B batch of this replica, S input side, Hb x Hb the side of bottleneck b's input,
// Mb its width, Kb = 4 Mb its output channels, NC classes. Activations are NHWC.
#pragma once

#include <array>
#include <functional>
#include <span>
#include <vector>

#include "layers_cpu.hpp"
#include "model_layout.hpp"

namespace resnet {

// A convolution + batch norm's activations, sized for batch B.
template <class T>
struct conv_bn_acts {
  std::vector<float> conv;  // (B, OH, OW, K): the convolution's output, batch norm's input
  std::vector<T> act;       // (B, OH, OW, K): max(0, BN(conv)), the next convolution's input (not for
                            // conv3 and the projection: bn_add_relu applies their batch norms)
  std::vector<float> mean, rstd;  // (K)
  float count = 0;
};

template <class T>
struct block_acts {
  conv_bn_acts<T> c1, c2, c3, down;
  std::vector<T> out;  // (B, OH, OW, K): max(0, BN3(c3.conv) + shortcut)
};

// Everything of one replica's model: parameters, gradients, running statistics, the bf16 copy, and
// the activations of the last forward pass.
template <class T>
struct model {
  config cfg;
  layout L;
  std::vector<float> params;    // (L.total): the flat block, fp32 master weights
  std::vector<float> grads;     // (L.total): same layout
  std::vector<float> running;   // (L.running): running mean then var of each batch norm, layout order
  std::vector<bf16_t> params_bf16;  // (L.total) when T is bf16: what the convolutions read

  int B = 0;
  std::vector<T> input;  // (B, S, S, 3)
  conv_bn_acts<T> stem;
  std::vector<T> pool;                  // (B, S/4, S/4, 64)
  std::vector<std::uint8_t> pool_which;
  std::array<block_acts<T>, nblocks> blocks;
  std::vector<T> feat;                  // (B, 2048)
  std::vector<float> logits, probs;     // (B, NC)
  std::vector<int> labels;              // (B)
  // Gradient scratch: two for a block's output and input gradients, the residual sum's, an
  // activation's, a convolution's output (of T) and the shortcut's input gradient.
  std::vector<float> g_a, g_b, g_sum, g_act, g_tmp, g_feat, g_logits;
  std::vector<T> g_conv;

  // A convolution's or the classifier's weights, as the primitives read them.
  const void* weight(std::size_t offset) const {
    if constexpr (std::is_same_v<T, float>) return params.data() + offset;
    else return params_bf16.data() + offset;
  }
};

// The bf16 copy of all weights (after creation and restore; during training the optimizer keeps it).
template <class T>
void model_sync_bf16(model<T>& m) {
  if constexpr (!std::is_same_v<T, float>) {
    m.params_bf16.resize(m.params.size());
    for (std::size_t i = 0; i < m.params.size(); ++i) m.params_bf16[i] = sample::to_bf16(m.params[i]);
  }
}

template <class T>
model<T> model_create(const config& cfg, std::uint64_t seed) {
  model<T> m;
  m.cfg = cfg;
  m.L = make_layout(cfg);
  initial_parameters(cfg, m.L, seed, m.params, m.running);
  m.grads.assign(m.L.total, 0.0f);
  model_sync_bf16(m);
  return m;
}

inline conv_shape shape_of(const conv_bn& c, int B) { return {B, c.C, c.H, c.W, c.K, c.R, c.S}; }

template <class T>
void acts_resize(conv_bn_acts<T>& a, const conv_bn& c, int B, bool relu) {
  a.conv.assign(out_elems(c, B), 0.0f);
  if (relu) a.act.assign(out_elems(c, B), T{});
  a.mean.assign(static_cast<std::size_t>(c.K), 0.0f);
  a.rstd.assign(static_cast<std::size_t>(c.K), 0.0f);
}

template <class T>
void model_resize(model<T>& m, int B) {
  if (m.B == B) return;
  m.B = B;
  const layout& L = m.L;
  m.input.assign(static_cast<std::size_t>(B) * m.cfg.size * m.cfg.size * 3, T{});
  acts_resize(m.stem, L.stem, B, true);
  const std::size_t pooled = static_cast<std::size_t>(B) * L.pool_side * L.pool_side * stem_channels;
  m.pool.assign(pooled, T{});
  m.pool_which.assign(pooled, 0);
  for (int b = 0; b < nblocks; ++b) {
    const block_info& bi = L.blocks[b];
    block_acts<T>& a = m.blocks[b];
    acts_resize(a.c1, bi.c1, B, true);
    acts_resize(a.c2, bi.c2, B, true);
    acts_resize(a.c3, bi.c3, B, false);
    if (bi.has_down) acts_resize(a.down, bi.down, B, false);
    a.out.assign(out_elems(bi.c3, B), T{});
  }
  const std::size_t biggest = gradient_elems(L, B);
  m.feat.assign(static_cast<std::size_t>(B) * features, T{});
  m.logits.assign(static_cast<std::size_t>(B) * m.cfg.classes, 0.0f);
  m.probs.assign(m.logits.size(), 0.0f);
  m.labels.assign(static_cast<std::size_t>(B), 0);
  for (auto* g : {&m.g_a, &m.g_b, &m.g_sum, &m.g_act, &m.g_tmp}) g->assign(biggest, 0.0f);
  m.g_conv.assign(biggest, T{});
  m.g_feat.assign(static_cast<std::size_t>(B) * features, 0.0f);
  m.g_logits.assign(m.logits.size(), 0.0f);
}

// ----------------------------------------------------------------------------------------------
// conv + batch norm (+ ReLU): a.conv = conv(x), then a.act = max(0, BN(a.conv)); without the ReLU
// (a bottleneck's conv3 and projection) only the statistics, which bn_add_relu applies.

template <class T>
void conv_bn_forward(conv_bn_acts<T>& a, const T* x, const conv_bn& c, model<T>& m, bool relu, const bn_group& group,
                     bool training) {
  const int B = m.B;
  conv_forward(a.conv.data(), x, m.weight(c.w), shape_of(c, B), dtype_of<T>);
  const std::size_t N = static_cast<std::size_t>(B) * c.OH() * c.OW();
  float* rm = m.running.data() + c.run;
  float* rv = rm + c.K;
  const float* gamma = m.params.data() + c.gamma;
  const float* beta = m.params.data() + c.beta;
  if (relu)
    batchnorm_forward(a.act.data(), a.mean.data(), a.rstd.data(), &a.count, rm, rv, a.conv.data(), gamma, beta, N, c.K,
                      true, group, training, m.cfg.bn_momentum, m.cfg.bn_eps);
  else
    batchnorm_stats(a.mean.data(), a.rstd.data(), &a.count, rm, rv, a.conv.data(), N, c.K, group, training,
                    m.cfg.bn_momentum, m.cfg.bn_eps);
}

// The per-channel sums of a batch norm's backward when its first pass already made them.
struct bn_sums {
  std::vector<double> dy, dyx;  // (K): sum dy, sum dy xhat
};

// dx (null: not needed) from dout, the gradient of a.act or of BN(a.conv); writes the three
// tensors' gradients. sums: the batch norm's sums if bn_add_relu_backward_sums made them.
template <class T>
void conv_bn_backward(float* dx, const float* dout, const conv_bn_acts<T>& a, const T* x, const conv_bn& c,
                      model<T>& m, bool relu, const bn_group& group, const bn_sums* sums = nullptr) {
  const int B = m.B;
  const std::size_t N = static_cast<std::size_t>(B) * c.OH() * c.OW();
  float* dgamma = m.grads.data() + c.gamma;
  float* dbeta = m.grads.data() + c.beta;
  const float* gamma = m.params.data() + c.gamma;
  const float* beta = m.params.data() + c.beta;
  if (sums)
    batchnorm_backward_dx(m.g_conv.data(), dgamma, dbeta, sums->dy.data(), sums->dyx.data(), dout, a.conv.data(),
                          a.mean.data(), a.rstd.data(), a.count, gamma, beta, N, c.K, relu, group);
  else
    batchnorm_backward(m.g_conv.data(), dgamma, dbeta, dout, a.conv.data(), a.mean.data(), a.rstd.data(), a.count,
                       gamma, beta, N, c.K, relu, group);
  conv_backward(dx, m.grads.data() + c.w, m.g_conv.data(), x, m.weight(c.w), shape_of(c, B), dtype_of<T>);
}

// ----------------------------------------------------------------------------------------------
// bottleneck: out = max(0, BN3(conv3(r(BN2(conv2(r(BN1(conv1(x)))))))) + shortcut(x)),
// shortcut = x, or BN(conv1x1/s(x)) on the first bottleneck of a stage; BN3, the projection's BN,
// the add and the ReLU are one pass (bn_add_relu).

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
    bn_add_bn_relu_forward(a.out.data(), a.c3.conv.data(), p + bi.c3.gamma, p + bi.c3.beta, a.c3.mean.data(),
                           a.c3.rstd.data(), a.down.conv.data(), p + bi.down.gamma, p + bi.down.beta,
                           a.down.mean.data(), a.down.rstd.data(), N, bi.c3.K);
  } else {
    bn_add_relu_forward(a.out.data(), a.c3.conv.data(), p + bi.c3.gamma, p + bi.c3.beta, a.c3.mean.data(),
                        a.c3.rstd.data(), x, N, bi.c3.K);
  }
}

// The gradient of the block's input x in two parts, their sum: dx (through conv1, written here)
// and the returned shortcut part (m.g_sum for the identity, m.g_tmp through the projection),
// which the block before adds in its first pass (as its dout2) rather than in a pass of its own.
// dout + dout2 (dout2 null: dout alone) is the gradient of a.out.
template <class T>
const float* bottleneck_backward_parts(float* dx, const float* dout, const float* dout2, const block_acts<T>& a,
                                       const T* x, const block_info& bi, model<T>& m, const bn_group& group) {
  const std::size_t N = static_cast<std::size_t>(m.B) * bi.c3.OH() * bi.c3.OW();
  bn_sums s3{std::vector<double>(static_cast<std::size_t>(bi.c3.K)), std::vector<double>(static_cast<std::size_t>(bi.c3.K))};
  bn_add_relu_backward_sums(m.g_sum.data(), s3.dy.data(), s3.dyx.data(), dout, dout2, a.out.data(), a.c3.conv.data(),
                            a.c3.mean.data(), a.c3.rstd.data(), N, bi.c3.K);
  conv_bn_backward(m.g_act.data(), m.g_sum.data(), a.c3, a.c2.act.data(), bi.c3, m, false, group, &s3);
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

// Forward pass over B images (NCHW fp32, normalised); returns the mean loss of this replica's
// batch and counts top-1 and top-5 hits. training: batch statistics over `group` (running
// statistics updated); otherwise the running statistics, and `group` is not used.
template <class T>
float model_forward(model<T>& m, const float* images, const int* labels, int B, const bn_group& group, bool training,
                    int* top1 = nullptr, int* top5 = nullptr) {
  model_resize(m, B);
  const layout& L = m.L;
  const int S = m.cfg.size;
  nchw_to_nhwc(m.input.data(), images, B, 3, S, S);
  std::copy(labels, labels + B, m.labels.begin());
  conv_bn_forward(m.stem, m.input.data(), L.stem, m, true, group, training);
  maxpool3x3_forward(m.pool.data(), m.pool_which.data(), m.stem.act.data(), B, L.stem.OH(), L.stem.OW(), stem_channels);
  for (int b = 0; b < nblocks; ++b) bottleneck_forward(m.blocks[b], block_input(m, b), L.blocks[b], m, group, training);
  global_avgpool_forward(m.feat.data(), m.blocks[nblocks - 1].out.data(), B, L.final_side * L.final_side, features);
  linear_forward(m.logits.data(), m.feat.data(), m.weight(L.fc_w), m.params.data() + L.fc_b, B, features,
                 m.cfg.classes, dtype_of<T>);
  if (top5) *top5 = sample::topk_hits(m.logits.data(), m.labels.data(), B, m.cfg.classes, 5);
  return sample::softmax_xent_forward(m.probs.data(), top1, m.logits.data(), m.labels.data(), B, m.cfg.classes,
                                      training ? m.cfg.label_smoothing : 0.0f);
}

// Backward pass of the last training forward: writes every gradient of m.grads (the gradient of
// this replica's mean loss) and calls bucket_ready(b) as soon as bucket b is final: the classifier
// (nblocks + 1) first, then bottlenecks nblocks-1 .. 0 (buckets nblocks .. 1), the stem (0) last.
template <class T>
void model_backward(model<T>& m, const bn_group& group, const std::function<void(int)>& bucket_ready = {}) {
  const int B = m.B;
  const layout& L = m.L;
  sample::softmax_xent_backward(m.g_logits.data(), m.probs.data(), m.labels.data(), B, m.cfg.classes,
                                m.cfg.label_smoothing);
  linear_backward(m.g_feat.data(), m.grads.data() + L.fc_w, m.grads.data() + L.fc_b, m.g_logits.data(), m.feat.data(),
                  m.weight(L.fc_w), B, features, m.cfg.classes, dtype_of<T>);
  if (bucket_ready) bucket_ready(nblocks + 1);
  float* dout = m.g_a.data();  // gradient of the current block's output
  float* dinp = m.g_b.data();  // gradient of its input
  global_avgpool_backward(dout, m.g_feat.data(), B, L.final_side * L.final_side, features);
  const float* dshort = nullptr;  // the shortcut's part of dout (dout + dshort is the whole gradient)
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

}  // namespace resnet
