// samples/resnet50/layers_cuda.cuh: the layers of ResNet-50 on an NVIDIA GPU, one free function per
// layer and direction, outputs first, the signatures of layers_cpu.hpp except that every tensor
// pointer is device memory (batch norm's mean and rstd one device array mean_rstd (2K), its count
// and running statistics on the host) and everything is ordered on the calling thread's stream
// (sample::gpu::cuda_ctx().stream).
//
// Purpose: the cuDNN + cuBLAS backend of the sample. Convolutions run on cuDNN
// (samples/common/conv_cuda.cuh: NHWC, deterministic algorithms), the classifier on cuBLAS
// (samples/common/linear_cuda.cuh), the loss is the samples' shared kernel. Batch norm (statistics
// over a group of replicas, merged on the host as on the CPU: samples/common/batch_norm_cuda.cuh),
// a bottleneck's end (batch norm, residual add, ReLU in one pass), 3x3/2 max pooling and global
// average pooling are own kernels whose element math is layers_math.hpp, shared with the CPU.
// T is what convolutions read, as on the CPU: float, or bf16 bits under --precision bf16.
// Numerics against the CPU backend: fp32 convolutions use FMA math (no TF32), so they agree to fp32
// rounding. bf16: cuDNN's bf16 convolutions read and write bf16 with an fp32 compute type (its
// legacy API has no bf16-in, fp32-out configuration), so a convolution's output, its input
// gradient and its weight gradient are rounded to bf16 once before they are widened to the fp32
// buffers the CPU backend fills directly: one more bf16 rounding than on the CPU, per tensor.
// Weights are OIHW in the flat block (the checkpoint's layout); cuDNN's NHWC algorithms want KRSC
// filters, so a convolution with R > 1 reorders its weights in (scratch) and its weight gradient
// out, as oneDNN's reorders do on the CPU (1x1 filters are the same in both layouts).
// Limits: square kernels with padding R/2; max pooling 3x3 stride 2 padding 1 only; the reductions
// are one block per channel (batch_norm_cuda.cuh), correct rather than fast.
//
// Shape legend:
//   B  images of this replica     H,W input height, width      OH,OW output height, width
//   C  input channels             K   output channels          R   kernel side
//   N  rows of an NHWC tensor: B*H*W
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/batch_norm_cuda.cuh"
#include "../common/conv_cuda.cuh"
#include "../common/cuda_context.cuh"
#include "../common/linear_cuda.cuh"
#include "../common/softmax_xent_cuda.cuh"
#include "layers_math.hpp"

namespace resnet::gpu {

using sample::bn_affine;
using sample::bn_fold;
using sample::bn_group;
using sample::gpu::conv_desc;
using sample::gpu::cuda_ctx;
using sample::gpu::grid_for;
using sample::gpu::linear_backward;
using sample::gpu::linear_forward;
using sample::gpu::softmax_xent_backward;
using sample::gpu::softmax_xent_forward;

template <class T>
constexpr cudnnDataType_t cudnn_type = std::is_same_v<T, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_BFLOAT16;

#define LOCKSTEP_RESNET_FOR_EACH(i, n) \
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < (n); i += std::size_t(gridDim.x) * blockDim.x)

// ----------------------------------------------------------------------------------------------
// conv: out = conv(inp, weight), R x R kernel, stride S, padding R/2, no bias (batch norm follows).

// (K, C, R, R) -> (K, R, R, C), of T.
template <class T>
__global__ void oihw_to_ohwi_kernel(T* out, const T* in, int K, int C, int R) {
  const std::size_t n = static_cast<std::size_t>(K) * C * R * R;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int c = static_cast<int>(i % C);
    const std::size_t kyx = i / C;  // (k * R + y) * R + x
    const int x = static_cast<int>(kyx % R), y = static_cast<int>(kyx / R % R);
    const std::size_t k = kyx / (static_cast<std::size_t>(R) * R);
    out[i] = in[((k * C + c) * R + y) * R + x];
  }
}

// (K, R, R, C) of T -> (K, C, R, R) fp32.
template <class T>
__global__ void ohwi_to_oihw_kernel(float* out, const T* in, int K, int C, int R) {
  const std::size_t n = static_cast<std::size_t>(K) * C * R * R;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int x = static_cast<int>(i % R), y = static_cast<int>(i / R % R);
    const std::size_t kc = i / (static_cast<std::size_t>(R) * R);
    const int c = static_cast<int>(kc % C);
    const std::size_t k = kc / C;
    out[i] = load(in[((k * R + y) * R + x) * C + c]);
  }
}

