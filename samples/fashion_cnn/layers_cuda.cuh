// samples/fashion_cnn/layers_cuda.cuh: the layers of the Fashion-MNIST CNN on an NVIDIA GPU, one
// free function per layer and direction, outputs first, the same signatures as layers_cpu.hpp
// except that every float pointer is device memory and everything is ordered on the calling
// thread's stream (cuda_ctx().stream).
//
// Purpose: the cuDNN/cuBLAS backend of the sample. Convolutions run on cuDNN, the linear layer on
// cuBLAS; max pooling, batch norm + ReLU and the loss are own kernels whose element math is
// layers_math.hpp, shared with the CPU backend (cuDNN's pooling cannot round odd sizes up without
// shifting every window, and has no batch norm whose statistics span several replicas).
// Numerics: cuDNN is asked for FMA math (no TF32) and deterministic algorithms, cuBLAS runs its
// default fp32 math, so a run is repeatable and agrees with the CPU backend to fp32 rounding.
// Batch-norm statistics go to the host, are merged there across the group (bn_merge_stats, as on
// the CPU) and come back: 2K + 1 floats each way, one stream synchronisation per layer.
// The context, convolution plans, the classifier, the loss and batch norm's reductions are shared
// with the ResNet-50 sample's GPU backend (samples/common/*.cuh).
// Limits: fp32, NCHW, 3x3 convolutions with stride 1 and padding 1; one context (stream, cuDNN and
// cuBLAS handles, workspace) per host thread, so replicas running as threads never share one.
#pragma once

#include <cstdint>
#include <vector>

#include <lockstep/parallel/gemm.hpp>

#include "../common/batch_norm_cuda.cuh"
#include "../common/conv_cuda.cuh"
#include "../common/cuda_context.cuh"
#include "../common/linear_cuda.cuh"
#include "../common/softmax_xent_cuda.cuh"
#include "layers_math.hpp"

namespace fashion::gpu {

// The context, the checks, the classifier, the loss and batch norm's reductions are the samples'
// shared GPU pieces (samples/common/*.cuh).
using sample::gpu::cuda_context;
using sample::gpu::cuda_ctx;
using sample::gpu::grid_for;
using sample::gpu::linear_backward;
using sample::gpu::linear_forward;
using sample::gpu::softmax_xent_backward;
using sample::gpu::softmax_xent_forward;
using sample::gpu::to_device;
using sample::gpu::to_host;

// ----------------------------------------------------------------------------------------------
// conv3x3 on cuDNN (samples/common/conv_cuda.cuh): out = conv(inp, weight), stride 1, padding 1,
// no bias, NCHW fp32.

inline sample::gpu::conv_plan& conv_lookup(int B, int C, int H, int W, int K) {
  return sample::gpu::conv_lookup({B, C, H, W, K, 3, 1}, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT);
}

inline void conv_forward(float* out, const float* inp, const float* weight, int B, int C, int H, int W, int K) {
  sample::gpu::conv_run_forward(out, inp, weight, conv_lookup(B, C, H, W, K));
}

// dinp may be null (the first layer needs no input gradient); dweight is overwritten.
inline void conv_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, int B,
                          int C, int H, int W, int K) {
  auto& p = conv_lookup(B, C, H, W, K);
  sample::gpu::conv_run_backward_filter(dweight, dout, inp, p);
  if (dinp) sample::gpu::conv_run_backward_data(dinp, dout, weight, p);
}

// ----------------------------------------------------------------------------------------------
// maxpool2x2 (own kernels, layers_math.hpp): one thread per output cell.

static __global__ void maxpool_forward_kernel(float* out, std::uint8_t* arg, const float* inp, int BC, int H, int W) {
  const int OH = pooled(H), OW = pooled(W);
  const std::size_t n = static_cast<std::size_t>(BC) * OH * OW;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t bc = i / (OH * OW);
    const int o = static_cast<int>(i % (OH * OW));
    out[i] = maxpool_cell(inp + bc * H * W, H, W, o / OW, o % OW, &arg[i]);
  }
}

