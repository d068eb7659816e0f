// samples/resnet50/layers_cpu.hpp: the layers of ResNet-50 on the CPU, one free function per layer
// and direction, outputs first.
//
// Purpose: the arithmetic of the sample, apart from the model's wiring (model.hpp). Convolutions
// and the classifier run on oneDNN (samples/common/layers_dnnl.hpp); batch norm is an own kernel
// because its statistics span a group of replicas (samples/common/batch_norm.hpp, as the Fashion
// sample's), and so are the ReLU, residual add, 3x3 max pooling and global average pooling, which
// are a pass over memory each. A bottleneck's last batch norm, its residual add and the ReLU are
// one pass (bn_add_relu), forward and in backward's first pass. Batch norm's per-channel sums were first split by blocks of 16
// channels, each thread walking every row: 27% of a 224x224 batch-16 step (perf); summed by rows of
// all K channels in chunks they take 4%.
// Activations are NHWC (channels innermost): oneDNN's AVX-512 convolutions take it directly, and
// the per-channel kernels here vectorise over channels. T is the type convolutions read (float, or
// bf16 stored as std::uint16_t under --precision bf16); convolutions write fp32, batch norm reads
// fp32 and writes T, and every activation gradient is fp32 except a convolution's output gradient
// (T, what the bf16 primitives take).
// Limits: square kernels with padding R/2; max pooling 3x3 stride 2 padding 1 only. Primitives are
// built once per shape and thread (thread_local cache), as in the Fashion sample.
//
// Shape legend:
//   B  images of this replica     H,W input height, width      OH,OW output height, width
//   C  input channels             K   output channels          R   kernel side
//   N  rows of an NHWC tensor: B*H*W                           G   replicas of a batch-norm group
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <vector>

#include "../common/batch_norm.hpp"
#include "../common/layers_dnnl.hpp"
#include "../common/softmax_xent.hpp"