template <class T>
__global__ void widen_kernel(float* out, const T* in, std::size_t n) {
  LOCKSTEP_RESNET_FOR_EACH(i, n) out[i] = load(in[i]);
}

template <class T>
void widen(float* out, const T* in, std::size_t n) {
  widen_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, in, n);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// The weights as cuDNN's NHWC algorithms read them: `weight` itself for 1x1, else reordered into
// scratch slot_weights.
template <class T>
const T* filter_krsc(const T* weight, const conv_desc& s) {
  if (s.R == 1) return weight;
  auto& ctx = cuda_ctx();
  const std::size_t n = static_cast<std::size_t>(s.K) * s.C * s.R * s.R;
  T* w = static_cast<T*>(ctx.scratch(n * sizeof(T), sample::gpu::slot_weights));
  oihw_to_ohwi_kernel<<<grid_for(n), 256, 0, ctx.stream>>>(w, weight, s.K, s.C, s.R);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
  return w;
}

template <class T>
void conv_forward(float* out,         // (B, OH, OW, K) fp32
                  const T* inp,       // (B, H, W, C)
                  const T* weight,    // (K, C, R, R)
                  const conv_desc& s) {
  auto& ctx = cuda_ctx();
  const auto& p = sample::gpu::conv_lookup(s, CUDNN_TENSOR_NHWC, cudnn_type<T>);
  const T* w = filter_krsc(weight, s);
  if constexpr (std::is_same_v<T, float>) {
    sample::gpu::conv_run_forward(out, inp, w, p);
  } else {
    const std::size_t n = static_cast<std::size_t>(s.B) * s.OH() * s.OW() * s.K;
    T* y = static_cast<T*>(ctx.scratch(n * sizeof(T), sample::gpu::slot_out));
    sample::gpu::conv_run_forward(y, inp, w, p);
    widen(out, y, n);
  }
}

template <class T>
void conv_backward(float* dinp,         // (B, H, W, C) fp32, overwritten; or null (not needed)
                   float* dweight,      // (K, C, R, R) fp32, overwritten
                   const T* dout,       // (B, OH, OW, K)
                   const T* inp,        // (B, H, W, C), as in the forward pass
                   const T* weight,     // (K, C, R, R)
                   const conv_desc& s) {
  auto& ctx = cuda_ctx();
  const auto& p = sample::gpu::conv_lookup(s, CUDNN_TENSOR_NHWC, cudnn_type<T>);
  const std::size_t nw = static_cast<std::size_t>(s.K) * s.C * s.R * s.R;
  if (std::is_same_v<T, float> && s.R == 1) {
    sample::gpu::conv_run_backward_filter(dweight, dout, inp, p);
  } else {
    T* dw = static_cast<T*>(ctx.scratch(nw * sizeof(T), sample::gpu::slot_out));  // (K, R, R, C)
    sample::gpu::conv_run_backward_filter(dw, dout, inp, p);
    ohwi_to_oihw_kernel<<<grid_for(nw), 256, 0, ctx.stream>>>(dweight, dw, s.K, s.C, s.R);
    LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
  }
  if (!dinp) return;
  const T* w = filter_krsc(weight, s);
  if constexpr (std::is_same_v<T, float>) {
    sample::gpu::conv_run_backward_data(dinp, dout, w, p);
  } else {
    const std::size_t n = static_cast<std::size_t>(s.B) * s.H * s.W * s.C;
    T* dx = static_cast<T*>(ctx.scratch(n * sizeof(T), sample::gpu::slot_out));
    sample::gpu::conv_run_backward_data(dx, dout, w, p);
    widen(dinp, dx, n);
  }
}

// ----------------------------------------------------------------------------------------------
// batchnorm (+ ReLU) over the rows of an NHWC tensor (HW = 1 in batch_norm_cuda.cuh's indexing).

template <class T>
__global__ void bn_apply_kernel(T* out, const float* inp, const float* mean_rstd, const float* gamma, const float* beta,
                                std::size_t n, int K, bool relu) {
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int k = static_cast<int>(i % K);
    out[i] = store_as<T>(bn_apply(inp[i], bn_fold(gamma[k], beta[k], mean_rstd[k], mean_rstd[K + k]), relu));
  }
}

