// samples/fashion_cnn/layers_cpu.hpp: the layers of the Fashion-MNIST CNN on the CPU, one free
// function per layer and direction, outputs first.
//
// Purpose: the arithmetic of the sample, kept apart from the model's wiring (model.hpp) and from
// the trainer. Convolution and the linear layer run on oneDNN; batch norm, ReLU and the loss are
// own kernels because oneDNN has no batch norm whose statistics span several replicas (Ying et al.
// 2018), and no loss; max pooling is own because oneDNN's plain-NCHW pooling is slow (see there).
// Batch norm and max pooling split their channels (planes) over the OpenMP threads; each channel's
// arithmetic is the same whatever the thread count, so runs stay bit-identical across --threads.
// Limits: fp32, NCHW activations, 3x3 convolutions with stride 1 and padding 1, 2x2 max pooling
// with stride 2 (odd sizes round up: the last row/column pools over what exists). oneDNN
// primitives are built once per shape and thread (thread_local cache), so replicas running as
// threads never share a primitive or its scratchpad.
//
// Shape legend:
//   B   images in the batch (of this replica)      C  input channels      K  output channels
//   H,W height and width of the input              F  features into the classifier
//   NC  classes (10)                               G  replicas of a batch-norm group
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <stdexcept>
#include <vector>

#include "../common/layers_dnnl.hpp"
#include "../common/softmax_xent.hpp"
#include "layers_math.hpp"

namespace fashion {

// ----------------------------------------------------------------------------------------------
// oneDNN plumbing (one engine and stream per thread, memory descriptors): samples/common/layers_dnnl.hpp.

using sample::dims;
using sample::dnnl_ctx;
using sample::f32;
using sample::md;
using sample::mem;
using sample::shape_key;
using sample::tag;

// ----------------------------------------------------------------------------------------------
// conv3x3: out = conv(inp, weight), stride 1, padding 1, no bias (batch norm follows).

struct conv_prims {
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  dnnl::memory::desc src, wei, dst;
};

inline conv_prims& conv_lookup(int B, int C, int H, int W, int K) {
  thread_local std::map<shape_key, conv_prims> cache;
  const shape_key key{B, C, H, W, K, 0};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto& eng = dnnl_ctx().engine;
  conv_prims p;
  p.src = md({B, C, H, W}, tag::nchw);
  p.wei = md({K, C, 3, 3}, tag::oihw);
  p.dst = md({B, K, H, W}, tag::nchw);
  const dims stride{1, 1}, pad{1, 1};
  using namespace dnnl;
  convolution_forward::desc fd(prop_kind::forward_training, algorithm::convolution_direct, p.src, p.wei, p.dst,
                               stride, pad, pad);
  p.fwd_pd = convolution_forward::primitive_desc(fd, eng);
  p.fwd = convolution_forward(p.fwd_pd);
  convolution_backward_data::desc bd(algorithm::convolution_direct, p.src, p.wei, p.dst, stride, pad, pad);
  p.bwd_data = convolution_backward_data(convolution_backward_data::primitive_desc(bd, eng, p.fwd_pd));
  convolution_backward_weights::desc bw(algorithm::convolution_direct, p.src, p.wei, p.dst, stride, pad, pad);
  p.bwd_weights = convolution_backward_weights(convolution_backward_weights::primitive_desc(bw, eng, p.fwd_pd));
  return cache.emplace(key, std::move(p)).first->second;
}

inline void conv_forward(float* out,           // (B, K, H, W)
                         const float* inp,     // (B, C, H, W)
                         const float* weight,  // (K, C, 3, 3)
                         int B, int C, int H, int W, int K) {
  auto& p = conv_lookup(B, C, H, W, K);
  p.fwd.execute(dnnl_ctx().stream, {{DNNL_ARG_SRC, mem(p.src, inp)},
                                    {DNNL_ARG_WEIGHTS, mem(p.wei, weight)},
                                    {DNNL_ARG_DST, mem(p.dst, out)}});
  dnnl_ctx().stream.wait();
}

inline void conv_backward(float* dinp,          // (B, C, H, W), or null: not needed (first layer)
                          float* dweight,       // (K, C, 3, 3), overwritten
                          const float* dout,    // (B, K, H, W)
                          const float* inp,     // (B, C, H, W), as in the forward pass
                          const float* weight,  // (K, C, 3, 3)
                          int B, int C, int H, int W, int K) {
  auto& p = conv_lookup(B, C, H, W, K);
  auto& s = dnnl_ctx().stream;
  p.bwd_weights.execute(s, {{DNNL_ARG_SRC, mem(p.src, inp)},
                            {DNNL_ARG_DIFF_DST, mem(p.dst, dout)},
                            {DNNL_ARG_DIFF_WEIGHTS, mem(p.wei, dweight)}});
  if (dinp)
    p.bwd_data.execute(s, {{DNNL_ARG_DIFF_DST, mem(p.dst, dout)},
                           {DNNL_ARG_WEIGHTS, mem(p.wei, weight)},
                           {DNNL_ARG_DIFF_SRC, mem(p.src, dinp)}});
  s.wait();
}

// ----------------------------------------------------------------------------------------------
// maxpool2x2: out = max over 2x2 windows, stride 2; an odd size rounds up (the last row/column
// pools over what exists). The workspace keeps which of the four cells won (0..3), one byte per
// output, for the backward pass. Own kernel: oneDNN 2.6 pools plain NCHW with its reference-like
// simple_nchw implementation, measured at 27 ms for (64, 32, 28, 28) on one core of this machine,
// a third of the whole training step; this loop takes about 1 ms.


inline void maxpool_forward(float* out,         // (B, C, ceil(H/2), ceil(W/2))
                            void* workspace,    // maxpool_workspace_bytes(B, C, H, W): argmax 0..3
                            const float* inp,   // (B, C, H, W)
                            int B, int C, int H, int W) {
  const int OH = pooled(H), OW = pooled(W);
  auto* arg = static_cast<std::uint8_t*>(workspace);
#pragma omp parallel for schedule(static)
  for (int bc = 0; bc < B * C; ++bc) {
    const float* x = inp + static_cast<std::size_t>(bc) * H * W;
    float* y = out + static_cast<std::size_t>(bc) * OH * OW;
    std::uint8_t* a = arg + static_cast<std::size_t>(bc) * OH * OW;
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox) y[oy * OW + ox] = maxpool_cell(x, H, W, oy, ox, &a[oy * OW + ox]);
  }
}