namespace resnet {

using sample::bf16;
using sample::bn_group;
using sample::dims;
using sample::dnnl_ctx;
using sample::dtype;
using sample::f32;
using sample::linear_backward;
using sample::linear_forward;
using sample::md;
using sample::mem;
using sample::tag;
using bf16_t = std::uint16_t;  // bf16 bits

template <class T>
constexpr dtype dtype_of = std::is_same_v<T, float> ? f32 : bf16;

template <class T>
inline T store_as(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return sample::to_bf16(x);
}
inline float load(float x) { return x; }
inline float load(bf16_t x) { return sample::from_bf16(x); }

// ----------------------------------------------------------------------------------------------
// conv: out = conv(inp, weight), R x R kernel, stride S, padding R/2, no bias (batch norm follows).
// Weights are kept OIHW (torch's layout, the flat parameter block's); oneDNN runs its own blocked
// weight format, so each call reorders them in (and the weight gradient out): 2 bytes/parameter
// of traffic per use, against a convolution's B*OH*OW*C*R*R multiply-adds.

struct conv_shape {
  int B, C, H, W, K, R, S;
  int OH() const { return (H + 2 * (R / 2) - R) / S + 1; }
  int OW() const { return (W + 2 * (R / 2) - R) / S + 1; }
};

struct conv_prims {
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  dnnl::memory::desc src, dst, ddst, dsrc, wei_user, dwei_user;          // ours: NHWC, OIHW
  dnnl::memory::desc wei_fwd, wei_bwd, dwei;                             // oneDNN's choice
  dnnl::memory wei_fwd_m, wei_bwd_m, dwei_m;                             // reorder targets
  dnnl::reorder to_fwd, to_bwd, from_dwei;                               // empty when formats match
  std::string impl;                                                      // what oneDNN picked
};

inline conv_prims& conv_lookup(const conv_shape& s, dtype dt) {
  thread_local std::map<std::array<int, 8>, conv_prims> cache;
  const std::array<int, 8> key{s.B, s.C, s.H, s.W, s.K, s.R, s.S, static_cast<int>(dt)};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  using namespace dnnl;
  auto& eng = dnnl_ctx().engine;
  conv_prims p;
  const int P = s.R / 2;
  p.src = md({s.B, s.C, s.H, s.W}, tag::nhwc, dt);
  p.dst = md({s.B, s.K, s.OH(), s.OW()}, tag::nhwc, f32);
  p.ddst = md({s.B, s.K, s.OH(), s.OW()}, tag::nhwc, dt);
  p.dsrc = md({s.B, s.C, s.H, s.W}, tag::nhwc, f32);
  p.wei_user = md({s.K, s.C, s.R, s.R}, tag::oihw, dt);
  p.dwei_user = md({s.K, s.C, s.R, s.R}, tag::oihw, f32);
  const auto wany = md({s.K, s.C, s.R, s.R}, tag::any, dt), dwany = md({s.K, s.C, s.R, s.R}, tag::any, f32);
  const dims stride{s.S, s.S}, pad{P, P};
  convolution_forward::desc fd(prop_kind::forward_training, algorithm::convolution_direct, p.src, wany, p.dst, stride,
                               pad, pad);
  convolution_forward::primitive_desc fpd(fd, eng);
  p.fwd = convolution_forward(fpd);
  convolution_backward_data::desc bd(algorithm::convolution_direct, p.dsrc, wany, p.ddst, stride, pad, pad);
  convolution_backward_data::primitive_desc bpd(bd, eng, fpd);
  p.bwd_data = convolution_backward_data(bpd);
  convolution_backward_weights::desc bw(algorithm::convolution_direct, p.src, dwany, p.ddst, stride, pad, pad);
  convolution_backward_weights::primitive_desc wpd(bw, eng, fpd);
  p.bwd_weights = convolution_backward_weights(wpd);
  p.wei_fwd = fpd.weights_desc();
  p.wei_bwd = bpd.weights_desc();
  p.dwei = wpd.diff_weights_desc();
  if (p.wei_fwd != p.wei_user) {
    p.wei_fwd_m = memory(p.wei_fwd, eng);
    p.to_fwd = reorder(memory(p.wei_user, eng, nullptr), p.wei_fwd_m);
  }
  if (p.wei_bwd != p.wei_user) {
    p.wei_bwd_m = memory(p.wei_bwd, eng);
    p.to_bwd = reorder(memory(p.wei_user, eng, nullptr), p.wei_bwd_m);
  }
  if (p.dwei != p.dwei_user) {
    p.dwei_m = memory(p.dwei, eng);
    p.from_dwei = reorder(p.dwei_m, memory(p.dwei_user, eng, nullptr));
  }
  p.impl = std::string(fpd.impl_info_str()) + " / " + bpd.impl_info_str() + " / " + wpd.impl_info_str();
  return cache.emplace(key, std::move(p)).first->second;
}

// The weights in the format primitive `target` wants: `user` itself, or reordered into `m`.
inline dnnl::memory weights_for(const dnnl::reorder& to, dnnl::memory& m, const dnnl::memory::desc& user,
                                const void* weight) {
  if (!to) return mem(user, weight);
  to.execute(dnnl_ctx().stream, {{DNNL_ARG_FROM, mem(user, weight)}, {DNNL_ARG_TO, m}});
  return m;
}

inline void conv_forward(float* out,          // (B, OH, OW, K) fp32
                         const void* inp,     // (B, H, W, C) of dt
                         const void* weight,  // (K, C, R, R) of dt
                         const conv_shape& s, dtype dt = f32) {
  auto& p = conv_lookup(s, dt);
  auto& st = dnnl_ctx().stream;
  const dnnl::memory w = weights_for(p.to_fwd, p.wei_fwd_m, p.wei_user, weight);
  p.fwd.execute(st, {{DNNL_ARG_SRC, mem(p.src, inp)}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, mem(p.dst, out)}});
  st.wait();
}

inline void conv_backward(float* dinp,         // (B, H, W, C) fp32, overwritten; or null (not needed)
                          float* dweight,      // (K, C, R, R) fp32, overwritten
                          const void* dout,    // (B, OH, OW, K) of dt
                          const void* inp,     // (B, H, W, C) of dt, as in the forward pass
                          const void* weight,  // (K, C, R, R) of dt
                          const conv_shape& s, dtype dt = f32) {
  auto& p = conv_lookup(s, dt);
  auto& st = dnnl_ctx().stream;
  const dnnl::memory dw = p.from_dwei ? p.dwei_m : mem(p.dwei_user, dweight);
  p.bwd_weights.execute(st, {{DNNL_ARG_SRC, mem(p.src, inp)}, {DNNL_ARG_DIFF_DST, mem(p.ddst, dout)},
                             {DNNL_ARG_DIFF_WEIGHTS, dw}});
  if (p.from_dwei) p.from_dwei.execute(st, {{DNNL_ARG_FROM, p.dwei_m}, {DNNL_ARG_TO, mem(p.dwei_user, dweight)}});
  if (dinp) {
    const dnnl::memory w = weights_for(p.to_bwd, p.wei_bwd_m, p.wei_user, weight);
    p.bwd_data.execute(st, {{DNNL_ARG_DIFF_DST, mem(p.ddst, dout)}, {DNNL_ARG_WEIGHTS, w},
                            {DNNL_ARG_DIFF_SRC, mem(p.dsrc, dinp)}});
  }
  st.wait();
}