// Backward's terms of one element: dy (the gradient before the ReLU) and dy xhat.
struct bn_terms {
  const float *dout, *inp, *mean_rstd, *gamma, *beta;
  int K;
  bool relu;
  __device__ sample::gpu::channel_terms operator()(std::size_t i, int k) const {
    const float mean = mean_rstd[k], rstd = mean_rstd[K + k];
    const float dy = bn_dy(inp[i], dout[i], bn_fold(gamma[k], beta[k], mean, rstd), relu);
    return {dy, dy * sample::bn_xhat(inp[i], mean, rstd)};
  }
};

template <class T>
__global__ void bn_dx_kernel(T* dinp, const float* dout, const float* inp, const float* mean_rstd, const float* sums,
                             float count, const float* gamma, const float* beta, std::size_t n, int K, bool relu) {
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int k = static_cast<int>(i % K);
    const float mean = mean_rstd[k], rstd = mean_rstd[K + k];
    // sums / count, divided as on the CPU (not multiplied by 1 / count), so both round alike
    dinp[i] = store_as<T>(bn_dx(inp[i], dout[i], bn_fold(gamma[k], beta[k], mean, rstd), mean, rstd, sums[k] / count,
                                sums[K + k] / count, relu));
  }
}

// As layers_cpu.hpp's batchnorm_stats; scratch: 2K device floats.
inline void batchnorm_stats(float* mean_rstd,     // (2K) device: mean then rstd, saved for backward
                            float* count,         // (1) host: rows of the group, saved
                            float* running_mean,  // (K) host, updated when training
                            float* running_var,   // (K) host, updated when training
                            const float* inp,     // (N, K) fp32 (a convolution's output)
                            std::size_t N, int K, const bn_group& group, bool training, float* scratch,
                            float momentum = 0.1f, float eps = 1e-5f) {
  sample::gpu::bn_statistics(mean_rstd, count, running_mean, running_var, inp, N, K, 1, group, training, scratch,
                             momentum, eps);
}

template <class T>
void batchnorm_forward(T* out,               // (N, K) of T
                       float* mean_rstd,     // (2K) device, saved for backward
                       float* count,         // (1) host, saved
                       float* running_mean,  // (K) host
                       float* running_var,   // (K) host
                       const float* inp,     // (N, K) fp32
                       const float* gamma,   // (K)
                       const float* beta,    // (K)
                       std::size_t N, int K, bool relu, const bn_group& group, bool training, float* scratch,
                       float momentum = 0.1f, float eps = 1e-5f) {
  batchnorm_stats(mean_rstd, count, running_mean, running_var, inp, N, K, group, training, scratch, momentum, eps);
  const std::size_t n = N * static_cast<std::size_t>(K);
  bn_apply_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, inp, mean_rstd, gamma, beta, n, K, relu);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// Batch norm's backward after its per-channel sums (device, 2K: sum dy, sum dy xhat over this
// replica's rows; made by channel_sums or bn_add_relu_backward_sums): dgamma, dbeta get this
// replica's sums, `sums` becomes the group's, dinp is written.
template <class T>
void batchnorm_backward_dx(T* dinp,              // (N, K) of T, overwritten
                           float* dgamma,        // (K), overwritten: this replica's sum
                           float* dbeta,         // (K), overwritten: this replica's sum
                           float* sums,          // (2K) device
                           const float* dout,    // (N, K): gradient of the output (after the ReLU)
                           const float* inp,     // (N, K): the forward input
                           const float* mean_rstd, float count, const float* gamma, const float* beta, std::size_t N,
                           int K, bool relu, const bn_group& group) {
  sample::gpu::bn_group_sums(dgamma, dbeta, sums, K, group);
  const std::size_t n = N * static_cast<std::size_t>(K);
  bn_dx_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(dinp, dout, inp, mean_rstd, sums, count, gamma, beta, n, K,
                                                            relu);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// scratch: 2K device floats.
template <class T>
void batchnorm_backward(T* dinp, float* dgamma, float* dbeta, const float* dout, const float* inp,
                        const float* mean_rstd, float count, const float* gamma, const float* beta, std::size_t N,
                        int K, bool relu, const bn_group& group, float* scratch) {
  sample::gpu::channel_sums(scratch, N, K, 1, bn_terms{dout, inp, mean_rstd, gamma, beta, K, relu});
  batchnorm_backward_dx(dinp, dgamma, dbeta, scratch, dout, inp, mean_rstd, count, gamma, beta, N, K, relu, group);
}

// ----------------------------------------------------------------------------------------------
// bn_add_relu: out = max(0, BN(x) + shortcut), the end of a bottleneck in one pass; the shortcut
// is the block's input (identity) or BN_d(xd), the projection's batch norm.

template <class T>
__global__ void bn_add_relu_kernel(T* out, const float* x, const float* gamma, const float* beta,
                                   const float* mean_rstd, const T* shortcut, std::size_t n, int K) {
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int k = static_cast<int>(i % K);
    out[i] = store_as<T>(
        bn_add_relu(x[i], bn_fold(gamma[k], beta[k], mean_rstd[k], mean_rstd[K + k]), load(shortcut[i])));
  }
}