inline void maxpool_backward(float* dinp,            // (B, C, H, W), overwritten
                             const float* dout,      // (B, C, ceil(H/2), ceil(W/2))
                             const void* workspace,  // from maxpool_forward
                             int B, int C, int H, int W) {
  const int OH = pooled(H), OW = pooled(W);
  const auto* arg = static_cast<const std::uint8_t*>(workspace);
#pragma omp parallel for schedule(static)
  for (int bc = 0; bc < B * C; ++bc) {
    float* dx = dinp + static_cast<std::size_t>(bc) * H * W;
    std::fill(dx, dx + static_cast<std::size_t>(H) * W, 0.0f);
    const float* dy = dout + static_cast<std::size_t>(bc) * OH * OW;
    const std::uint8_t* a = arg + static_cast<std::size_t>(bc) * OH * OW;
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox) dx[maxpool_source(W, oy, ox, a[oy * OW + ox])] = dy[oy * OW + ox];
  }
}

// ----------------------------------------------------------------------------------------------
// linear: out = inp weight^T + bias (samples/common/layers_dnnl.hpp, shared with ResNet-50).

using sample::linear_backward;
using sample::linear_forward;

// ----------------------------------------------------------------------------------------------
// batchnorm_relu: out = max(0, gamma (x - mean) rstd + beta), statistics over the batch of a group
// of G replicas (own kernel).
//
// Forward: each replica computes its per-channel (n, mean, M2) in two passes, the group gathers
// them (G (2K + 1) floats) and every replica merges them in rank order with Chan's formula
//   n = na + nb,  d = mean_b - mean_a,  mean = mean_a + d nb / n,  M2 = M2a + M2b + d^2 na nb / n
// so all replicas of a group hold bit-identical statistics. Backward: the group sums the
// per-channel sum(dy) and sum(dy * xhat) (2K floats), and
//   dx = gamma rstd (dy - sum(dy) / n - xhat sum(dy * xhat) / n)
// with n and the sums over the group. G = 1 is plain batch norm. dgamma and dbeta are this
// replica's own sums: they are gradients of its own loss and are averaged with the others' later.