static __global__ void maxpool_backward_kernel(float* dinp, const float* dout, const std::uint8_t* arg, int BC, int H, int W) {
  const int OH = pooled(H), OW = pooled(W);
  const std::size_t n = static_cast<std::size_t>(BC) * OH * OW;
  // Windows do not overlap (stride 2), so each input cell is written by at most one thread.
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t bc = i / (OH * OW);
    const int o = static_cast<int>(i % (OH * OW));
    dinp[bc * H * W + maxpool_source(W, o / OW, o % OW, arg[i])] = dout[i];
  }
}

inline void maxpool_forward(float* out, void* workspace, const float* inp, int B, int C, int H, int W) {
  const std::size_t n = maxpool_workspace_bytes(B, C, H, W);
  maxpool_forward_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, static_cast<std::uint8_t*>(workspace), inp,
                                                                     B * C, H, W);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

inline void maxpool_backward(float* dinp, const float* dout, const void* workspace, int B, int C, int H, int W) {
  auto s = cuda_ctx().stream;
  LOCKSTEP_SAMPLE_CHECK(cudaMemsetAsync(dinp, 0, static_cast<std::size_t>(B) * C * H * W * sizeof(float), s));
  const std::size_t n = maxpool_workspace_bytes(B, C, H, W);
  maxpool_backward_kernel<<<grid_for(n), 256, 0, s>>>(dinp, dout, static_cast<const std::uint8_t*>(workspace), B * C,
                                                      H, W);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// One row-major product of lockstep::parallel (gemm_args: C = op(A) op(B) + beta C) on cuBLAS,
// enqueued on this thread's stream: column-major cuBLAS sees each row-major matrix transposed, so
// C^T (n, m) = op(B)^T (n, k) op(A)^T (k, m) is gemm(op_b, op_a) with the operands swapped. The
// model-parallel layers' matmul on a stream-ordered group (their compute stream: cuda_ctx().stream).
inline void sgemm(const lockstep::parallel::gemm_args& a) {
  if (a.m == 0 || a.n == 0) return;
  const float one = 1.0f;
  LOCKSTEP_SAMPLE_CHECK(cublasSgemm(cuda_ctx().blas, a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    static_cast<int>(a.n), static_cast<int>(a.m), static_cast<int>(a.k), &one, a.b,
                                    static_cast<int>(a.ldb), a.a, static_cast<int>(a.lda), &a.beta, a.c,
                                    static_cast<int>(a.ldc)));
}

// ----------------------------------------------------------------------------------------------
// The --fc head's hidden layers (head_cpu.hpp's functions, same signatures): products on cuBLAS
// (sgemm above), bias + ReLU own kernels on layers_math.hpp's element math. The bias gradient is
// one thread per column adding its rows in row order, as the CPU does (deterministic).

static __global__ void bias_relu_forward_kernel(float* y, const float* b, std::size_t rows, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < rows * n; i += std::size_t(gridDim.x) * blockDim.x)
    y[i] = bias_relu(y[i], b[i % n]);
}

static __global__ void bias_relu_backward_kernel(float* dy, float* db, const float* y, std::size_t rows, std::size_t n) {
  const std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (j >= n) return;
  float s = 0.0f;
  for (std::size_t i = 0; i < rows; ++i) {
    const float g = relu_back(dy[i * n + j], y[i * n + j]);
    dy[i * n + j] = g;
    s += g;
  }
  db[j] = s;
}