template <class T>
__global__ void bn_add_bn_relu_kernel(T* out, const float* x, const float* gamma, const float* beta,
                                      const float* mean_rstd, const float* xd, const float* gd, const float* bd,
                                      const float* mrd, std::size_t n, int K) {
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int k = static_cast<int>(i % K);
    out[i] = store_as<T>(bn_add_bn_relu(x[i], bn_fold(gamma[k], beta[k], mean_rstd[k], mean_rstd[K + k]), xd[i],
                                        bn_fold(gd[k], bd[k], mrd[k], mrd[K + k])));
  }
}

template <class T>
void bn_add_relu_forward(T* out,                  // (N, K) of T
                         const float* x,          // (N, K): the last convolution's output
                         const float* gamma,      // (K)
                         const float* beta,       // (K)
                         const float* mean_rstd,  // (2K)
                         const T* shortcut,       // (N, K): the block's input
                         std::size_t N, int K) {
  const std::size_t n = N * static_cast<std::size_t>(K);
  bn_add_relu_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, x, gamma, beta, mean_rstd, shortcut, n, K);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

template <class T>
void bn_add_bn_relu_forward(T* out,                  // (N, K) of T
                            const float* x,          // (N, K): the last convolution's output
                            const float* gamma,      // (K)
                            const float* beta,       // (K)
                            const float* mean_rstd,  // (2K)
                            const float* xd,         // (N, K): the projection's convolution output
                            const float* gd,         // (K): its batch norm's scale, shift, mean_rstd
                            const float* bd, const float* mrd, std::size_t N, int K) {
  const std::size_t n = N * static_cast<std::size_t>(K);
  bn_add_bn_relu_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, x, gamma, beta, mean_rstd, xd, gd, bd, mrd,
                                                                    n, K);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// The first pass of its backward: g = dout (+ dout2) where out > 0, and the main path's batch-norm
// sums (sum g, sum g xhat). g may be dout2 itself (each element is read, then written, by one thread).
template <class T>
struct add_relu_terms {
  float* g;
  const float *dout, *dout2;
  const T* out;
  const float *x, *mean_rstd;
  int K;
  __device__ sample::gpu::channel_terms operator()(std::size_t i, int k) const {
    const float dy = add_relu_grad(load(out[i]), dout2 ? dout[i] + dout2[i] : dout[i]);
    g[i] = dy;
    return {dy, dy * sample::bn_xhat(x[i], mean_rstd[k], mean_rstd[K + k])};
  }
};

template <class T>
void bn_add_relu_backward_sums(float* g,                // (N, K), overwritten; may be dout2 itself
                               float* sums,             // (2K) device, overwritten: sum g, sum g xhat
                               const float* dout,       // (N, K): gradient of out
                               const float* dout2,      // (N, K): its second part, or null
                               const T* out,            // (N, K) from forward
                               const float* x,          // (N, K): the main path's batch-norm input
                               const float* mean_rstd,  // (2K)
                               std::size_t N, int K) {
  sample::gpu::channel_sums(sums, N, K, 1, add_relu_terms<T>{g, dout, dout2, out, x, mean_rstd, K});
}

// ----------------------------------------------------------------------------------------------
// maxpool3x3 (stride 2, padding 1): one thread per output forward, per input cell backward (a
// gather: windows overlap, and a scatter would need atomics whose order varies).

template <class T>
__global__ void maxpool3x3_forward_kernel(T* out, std::uint8_t* which, const T* inp, int B, int H, int W, int C) {
  const int OH = pool3_out(H), OW = pool3_out(W);
  const std::size_t n = static_cast<std::size_t>(B) * OH * OW * C;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int c = static_cast<int>(i % C);
    const std::size_t p = i / C;
    const int ox = static_cast<int>(p % OW), oy = static_cast<int>(p / OW % OH);
    const std::size_t b = p / (static_cast<std::size_t>(OW) * OH);
    out[i] = store_as<T>(maxpool3_cell(inp + b * H * W * C, H, W, C, oy, ox, c, &which[i]));
  }
}