inline void batchnorm_relu_forward(float* out,           // (B, K, HW)
                                   float* mean,          // (K), saved for backward
                                   float* rstd,          // (K), saved for backward
                                   float* count,         // (1), images*HW of the group, saved
                                   float* running_mean,  // (K), updated when training
                                   float* running_var,   // (K), updated when training
                                   const float* inp,     // (B, K, HW)
                                   const float* gamma,   // (K)
                                   const float* beta,    // (K)
                                   int B, int K, int HW,
                                   const bn_group& group,
                                   bool training,        // false: normalise with the running statistics
                                   float momentum = 0.1f, float eps = 1e-5f) {
  const std::size_t plane = static_cast<std::size_t>(HW), img = static_cast<std::size_t>(K) * plane;
  if (training) {
    // stats = (n, mean[K], M2[K]) of this replica.
    std::vector<float> stats(1 + 2 * static_cast<std::size_t>(K));
    stats[0] = static_cast<float>(B) * HW;
#pragma omp parallel for schedule(static)
    for (int k = 0; k < K; ++k) {
      // Each plane (at most 28 x 28 values) is summed in float, vectorised by omp simd; planes in double.
      double s = 0;
      for (int b = 0; b < B; ++b) {
        const float* x = inp + b * img + k * plane;
        float ps = 0;
#pragma omp simd reduction(+ : ps)
        for (std::size_t i = 0; i < plane; ++i) ps += x[i];
        s += ps;
      }
      const double m = s / stats[0];
      const float mf = static_cast<float>(m);
      double m2 = 0;
      for (int b = 0; b < B; ++b) {
        const float* x = inp + b * img + k * plane;
        float ps = 0;
#pragma omp simd reduction(+ : ps)
        for (std::size_t i = 0; i < plane; ++i) ps += (x[i] - mf) * (x[i] - mf);
        m2 += ps;
      }
      stats[1 + k] = static_cast<float>(m);
      stats[1 + K + k] = static_cast<float>(m2);
    }
    std::vector<float> all = stats;  // G rows of (n, mean, M2)
    if (group.size > 1) {
      all.resize(stats.size() * static_cast<std::size_t>(group.size));
      group.all_gather(stats, all);
    }
    bn_merge_stats(mean, rstd, count, running_mean, running_var, all, group.size, K, momentum, eps);
  } else {
    for (int k = 0; k < K; ++k) {
      mean[k] = running_mean[k];
      rstd[k] = 1.0f / std::sqrt(running_var[k] + eps);
    }
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int k = 0; k < K; ++k) {
      const float* x = inp + b * img + k * plane;
      float* y = out + b * img + k * plane;
      const bn_affine f = bn_fold(gamma[k], beta[k], mean[k], rstd[k]);
      for (std::size_t i = 0; i < plane; ++i) y[i] = bn_relu(x[i], f);
    }
}

inline void batchnorm_relu_backward(float* dinp,         // (B, K, HW), overwritten
                                    float* dgamma,       // (K), overwritten: this replica's sum
                                    float* dbeta,        // (K), overwritten: this replica's sum
                                    const float* dout,   // (B, K, HW): gradient after the ReLU
                                    const float* inp,    // (B, K, HW): the forward input
                                    const float* mean,   // (K) from forward
                                    const float* rstd,   // (K) from forward
                                    float count,         // from forward
                                    const float* gamma,  // (K)
                                    const float* beta,   // (K)
                                    int B, int K, int HW,
                                    const bn_group& group) {
  const std::size_t plane = static_cast<std::size_t>(HW), img = static_cast<std::size_t>(K) * plane;
  // sums = (sum dy[K], sum dy*xhat[K]) where dy is the gradient before the ReLU.
  std::vector<float> sums(2 * static_cast<std::size_t>(K));
#pragma omp parallel for schedule(static)
  for (int k = 0; k < K; ++k) {
    double sdy = 0, sdyx = 0;
    const bn_affine f = bn_fold(gamma[k], beta[k], mean[k], rstd[k]);
    for (int b = 0; b < B; ++b) {
      const float* x = inp + b * img + k * plane;
      const float* g = dout + b * img + k * plane;
      float ps = 0, psx = 0;  // per plane in float (vectorises), across planes in double
#pragma omp simd reduction(+ : ps, psx)
      for (std::size_t i = 0; i < plane; ++i) {
        const float dy = bn_relu_dy(x[i], g[i], f);
        ps += dy;
        psx += dy * bn_xhat(x[i], mean[k], rstd[k]);
      }
      sdy += ps;
      sdyx += psx;
    }
    sums[k] = static_cast<float>(sdy);
    sums[K + k] = static_cast<float>(sdyx);
    dbeta[k] = sums[k];
    dgamma[k] = sums[K + k];
  }
  if (group.size > 1) group.sum(sums);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int k = 0; k < K; ++k) {
      const bn_affine f = bn_fold(gamma[k], beta[k], mean[k], rstd[k]);
      const float mdy = sums[k] / count, mdyx = sums[K + k] / count;
      const float* x = inp + b * img + k * plane;
      const float* g = dout + b * img + k * plane;
      float* dx = dinp + b * img + k * plane;
      for (std::size_t i = 0; i < plane; ++i) dx[i] = bn_relu_dx(x[i], g[i], f, mean[k], rstd[k], mdy, mdyx);
    }
}

// ----------------------------------------------------------------------------------------------
// softmax cross-entropy with label smoothing (samples/common/softmax_xent.hpp).

using sample::softmax_xent_backward;
using sample::softmax_xent_forward;

}  // namespace fashion