// What oneDNN runs for this convolution (forward / backward data / backward weights).
inline const std::string& conv_impl(const conv_shape& s, dtype dt) { return conv_lookup(s, dt).impl; }

// ----------------------------------------------------------------------------------------------
// Per-channel sums over the rows of an NHWC tensor: each row is K contiguous channels, so a row
// vectorises across channels. Rows are taken in fixed chunks of 64 (summed in float, the chunks in
// parallel), the chunks' partial sums then added in chunk order in double: the result is the same
// whatever the thread count, so a run is bit-identical under --threads 1 and 2.

constexpr std::size_t sum_chunk = 64;

template <class F>
void for_rows(std::size_t N, F&& f) {
#pragma omp parallel for schedule(static)
  for (std::ptrdiff_t r = 0; r < static_cast<std::ptrdiff_t>(N); ++r) f(static_cast<std::size_t>(r));
}

// s1[k] = sum over rows of u, s2[k] = sum of v, where f(i, k, u, v) adds element i's (channel k) terms.
template <class F>
void channel_sums(double* s1, double* s2, std::size_t N, int K, F&& f) {
  const std::size_t nch = (N + sum_chunk - 1) / sum_chunk, w = 2 * static_cast<std::size_t>(K);
  std::vector<float> part(nch * w);  // (chunk, 2, K)
#pragma omp parallel for schedule(static)
  for (std::ptrdiff_t ch = 0; ch < static_cast<std::ptrdiff_t>(nch); ++ch) {
    float* p1 = part.data() + static_cast<std::size_t>(ch) * w;
    float* p2 = p1 + K;
    const std::size_t r1 = std::min(N, (static_cast<std::size_t>(ch) + 1) * sum_chunk);
    for (std::size_t r = static_cast<std::size_t>(ch) * sum_chunk; r < r1; ++r) {
      const std::size_t base = r * static_cast<std::size_t>(K);
#pragma omp simd
      for (int k = 0; k < K; ++k) f(base + static_cast<std::size_t>(k), k, p1[k], p2[k]);
    }
  }
#pragma omp parallel for schedule(static)
  for (int k = 0; k < K; ++k) {
    double a = 0, b = 0;
    for (std::size_t ch = 0; ch < nch; ++ch) a += part[ch * w + static_cast<std::size_t>(k)], b += part[ch * w + K + k];
    s1[k] = a, s2[k] = b;
  }
}