static __global__ void maxpool3x3_backward_kernel(float* dinp, const float* dout, const std::uint8_t* which, int B,
                                                  int H, int W, int C) {
  const int OH = pool3_out(H), OW = pool3_out(W);
  const std::size_t n = static_cast<std::size_t>(B) * H * W * C, oimg = static_cast<std::size_t>(OH) * OW * C;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int c = static_cast<int>(i % C);
    const std::size_t p = i / C;
    const int ix = static_cast<int>(p % W), iy = static_cast<int>(p / W % H);
    const std::size_t b = p / (static_cast<std::size_t>(W) * H);
    dinp[i] = maxpool3_gather(dout + b * oimg, which + b * oimg, OH, OW, C, iy, ix, c);
  }
}

template <class T>
void maxpool3x3_forward(T* out,               // (B, OH, OW, C)
                        std::uint8_t* which,  // (B, OH, OW, C)
                        const T* inp,         // (B, H, W, C)
                        int B, int H, int W, int C) {
  const std::size_t n = static_cast<std::size_t>(B) * pool3_out(H) * pool3_out(W) * C;
  maxpool3x3_forward_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, which, inp, B, H, W, C);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

inline void maxpool3x3_backward(float* dinp,                // (B, H, W, C), overwritten
                                const float* dout,          // (B, OH, OW, C)
                                const std::uint8_t* which,  // from forward
                                int B, int H, int W, int C) {
  const std::size_t n = static_cast<std::size_t>(B) * H * W * C;
  maxpool3x3_backward_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(dinp, dout, which, B, H, W, C);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// global_avgpool: out[b, c] = mean over the HW cells of channel c of image b.

template <class T>
__global__ void global_avgpool_forward_kernel(T* out, const T* inp, int B, int HW, int C) {
  const std::size_t n = static_cast<std::size_t>(B) * C;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const std::size_t b = i / C;
    out[i] = store_as<T>(avgpool_cell(inp + b * HW * C, HW, C, static_cast<int>(i % C)));
  }
}

static __global__ void global_avgpool_backward_kernel(float* dinp, const float* dout, int B, int HW, int C) {
  const std::size_t n = static_cast<std::size_t>(B) * HW * C;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const std::size_t b = i / (static_cast<std::size_t>(HW) * C);
    dinp[i] = avgpool_grad(dout[b * C + i % C], HW);
  }
}

template <class T>
void global_avgpool_forward(T* out,        // (B, C)
                            const T* inp,  // (B, HW, C)
                            int B, int HW, int C) {
  global_avgpool_forward_kernel<<<grid_for(static_cast<std::size_t>(B) * C), 256, 0, cuda_ctx().stream>>>(out, inp, B,
                                                                                                          HW, C);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

inline void global_avgpool_backward(float* dinp,        // (B, HW, C), overwritten
                                    const float* dout,  // (B, C)
                                    int B, int HW, int C) {
  const std::size_t n = static_cast<std::size_t>(B) * HW * C;
  global_avgpool_backward_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(dinp, dout, B, HW, C);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// nchw_to_nhwc: the input pipeline's images (B, 3, H, W) fp32 as the first convolution's input;
// add_into: dst += src, the shortcut's gradient joining the main path's at a block's input.

template <class T>
__global__ void nchw_to_nhwc_kernel(T* out, const float* inp, int B, int C, int H, int W) {
  const std::size_t HW = static_cast<std::size_t>(H) * W, n = static_cast<std::size_t>(B) * C * HW;
  LOCKSTEP_RESNET_FOR_EACH(i, n) {
    const int c = static_cast<int>(i % C);
    const std::size_t p = i / C;  // b * HW + cell
    out[i] = store_as<T>(inp[((p / HW) * C + c) * HW + p % HW]);
  }
}

template <class T>
void nchw_to_nhwc(T* out,            // (B, H, W, C)
                  const float* inp,  // (B, C, H, W)
                  int B, int C, int H, int W) {
  const std::size_t n = static_cast<std::size_t>(B) * C * H * W;
  nchw_to_nhwc_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, inp, B, C, H, W);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

static __global__ void add_into_kernel(float* dst, const float* src, std::size_t n) {
  LOCKSTEP_RESNET_FOR_EACH(i, n) dst[i] += src[i];
}

inline void add_into(float* dst, const float* src, std::size_t n) {
  add_into_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(dst, src, n);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

#undef LOCKSTEP_RESNET_FOR_EACH

}  // namespace resnet::gpu
