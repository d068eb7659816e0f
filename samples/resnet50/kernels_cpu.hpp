// samples/resnet50/kernels_cpu.hpp: ResNet-50's own CPU kernels, the part of the CPU backend that
// needs no oneDNN: batch norm over a group of replicas (+ ReLU), a bottleneck's end (batch norm,
// residual add, ReLU in one pass), 3x3/2 max pooling, global average pooling, the NHWC input and
// the gradients' sum. layers_cpu.hpp adds oneDNN's convolutions and classifier; the GPU test
// (tests/cuda/test_resnet_layers_cuda.cu) checks the CUDA kernels against these, on a machine
// without oneDNN too.
//
// Purpose, layout and numerics: layers_cpu.hpp's header says them. The element math is
// layers_math.hpp's, shared with the GPU backend; the per-channel sums are taken over fixed chunks
// of rows and added in chunk order, so results do not depend on the thread count (OpenMP; built
// without it, the pragmas are ignored and the kernels run on one thread with the same results).
//
// Shape legend:
//   B  images of this replica     H,W input height, width      OH,OW output height, width
//   C  input channels             K   output channels          N   rows of an NHWC tensor: B*H*W
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/batch_norm.hpp"
#include "layers_math.hpp"

namespace resnet {

using sample::bn_group;

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
  for_rows(N, [&](std::size_t r) {
    const float* x = inp + r * K;
    T* y = out + r * K;
#pragma omp simd
    for (int k = 0; k < K; ++k) y[k] = store_as<T>(bn_apply(x[k], {a[k], c[k]}, relu));
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
      dx[k] = store_as<T>(bn_dx(inp[i], dout[i], {a[k], c[k]}, mean[k], rstd[k], mdy[k], mdyx[k], relu));
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
    const float dy = bn_dy(inp[i], dout[i], {a[k], c[k]}, relu);  // the gradient before the ReLU
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
      out[base + k] = store_as<T>(bn_add_relu(x[base + k], {a[k], c[k]}, load(shortcut[base + k])));
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
      out[base + k] = store_as<T>(bn_add_bn_relu(x[base + k], {a[k], c[k]}, xd[base + k], {ad[k], cd[k]}));
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
      const float dy = add_relu_grad(load(out[i]), dout[i] + dout2[i]);
      g[i] = dy;
      u += dy;
      v += dy * sample::bn_xhat(x[i], mean[k], rstd[k]);
    });
  else
    channel_sums(sdy, sdyx, N, K, [&](std::size_t i, int k, float& u, float& v) {
      const float dy = add_relu_grad(load(out[i]), dout[i]);
      g[i] = dy;
      u += dy;
      v += dy * sample::bn_xhat(x[i], mean[k], rstd[k]);
    });
}

// ----------------------------------------------------------------------------------------------
// maxpool3x3: out = max over 3x3 windows, stride 2, padding 1 (padding never wins). The workspace
// keeps which of the nine cells won (0..8, the first in row-major order on ties), one byte per
// output, for the backward pass, which sums each input cell's gradient (layers_math.hpp).

template <class T>
void maxpool3x3_forward(T* out,               // (B, OH, OW, C)
                        std::uint8_t* which,  // (B, OH, OW, C)
                        const T* inp,         // (B, H, W, C)
                        int B, int H, int W, int C) {
  const int OH = pool3_out(H), OW = pool3_out(W);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < OH; ++oy) {
      const T* img = inp + static_cast<std::size_t>(b) * H * W * C;
      for (int ox = 0; ox < OW; ++ox) {
        const std::size_t o = ((static_cast<std::size_t>(b) * OH + oy) * OW + ox) * C;
        for (int c = 0; c < C; ++c) out[o + c] = store_as<T>(maxpool3_cell(img, H, W, C, oy, ox, c, &which[o + c]));
      }
    }
}

// Each input cell's gradient: maxpool3_gather's terms in its order, each window's term for all C
// channels at once (vector lanes), so the result is the gather's to the bit.
inline void maxpool3x3_backward(float* dinp,                // (B, H, W, C), overwritten
                                const float* dout,          // (B, OH, OW, C)
                                const std::uint8_t* which,  // from forward
                                int B, int H, int W, int C) {
  const int OH = pool3_out(H), OW = pool3_out(W);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int iy = 0; iy < H; ++iy)
      for (int ix = 0; ix < W; ++ix) {
        float* dx = dinp + ((static_cast<std::size_t>(b) * H + iy) * W + ix) * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) dx[c] = 0.0f;
        for (int oy = pool3_first(iy); oy <= pool3_last(iy, OH); ++oy)
          for (int ox = pool3_first(ix); ox <= pool3_last(ix, OW); ++ox) {
            const std::size_t o = ((static_cast<std::size_t>(b) * OH + oy) * OW + ox) * C;
            const float* dy = dout + o;
            const std::uint8_t* w = which + o;
            const int k = maxpool3_k(iy, ix, oy, ox);
#pragma omp simd
            for (int c = 0; c < C; ++c) dx[c] += maxpool3_term(w[c], k, dy[c]);
          }
      }
}

// ----------------------------------------------------------------------------------------------
// global_avgpool: out[b, c] = mean over the H*W cells of channel c of image b.

// Cells outer, channels inner (vector lanes): each channel's sum takes avgpool_cell's steps in its
// order, so the result is the GPU's to the bit. Tasks are (image, 64 channels), enough of them
// for the threads when the batch is small.
template <class T>
void global_avgpool_forward(T* out,        // (B, C), of T: the classifier's input
                            const T* inp,  // (B, HW, C)
                            int B, int HW, int C) {
  constexpr int chunk = 64;  // channels per task; 256 bytes of partial sums
  const int nchunks = (C + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < nchunks; ++j) {
      const int c0 = j * chunk, n = C - c0 < chunk ? C - c0 : chunk;
      const T* img = inp + static_cast<std::size_t>(b) * HW * C + c0;
      float acc[chunk];  // (n) partial sums of channels c0 .. c0 + n
#pragma omp simd
      for (int c = 0; c < n; ++c) acc[c] = 0.0f;
      for (int i = 0; i < HW; ++i) {
        const T* row = img + static_cast<std::size_t>(i) * C;
#pragma omp simd
        for (int c = 0; c < n; ++c) acc[c] = avgpool_add(acc[c], row[c]);
      }
      T* o = out + static_cast<std::size_t>(b) * C + c0;
#pragma omp simd
      for (int c = 0; c < n; ++c) o[c] = store_as<T>(avgpool_mean(acc[c], HW));
    }
}

inline void global_avgpool_backward(float* dinp,        // (B, HW, C), overwritten
                                    const float* dout,  // (B, C)
                                    int B, int HW, int C) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < HW; ++i) {
      float* dx = dinp + (static_cast<std::size_t>(b) * HW + i) * C;
      const float* dy = dout + static_cast<std::size_t>(b) * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) dx[c] = avgpool_grad(dy[c], HW);
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