// channel_moments: the per-channel mean and M2 = sum (x - mean)^2 of the rows of an NHWC tensor in
// one pass over memory: each chunk of sum_chunk rows (K floats each, in cache after the first
// sweep) gets its own mean and M2 from two sweeps, and the chunks are merged in chunk order in
// double, M2 = sum_c [M2_c + n_c (mean_c - mean)^2]; thread-count independent, as channel_sums.
// (Two sweeps over the whole tensor, the mean's then M2's, read it from memory twice.)
inline void channel_moments(float* mean,  // (K)
                            float* M2,    // (K)
                            const float* x, std::size_t N, int K) {
  const std::size_t nch = (N + sum_chunk - 1) / sum_chunk, w = 2 * static_cast<std::size_t>(K);
  std::vector<float> part(nch * w);  // (chunk, mean[K], M2[K])
#pragma omp parallel for schedule(static)
  for (std::ptrdiff_t ch = 0; ch < static_cast<std::ptrdiff_t>(nch); ++ch) {
    float* pm = part.data() + static_cast<std::size_t>(ch) * w;
    float* pq = pm + K;
    const std::size_t r0 = static_cast<std::size_t>(ch) * sum_chunk, r1 = std::min(N, r0 + sum_chunk);
    std::fill(pm, pm + w, 0.0f);
    for (std::size_t r = r0; r < r1; ++r) {
      const float* xr = x + r * static_cast<std::size_t>(K);
#pragma omp simd
      for (int k = 0; k < K; ++k) pm[k] += xr[k];
    }
    const float inv = 1.0f / static_cast<float>(r1 - r0);
    for (int k = 0; k < K; ++k) pm[k] *= inv;
    for (std::size_t r = r0; r < r1; ++r) {
      const float* xr = x + r * static_cast<std::size_t>(K);
#pragma omp simd
      for (int k = 0; k < K; ++k) {
        const float d = xr[k] - pm[k];
        pq[k] += d * d;
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int k = 0; k < K; ++k) {
    double s = 0;
    for (std::size_t ch = 0; ch < nch; ++ch)
      s += static_cast<double>(std::min(sum_chunk, N - ch * sum_chunk)) * part[ch * w + static_cast<std::size_t>(k)];
    const double mu = s / static_cast<double>(N);
    double q = 0;
    for (std::size_t ch = 0; ch < nch; ++ch) {
      const double d = part[ch * w + static_cast<std::size_t>(k)] - mu;
      q += part[ch * w + K + k] + static_cast<double>(std::min(sum_chunk, N - ch * sum_chunk)) * d * d;
    }
    mean[k] = static_cast<float>(mu), M2[k] = static_cast<float>(q);
  }
}

// ----------------------------------------------------------------------------------------------
// batchnorm (+ ReLU): out = [max(0,] gamma (x - mean) rstd + beta [)], statistics over the rows of
// a group of G replicas (the merge is samples/common/batch_norm.hpp's, as in the Fashion sample).
// batchnorm_stats is its first half (the bottleneck's last batch norms apply theirs inside
// bn_add_relu_forward), bn_coefficients the folded a = gamma rstd, c = beta - mean a.

inline void batchnorm_stats(float* mean,          // (K), saved for backward
                            float* rstd,          // (K), saved for backward
                            float* count,         // (1), rows of the group, saved
                            float* running_mean,  // (K), updated when training
                            float* running_var,   // (K), updated when training
                            const float* inp,     // (N, K) fp32 (a convolution's output)
                            std::size_t N, int K, const bn_group& group, bool training, float momentum = 0.1f,
                            float eps = 1e-5f) {
  if (!training) {
    for (int k = 0; k < K; ++k) {
      mean[k] = running_mean[k];
      rstd[k] = 1.0f / std::sqrt(running_var[k] + eps);
    }
    return;
  }
  std::vector<float> stats(1 + 2 * static_cast<std::size_t>(K));  // (n, mean[K], M2[K]) of this replica
  stats[0] = static_cast<float>(N);
  channel_moments(stats.data() + 1, stats.data() + 1 + K, inp, N, K);
  std::vector<float> all = stats;  // G rows of (n, mean, M2)
  if (group.size > 1) {
    all.resize(stats.size() * static_cast<std::size_t>(group.size));
    group.all_gather(stats, all);
  }
  sample::bn_merge_stats(mean, rstd, count, running_mean, running_var, all, group.size, K, momentum, eps);
}

inline void bn_coefficients(float* a, float* c, const float* gamma, const float* beta, const float* mean,
                            const float* rstd, int K) {
  for (int k = 0; k < K; ++k) {
    const sample::bn_affine f = sample::bn_fold(gamma[k], beta[k], mean[k], rstd[k]);
    a[k] = f.a, c[k] = f.c;
  }
}

template <class T>
void batchnorm_forward(T* out,               // (N, K) of T
                       float* mean,          // (K), saved for backward
                       float* rstd,          // (K), saved for backward
                       float* count,         // (1), rows of the group, saved
                       float* running_mean,  // (K), updated when training
                       float* running_var,   // (K), updated when training
                       const float* inp,     // (N, K) fp32 (a convolution's output)
                       const float* gamma,   // (K)
                       const float* beta,    // (K)
                       std::size_t N, int K, bool relu, const bn_group& group, bool training,
                       float momentum = 0.1f, float eps = 1e-5f) {
  batchnorm_stats(mean, rstd, count, running_mean, running_var, inp, N, K, group, training, momentum, eps);
  std::vector<float> a(static_cast<std::size_t>(K)), c(static_cast<std::size_t>(K));
  bn_coefficients(a.data(), c.data(), gamma, beta, mean, rstd, K);
  const float lo = relu ? 0.0f : -INFINITY;
  for_rows(N, [&](std::size_t r) {
    const float* x = inp + r * K;
    T* y = out + r * K;
#pragma omp simd
    for (int k = 0; k < K; ++k) y[k] = store_as<T>(std::max(lo, x[k] * a[k] + c[k]));
  });
}

// Batch norm's backward after its per-channel sums: sdy = sum dy, sdyx = sum dy xhat over this
// replica's rows (dy: the gradient before the ReLU); writes dgamma, dbeta (this replica's sums),
// sums them over the group and writes dinp.
template <class T>
void batchnorm_backward_dx(T* dinp,             // (N, K) of T, overwritten (a convolution's output gradient)
                           float* dgamma,       // (K), overwritten: this replica's sum
                           float* dbeta,        // (K), overwritten: this replica's sum
                           const double* sdy,   // (K)
                           const double* sdyx,  // (K)
                           const float* dout,   // (N, K): gradient of the output (after the ReLU)
                           const float* inp,    // (N, K): the forward input
                           const float* mean,   // (K) from forward
                           const float* rstd,   // (K) from forward
                           float count,         // from forward
                           const float* gamma,  // (K)
                           const float* beta,   // (K)
                           std::size_t N, int K, bool relu, const bn_group& group) {
  std::vector<float> a(static_cast<std::size_t>(K)), c(static_cast<std::size_t>(K));
  bn_coefficients(a.data(), c.data(), gamma, beta, mean, rstd, K);
  std::vector<float> sums(2 * static_cast<std::size_t>(K));  // (sum dy[K], sum dy*xhat[K])
  for (int k = 0; k < K; ++k) {
    sums[k] = static_cast<float>(sdy[k]);
    sums[K + k] = static_cast<float>(sdyx[k]);
    dbeta[k] = sums[k];
    dgamma[k] = sums[K + k];
  }
  if (group.size > 1) group.sum(sums);
  std::vector<float> mdy(static_cast<std::size_t>(K)), mdyx(static_cast<std::size_t>(K));
  for (int k = 0; k < K; ++k) mdy[k] = sums[k] / count, mdyx[k] = sums[K + k] / count;
  for_rows(N, [&](std::size_t r) {
    const std::size_t base = r * K;
    T* dx = dinp + base;
#pragma omp simd
    for (int k = 0; k < K; ++k) {
      const std::size_t i = base + k;
      const float g = !relu || inp[i] * a[k] + c[k] > 0.0f ? dout[i] : 0.0f;
      dx[k] = store_as<T>(a[k] * (g - mdy[k] - sample::bn_xhat(inp[i], mean[k], rstd[k]) * mdyx[k]));
    }
  });
}

template <class T>
void batchnorm_backward(T* dinp,             // (N, K) of T, overwritten (a convolution's output gradient)
                        float* dgamma,       // (K), overwritten: this replica's sum
                        float* dbeta,        // (K), overwritten: this replica's sum
                        const float* dout,   // (N, K): gradient of the output (after the ReLU)
                        const float* inp,    // (N, K): the forward input
                        const float* mean,   // (K) from forward
                        const float* rstd,   // (K) from forward
                        float count,         // from forward
                        const float* gamma,  // (K)
                        const float* beta,   // (K)
                        std::size_t N, int K, bool relu, const bn_group& group) {
  std::vector<float> a(static_cast<std::size_t>(K)), c(static_cast<std::size_t>(K));
  bn_coefficients(a.data(), c.data(), gamma, beta, mean, rstd, K);
  std::vector<double> sdy(static_cast<std::size_t>(K)), sdyx(static_cast<std::size_t>(K));
  channel_sums(sdy.data(), sdyx.data(), N, K, [&](std::size_t i, int k, float& u, float& v) {
    const float dy = !relu || inp[i] * a[k] + c[k] > 0.0f ? dout[i] : 0.0f;  // the gradient before the ReLU
    u += dy;
    v += dy * sample::bn_xhat(inp[i], mean[k], rstd[k]);
  });
  batchnorm_backward_dx(dinp, dgamma, dbeta, sdy.data(), sdyx.data(), dout, inp, mean, rstd, count, gamma, beta, N, K,
                        relu, group);
}

// ----------------------------------------------------------------------------------------------
// bn_add_relu: out = max(0, BN(x) + shortcut), the end of a bottleneck in one pass over memory
// (batch norm's apply, the residual add and the ReLU were three): shortcut = the block's input
// (identity), or BN_d(xd), the projection's batch norm. The statistics are batchnorm_stats'.

template <class T>
void bn_add_relu_forward(T* out,              // (N, K) of T
                         const float* x,      // (N, K): the last convolution's output
                         const float* gamma,  // (K)
                         const float* beta,   // (K)
                         const float* mean,   // (K)
                         const float* rstd,   // (K)
                         const T* shortcut,   // (N, K): the block's input
                         std::size_t N, int K) {
  std::vector<float> a(static_cast<std::size_t>(K)), c(static_cast<std::size_t>(K));
  bn_coefficients(a.data(), c.data(), gamma, beta, mean, rstd, K);
  for_rows(N, [&](std::size_t r) {
    const std::size_t base = r * K;
#pragma omp simd
    for (int k = 0; k < K; ++k)
      out[base + k] = store_as<T>(std::max(0.0f, x[base + k] * a[k] + c[k] + load(shortcut[base + k])));
  });
}

template <class T>
void bn_add_bn_relu_forward(T* out,              // (N, K) of T
                            const float* x,      // (N, K): the last convolution's output
                            const float* gamma,  // (K)
                            const float* beta,   // (K)
                            const float* mean,   // (K)
                            const float* rstd,   // (K)
                            const float* xd,     // (N, K): the projection's convolution output
                            const float* gd,     // (K): its batch norm's scale, shift, mean, rstd
                            const float* bd, const float* md, const float* rd, std::size_t N, int K) {
  std::vector<float> a(static_cast<std::size_t>(K)), c(static_cast<std::size_t>(K));
  std::vector<float> ad(static_cast<std::size_t>(K)), cd(static_cast<std::size_t>(K));
  bn_coefficients(a.data(), c.data(), gamma, beta, mean, rstd, K);
  bn_coefficients(ad.data(), cd.data(), gd, bd, md, rd, K);
  for_rows(N, [&](std::size_t r) {
    const std::size_t base = r * K;
#pragma omp simd
    for (int k = 0; k < K; ++k)
      out[base + k] = store_as<T>(std::max(0.0f, x[base + k] * a[k] + c[k] + xd[base + k] * ad[k] + cd[k]));
  });
}

// Its backward's first pass: g = dout (+ dout2) where out > 0 (the gradient of both summands),
// and the sums of the main path's batch norm, sdy = sum g and sdyx = sum g xhat
// (batchnorm_backward_dx finishes it; the shortcut takes g). dout2, when not null, is a second
// part of out's gradient (the next block's shortcut gradient), added here instead of in a pass
// of its own.
template <class T>
void bn_add_relu_backward_sums(float* g,            // (N, K), overwritten; may be dout2 itself
                               double* sdy,         // (K), overwritten
                               double* sdyx,        // (K), overwritten
                               const float* dout,   // (N, K): gradient of out
                               const float* dout2,  // (N, K): its second part, or null
                               const T* out,        // (N, K) from forward
                               const float* x,      // (N, K): the main path's batch-norm input
                               const float* mean,   // (K)
                               const float* rstd,   // (K)
                               std::size_t N, int K) {
  if (dout2)
    channel_sums(sdy, sdyx, N, K, [&](std::size_t i, int k, float& u, float& v) {
      const float dy = load(out[i]) > 0.0f ? dout[i] + dout2[i] : 0.0f;
      g[i] = dy;
      u += dy;
      v += dy * sample::bn_xhat(x[i], mean[k], rstd[k]);
    });
  else
    channel_sums(sdy, sdyx, N, K, [&](std::size_t i, int k, float& u, float& v) {
      const float dy = load(out[i]) > 0.0f ? dout[i] : 0.0f;
      g[i] = dy;
      u += dy;
      v += dy * sample::bn_xhat(x[i], mean[k], rstd[k]);
    });
}

// ----------------------------------------------------------------------------------------------
// maxpool3x3: out = max over 3x3 windows, stride 2, padding 1 (padding never wins). The workspace
// keeps which of the nine cells won (0..8, the first in row-major order on ties), one byte per
// output, for the backward pass.

inline int pool3_out(int n) { return (n + 2 - 3) / 2 + 1; }

template <class T>
void maxpool3x3_forward(T* out,               // (B, OH, OW, C)
                        std::uint8_t* which,  // (B, OH, OW, C)
                        const T* inp,         // (B, H, W, C)
                        int B, int H, int W, int C) {
  const int OH = pool3_out(H), OW = pool3_out(W);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox) {
        const std::size_t o = ((static_cast<std::size_t>(b) * OH + oy) * OW + ox) * C;
        for (int c = 0; c < C; ++c) {
          float best = -INFINITY;
          std::uint8_t w = 0;
          for (int k = 0; k < 9; ++k) {
            const int iy = 2 * oy - 1 + k / 3, ix = 2 * ox - 1 + k % 3;
            if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
            const float v = load(inp[((static_cast<std::size_t>(b) * H + iy) * W + ix) * C + c]);
            if (v > best) best = v, w = static_cast<std::uint8_t>(k);
          }
          out[o + c] = store_as<T>(best);
          which[o + c] = w;
        }
      }
}

inline void maxpool3x3_backward(float* dinp,                // (B, H, W, C), overwritten
                                const float* dout,          // (B, OH, OW, C)
                                const std::uint8_t* which,  // from forward
                                int B, int H, int W, int C) {
  const int OH = pool3_out(H), OW = pool3_out(W);
  const std::size_t img = static_cast<std::size_t>(H) * W * C;
#pragma omp parallel for schedule(static)
  for (int b = 0; b < B; ++b) {  // windows overlap: one image per thread, so adds never race
    float* dx = dinp + b * img;
    std::fill(dx, dx + img, 0.0f);
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox) {
        const std::size_t o = ((static_cast<std::size_t>(b) * OH + oy) * OW + ox) * C;
        for (int c = 0; c < C; ++c) {
          const int k = which[o + c];
          const int iy = 2 * oy - 1 + k / 3, ix = 2 * ox - 1 + k % 3;
          dx[(static_cast<std::size_t>(iy) * W + ix) * C + c] += dout[o + c];
        }
      }
  }
}