// y (rows, n) += b (n), then ReLU, in place.
inline void bias_relu_forward(float* y, const float* b, std::size_t rows, std::size_t n) {
  if (rows * n == 0) return;
  bias_relu_forward_kernel<<<grid_for(rows * n), 256, 0, cuda_ctx().stream>>>(y, b, rows, n);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// dy (rows, n) *= [y > 0] in place (y: the ReLU's output), and db (n) = the sum over rows of the
// result (overwritten; zero for no rows).
inline void bias_relu_backward(float* dy, float* db, const float* y, std::size_t rows, std::size_t n) {
  if (n == 0) return;
  bias_relu_backward_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, cuda_ctx().stream>>>(dy, db, y, rows, n);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// One hidden FC with ReLU, forward: y (B, out) = relu(x (B, in) · w (in, out) + b).
inline void fc_relu_forward(float* y, const float* x, const float* w, const float* b, std::size_t B, std::size_t in,
                            std::size_t out) {
  sgemm({false, false, B, out, in, x, in, w, out, 0.0f, y, out});
  bias_relu_forward(y, b, B, out);
}

// Its backward: dy (B, out) is turned into the pre-ReLU gradient in place; dw (in, out), db (out)
// and dx (B, in, or null) are overwritten.
inline void fc_relu_backward(float* dx, float* dw, float* db, float* dy, const float* x, const float* y, const float* w,
                             std::size_t B, std::size_t in, std::size_t out) {
  bias_relu_backward(dy, db, y, B, out);
  sgemm({true, false, in, out, B, x, in, dy, out, 0.0f, dw, out});
  if (dx) sgemm({false, true, B, in, out, dy, out, w, out, 0.0f, dx, in});
}

// ----------------------------------------------------------------------------------------------
// batchnorm_relu (own kernels, layers_math.hpp; the per-channel reductions and the group's merge
// are samples/common/batch_norm_cuda.cuh's, shared with ResNet-50).

// mean_rstd (2K): the mean then the rstd of each channel, from the host.
static __global__ void bn_relu_forward_kernel(float* out, const float* inp, const float* mean_rstd, const float* gamma,
                                              const float* beta, std::size_t n, int K, int HW) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const int k = static_cast<int>((i / HW) % K);
    out[i] = bn_relu(inp[i], bn_fold(gamma[k], beta[k], mean_rstd[k], mean_rstd[K + k]));
  }
}

// Backward's terms of one element: dy (the gradient before the ReLU) and dy xhat.
struct bn_relu_terms {
  const float *dout, *inp, *mean_rstd, *gamma, *beta;
  int K;
  __device__ sample::gpu::channel_terms operator()(std::size_t i, int k) const {
    const float mean = mean_rstd[k], rstd = mean_rstd[K + k];
    const float dy = bn_relu_dy(inp[i], dout[i], bn_fold(gamma[k], beta[k], mean, rstd));
    return {dy, dy * bn_xhat(inp[i], mean, rstd)};
  }
};

static __global__ void bn_relu_backward_kernel(float* dinp, const float* dout, const float* inp, const float* mean_rstd,
                                               const float* sums, float count, const float* gamma, const float* beta,
                                               std::size_t n, int K, int HW) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const int k = static_cast<int>((i / HW) % K);
    const float mean = mean_rstd[k], rstd = mean_rstd[K + k];
    // sums / count, divided as on the CPU (not multiplied by 1 / count), so both round alike
    dinp[i] = bn_relu_dx(inp[i], dout[i], bn_fold(gamma[k], beta[k], mean, rstd), mean, rstd, sums[k] / count,
                         sums[K + k] / count);
  }
}

// As layers_cpu.hpp's batchnorm_relu_forward, except: mean_rstd (2K, device) replaces mean and
// rstd; count and the running statistics stay on the host; scratch is 2K device floats.
inline void batchnorm_relu_forward(float* out, float* mean_rstd, float* count, float* running_mean,
                                   float* running_var, const float* inp, const float* gamma, const float* beta, int B,
                                   int K, int HW, const bn_group& group, bool training, float* scratch,
                                   float momentum = 0.1f, float eps = 1e-5f) {
  sample::gpu::bn_statistics(mean_rstd, count, running_mean, running_var, inp, static_cast<std::size_t>(B) * HW, K, HW,
                             group, training, scratch, momentum, eps);
  const std::size_t n = static_cast<std::size_t>(B) * K * HW;
  bn_relu_forward_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, inp, mean_rstd, gamma, beta, n, K, HW);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// As layers_cpu.hpp's batchnorm_relu_backward, with mean_rstd from the forward pass and scratch
// of 2K device floats.
inline void batchnorm_relu_backward(float* dinp, float* dgamma, float* dbeta, const float* dout, const float* inp,
                                    const float* mean_rstd, float count, const float* gamma, const float* beta, int B,
                                    int K, int HW, const bn_group& group, float* scratch) {
  sample::gpu::channel_sums(scratch, static_cast<std::size_t>(B) * HW, K, HW,
                            bn_relu_terms{dout, inp, mean_rstd, gamma, beta, K});
  sample::gpu::bn_group_sums(dgamma, dbeta, scratch, K, group);
  const std::size_t n = static_cast<std::size_t>(B) * K * HW;
  bn_relu_backward_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(dinp, dout, inp, mean_rstd, scratch, count,
                                                                      gamma, beta, n, K, HW);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

}  // namespace fashion::gpu