// ----------------------------------------------------------------------------------------------
// global_avgpool: out[b, c] = mean over the H*W cells of channel c of image b.

template <class T>
void global_avgpool_forward(T* out,        // (B, C), of T: the classifier's input
                            const T* inp,  // (B, HW, C)
                            int B, int HW, int C) {
#pragma omp parallel for schedule(static)
  for (int b = 0; b < B; ++b) {
    std::vector<float> acc(static_cast<std::size_t>(C), 0.0f);
    const T* x = inp + static_cast<std::size_t>(b) * HW * C;
    for (int i = 0; i < HW; ++i)
#pragma omp simd
      for (int c = 0; c < C; ++c) acc[c] += load(x[static_cast<std::size_t>(i) * C + c]);
    for (int c = 0; c < C; ++c) out[static_cast<std::size_t>(b) * C + c] = store_as<T>(acc[c] / HW);
  }
}

inline void global_avgpool_backward(float* dinp,        // (B, HW, C), overwritten
                                    const float* dout,  // (B, C)
                                    int B, int HW, int C) {
  const float s = 1.0f / HW;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < HW; ++i) {
      float* dx = dinp + (static_cast<std::size_t>(b) * HW + i) * C;
      const float* dy = dout + static_cast<std::size_t>(b) * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) dx[c] = dy[c] * s;
    }
}

// ----------------------------------------------------------------------------------------------
// nchw_to_nhwc: the input pipeline's images (B, 3, H, W) fp32 as the first convolution's input.

template <class T>
void nchw_to_nhwc(T* out,            // (B, H, W, C)
                  const float* inp,  // (B, C, H, W)
                  int B, int C, int H, int W) {
  const std::size_t HW = static_cast<std::size_t>(H) * W;
#pragma omp parallel for schedule(static)
  for (int b = 0; b < B; ++b)
    for (std::size_t i = 0; i < HW; ++i)
      for (int c = 0; c < C; ++c)
        out[(b * HW + i) * C + c] = store_as<T>(inp[(static_cast<std::size_t>(b) * C + c) * HW + i]);
}

// dst += src (fp32), the shortcut's gradient joining the main path's at a block's input.
inline void add_into(float* dst, const float* src, std::size_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace resnet
