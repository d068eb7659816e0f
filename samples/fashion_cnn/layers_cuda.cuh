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
// Limits: fp32, NCHW, 3x3 convolutions with stride 1 and padding 1; one context (stream, cuDNN and
// cuBLAS handles, workspace) per host thread, so replicas running as threads never share one.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cub/block/block_reduce.cuh>

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/device/runtime.hpp>
#include <lockstep/parallel/gemm.hpp>

#include "layers_math.hpp"

namespace fashion::gpu {

// ----------------------------------------------------------------------------------------------
// Errors and the per-thread context.

using lockstep::device::check;  // cudaError_t: lockstep's own, a lockstep::error naming the call
inline void check(cudnnStatus_t e, const char* what) {
  if (e != CUDNN_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cudnnGetErrorString(e));
}
inline void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + cublasGetStatusString(e));
}
#define LOCKSTEP_SAMPLE_CHECK(call) ::fashion::gpu::check((call), #call)

struct cuda_context {
  cudaStream_t stream = nullptr;
  cudnnHandle_t dnn = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;  // cuDNN scratch, grown on demand
  std::size_t workspace_bytes = 0;

  cuda_context() {
    LOCKSTEP_SAMPLE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    LOCKSTEP_SAMPLE_CHECK(cudnnCreate(&dnn));
    LOCKSTEP_SAMPLE_CHECK(cudnnSetStream(dnn, stream));
    LOCKSTEP_SAMPLE_CHECK(cublasCreate(&blas));
    LOCKSTEP_SAMPLE_CHECK(cublasSetStream(blas, stream));
  }
  cuda_context(const cuda_context&) = delete;
  cuda_context& operator=(const cuda_context&) = delete;
  ~cuda_context() {
    if (workspace) cudaFreeAsync(workspace, stream);
    cudaStreamSynchronize(stream);
    cublasDestroy(blas);
    cudnnDestroy(dnn);
    cudaStreamDestroy(stream);
  }

  void* scratch(std::size_t bytes) {
    if (bytes > workspace_bytes) {
      if (workspace) {
        void* old = std::exchange(workspace, nullptr);
        workspace_bytes = 0;
        LOCKSTEP_SAMPLE_CHECK(cudaFreeAsync(old, stream));
      }
      LOCKSTEP_SAMPLE_CHECK(cudaMallocAsync(&workspace, bytes, stream));
      workspace_bytes = bytes;
    }
    return workspace;
  }
};

inline cuda_context& cuda_ctx() {
  thread_local cuda_context c;
  return c;
}

inline unsigned grid_for(std::size_t n, unsigned threads = 256) {
  const std::size_t g = (n + threads - 1) / threads;
  return static_cast<unsigned>(g < 65535 * 16 ? (g ? g : 1) : 65535 * 16);
}

// ----------------------------------------------------------------------------------------------
// conv3x3 on cuDNN: out = conv(inp, weight), stride 1, padding 1, no bias.

struct conv_plan {
  cudnnTensorDescriptor_t src = nullptr, dst = nullptr;
  cudnnFilterDescriptor_t wei = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionFwdAlgo_t fwd{};
  cudnnConvolutionBwdDataAlgo_t bwd_data{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter{};
  std::size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;

  conv_plan() = default;
  conv_plan(const conv_plan&) = delete;
  conv_plan& operator=(const conv_plan&) = delete;
  ~conv_plan() {
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (wei) cudnnDestroyFilterDescriptor(wei);
    if (dst) cudnnDestroyTensorDescriptor(dst);
    if (src) cudnnDestroyTensorDescriptor(src);
  }
};

// The first algorithm of cuDNN's heuristic list that works, is deterministic (so that a resumed run
// repeats the uninterrupted one) and computes in fp32 FMAs, not on tensor cores (TF32); cuDNN
// lists such algorithms for these shapes.
template <class Perf>
auto pick_algorithm(const Perf* perf, int n, const char* what) {
  for (int i = 0; i < n; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC &&
        (perf[i].mathType == CUDNN_DEFAULT_MATH || perf[i].mathType == CUDNN_FMA_MATH))
      return perf[i];
  throw std::runtime_error(std::string("cuDNN offers no deterministic fp32 algorithm for ") + what);
}

inline conv_plan& conv_lookup(int B, int C, int H, int W, int K) {
  thread_local std::map<std::array<int, 5>, std::unique_ptr<conv_plan>> cache;
  const std::array<int, 5> key{B, C, H, W, K};
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  auto& ctx = cuda_ctx();
  auto plan = std::make_unique<conv_plan>();  // owns its descriptors, also if a call below throws
  conv_plan& p = *plan;
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateTensorDescriptor(&p.src));
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateTensorDescriptor(&p.dst));
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateFilterDescriptor(&p.wei));
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateConvolutionDescriptor(&p.conv));
  LOCKSTEP_SAMPLE_CHECK(cudnnSetTensor4dDescriptor(p.src, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, C, H, W));
  LOCKSTEP_SAMPLE_CHECK(cudnnSetTensor4dDescriptor(p.dst, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, B, K, H, W));
  LOCKSTEP_SAMPLE_CHECK(cudnnSetFilter4dDescriptor(p.wei, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, K, C, 3, 3));
  LOCKSTEP_SAMPLE_CHECK(
      cudnnSetConvolution2dDescriptor(p.conv, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  LOCKSTEP_SAMPLE_CHECK(cudnnSetConvolutionMathType(p.conv, CUDNN_FMA_MATH));  // no TF32
  constexpr int max_algos = 16;
  int n = 0;
  cudnnConvolutionFwdAlgoPerf_t fp[max_algos];
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(ctx.dnn, p.src, p.wei, p.conv, p.dst, max_algos, &n, fp));
  p.fwd = pick_algorithm(fp, n, "the forward convolution").algo;
  cudnnConvolutionBwdDataAlgoPerf_t dp[max_algos];
  LOCKSTEP_SAMPLE_CHECK(
      cudnnGetConvolutionBackwardDataAlgorithm_v7(ctx.dnn, p.wei, p.dst, p.conv, p.src, max_algos, &n, dp));
  p.bwd_data = pick_algorithm(dp, n, "the backward-data convolution").algo;
  cudnnConvolutionBwdFilterAlgoPerf_t wp[max_algos];
  LOCKSTEP_SAMPLE_CHECK(
      cudnnGetConvolutionBackwardFilterAlgorithm_v7(ctx.dnn, p.src, p.dst, p.conv, p.wei, max_algos, &n, wp));
  p.bwd_filter = pick_algorithm(wp, n, "the backward-filter convolution").algo;
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionForwardWorkspaceSize(ctx.dnn, p.src, p.wei, p.conv, p.dst, p.fwd, &p.fwd_ws));
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(ctx.dnn, p.wei, p.dst, p.conv, p.src, p.bwd_data,
                                                                     &p.bwd_data_ws));
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(ctx.dnn, p.src, p.dst, p.conv, p.wei,
                                                                       p.bwd_filter, &p.bwd_filter_ws));
  return *cache.emplace(key, std::move(plan)).first->second;
}

inline void conv_forward(float* out, const float* inp, const float* weight, int B, int C, int H, int W, int K) {
  auto& ctx = cuda_ctx();
  auto& p = conv_lookup(B, C, H, W, K);
  const float one = 1.0f, zero = 0.0f;
  LOCKSTEP_SAMPLE_CHECK(cudnnConvolutionForward(ctx.dnn, &one, p.src, inp, p.wei, weight, p.conv, p.fwd,
                                                ctx.scratch(p.fwd_ws), p.fwd_ws, &zero, p.dst, out));
}

// dinp may be null (the first layer needs no input gradient); dweight is overwritten.
inline void conv_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, int B,
                          int C, int H, int W, int K) {
  auto& ctx = cuda_ctx();
  auto& p = conv_lookup(B, C, H, W, K);
  const float one = 1.0f, zero = 0.0f;
  LOCKSTEP_SAMPLE_CHECK(cudnnConvolutionBackwardFilter(ctx.dnn, &one, p.src, inp, p.dst, dout, p.conv, p.bwd_filter,
                                                       ctx.scratch(p.bwd_filter_ws), p.bwd_filter_ws, &zero, p.wei,
                                                       dweight));
  if (dinp)
    LOCKSTEP_SAMPLE_CHECK(cudnnConvolutionBackwardData(ctx.dnn, &one, p.wei, weight, p.dst, dout, p.conv, p.bwd_data,
                                                       ctx.scratch(p.bwd_data_ws), p.bwd_data_ws, &zero, p.src, dinp));
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
// linear on cuBLAS: out = inp weight^T + bias. cuBLAS is column-major: a row-major (R, C) matrix
// is its transpose, so out^T (NC, B) = W (NC, F) inp^T (F, B) is gemm(T, N) on the row-major data.

static __global__ void add_bias_kernel(float* out, const float* bias, int B, int NC) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < B * NC; i += gridDim.x * blockDim.x) out[i] += bias[i % NC];
}

// dbias[c] = sum over the batch of dout[b, c], in batch order (deterministic).
static __global__ void bias_grad_kernel(float* dbias, const float* dout, int B, int NC) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= NC) return;
  float s = 0;
  for (int b = 0; b < B; ++b) s += dout[b * NC + c];
  dbias[c] = s;
}

inline void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int B, int F, int NC) {
  auto& ctx = cuda_ctx();
  const float one = 1.0f, zero = 0.0f;
  LOCKSTEP_SAMPLE_CHECK(
      cublasSgemm(ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, NC, B, F, &one, weight, F, inp, F, &zero, out, NC));
  add_bias_kernel<<<grid_for(static_cast<std::size_t>(B) * NC), 256, 0, ctx.stream>>>(out, bias, B, NC);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

inline void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, int B, int F, int NC) {
  auto& ctx = cuda_ctx();
  const float one = 1.0f, zero = 0.0f;
  // dW^T (F, NC) = inp^T (F, B) dout (B, NC)
  LOCKSTEP_SAMPLE_CHECK(
      cublasSgemm(ctx.blas, CUBLAS_OP_N, CUBLAS_OP_T, F, NC, B, &one, inp, F, dout, NC, &zero, dweight, F));
  // dinp^T (F, B) = W^T (F, NC) dout^T (NC, B)
  LOCKSTEP_SAMPLE_CHECK(
      cublasSgemm(ctx.blas, CUBLAS_OP_N, CUBLAS_OP_N, F, B, NC, &one, weight, F, dout, NC, &zero, dinp, F));
  bias_grad_kernel<<<(NC + 255) / 256, 256, 0, ctx.stream>>>(dbias, dout, B, NC);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

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
// batchnorm_relu (own kernels, layers_math.hpp). The per-channel sums are one CUDA block per
// channel, accumulated in double (CUB block reduction), so they do not depend on the batch size's
// rounding any more than the CPU's float-per-plane, double-across-planes sums do.

constexpr int bn_threads = 256;

// stats (2K): mean then M2 of each channel over this replica's B images.
static __global__ void bn_stats_kernel(float* stats, const float* inp, int B, int K, int HW) {
  using reduce = cub::BlockReduce<double, bn_threads>;
  __shared__ typename reduce::TempStorage tmp;
  __shared__ double mean_s;
  const int k = blockIdx.x;
  const std::size_t n = static_cast<std::size_t>(B) * HW;
  auto at = [&](std::size_t j) { return inp[(j / HW) * static_cast<std::size_t>(K) * HW + k * static_cast<std::size_t>(HW) + j % HW]; };
  double s = 0;
  for (std::size_t j = threadIdx.x; j < n; j += bn_threads) s += at(j);
  s = reduce(tmp).Sum(s);
  if (threadIdx.x == 0) mean_s = s / static_cast<double>(n);
  __syncthreads();
  const float mf = static_cast<float>(mean_s);
  double m2 = 0;
  for (std::size_t j = threadIdx.x; j < n; j += bn_threads) {
    const float d = at(j) - mf;
    m2 += d * d;
  }
  m2 = reduce(tmp).Sum(m2);
  if (threadIdx.x == 0) stats[k] = static_cast<float>(mean_s), stats[K + k] = static_cast<float>(m2);
}

// mean_rstd (2K): the mean then the rstd of each channel, from the host.
static __global__ void bn_relu_forward_kernel(float* out, const float* inp, const float* mean_rstd, const float* gamma,
                                       const float* beta, std::size_t n, int K, int HW) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const int k = static_cast<int>((i / HW) % K);
    out[i] = bn_relu(inp[i], bn_fold(gamma[k], beta[k], mean_rstd[k], mean_rstd[K + k]));
  }
}

// sums (2K): sum dy then sum dy xhat of each channel; also this replica's dbeta and dgamma.
static __global__ void bn_backward_sums_kernel(float* sums, float* dgamma, float* dbeta, const float* dout, const float* inp,
                                        const float* mean_rstd, const float* gamma, const float* beta, int B, int K,
                                        int HW) {
  using reduce = cub::BlockReduce<double, bn_threads>;
  __shared__ typename reduce::TempStorage tmp;
  const int k = blockIdx.x;
  const float mean = mean_rstd[k], rstd = mean_rstd[K + k];
  const bn_affine f = bn_fold(gamma[k], beta[k], mean, rstd);
  const std::size_t n = static_cast<std::size_t>(B) * HW;
  double sdy = 0, sdyx = 0;
  for (std::size_t j = threadIdx.x; j < n; j += bn_threads) {
    const std::size_t i = (j / HW) * static_cast<std::size_t>(K) * HW + k * static_cast<std::size_t>(HW) + j % HW;
    const float dy = bn_relu_dy(inp[i], dout[i], f);
    sdy += dy;
    sdyx += dy * bn_xhat(inp[i], mean, rstd);
  }
  sdy = reduce(tmp).Sum(sdy);
  __syncthreads();  // the temporary storage is reused
  sdyx = reduce(tmp).Sum(sdyx);
  if (threadIdx.x == 0) {
    sums[k] = dbeta[k] = static_cast<float>(sdy);
    sums[K + k] = dgamma[k] = static_cast<float>(sdyx);
  }
}

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

// Copies n floats between host and device on the context's stream and waits (statistics only).
inline void to_host(float* h, const float* d, std::size_t n) {
  auto s = cuda_ctx().stream;
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(h, d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
}
inline void to_device(float* d, const float* h, std::size_t n) {
  auto s = cuda_ctx().stream;
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(d, h, n * sizeof(float), cudaMemcpyHostToDevice, s));
  LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));  // h may be a temporary of the caller
}

// As layers_cpu.hpp's batchnorm_relu_forward, except: mean_rstd (2K, device) replaces mean and
// rstd; count and the running statistics stay on the host; scratch is 2K device floats.
inline void batchnorm_relu_forward(float* out, float* mean_rstd, float* count, float* running_mean,
                                   float* running_var, const float* inp, const float* gamma, const float* beta, int B,
                                   int K, int HW, const bn_group& group, bool training, float* scratch,
                                   float momentum = 0.1f, float eps = 1e-5f) {
  auto s = cuda_ctx().stream;
  std::vector<float> host(2 * static_cast<std::size_t>(K));  // mean then rstd
  if (training) {
    bn_stats_kernel<<<K, bn_threads, 0, s>>>(scratch, inp, B, K, HW);
    LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
    std::vector<float> stats(1 + 2 * static_cast<std::size_t>(K));  // (n, mean[K], M2[K]) of this replica
    stats[0] = static_cast<float>(B) * HW;
    to_host(stats.data() + 1, scratch, 2 * static_cast<std::size_t>(K));
    std::vector<float> all = stats;
    if (group.size > 1) {
      all.resize(stats.size() * static_cast<std::size_t>(group.size));
      group.all_gather(stats, all);
    }
    bn_merge_stats(host.data(), host.data() + K, count, running_mean, running_var, all, group.size, K, momentum, eps);
  } else {
    for (int k = 0; k < K; ++k) host[k] = running_mean[k], host[K + k] = 1.0f / std::sqrt(running_var[k] + eps);
  }
  to_device(mean_rstd, host.data(), host.size());
  const std::size_t n = static_cast<std::size_t>(B) * K * HW;
  bn_relu_forward_kernel<<<grid_for(n), 256, 0, s>>>(out, inp, mean_rstd, gamma, beta, n, K, HW);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// As layers_cpu.hpp's batchnorm_relu_backward, with mean_rstd from the forward pass and scratch
// of 2K device floats.
inline void batchnorm_relu_backward(float* dinp, float* dgamma, float* dbeta, const float* dout, const float* inp,
                                    const float* mean_rstd, float count, const float* gamma, const float* beta, int B,
                                    int K, int HW, const bn_group& group, float* scratch) {
  auto s = cuda_ctx().stream;
  bn_backward_sums_kernel<<<K, bn_threads, 0, s>>>(scratch, dgamma, dbeta, dout, inp, mean_rstd, gamma, beta, B, K, HW);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
  if (group.size > 1) {
    std::vector<float> sums(2 * static_cast<std::size_t>(K));
    to_host(sums.data(), scratch, sums.size());
    group.sum(sums);
    to_device(scratch, sums.data(), sums.size());
  }
  const std::size_t n = static_cast<std::size_t>(B) * K * HW;
  bn_relu_backward_kernel<<<grid_for(n), 256, 0, s>>>(dinp, dout, inp, mean_rstd, scratch, count, gamma, beta, n,
                                                      K, HW);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// softmax cross-entropy (own kernels, layers_math.hpp): one thread per row forward, per logit
// backward. The loss is summed on the host in row order, as on the CPU.

static __global__ void xent_forward_kernel(float* probs, double* row_loss, int* row_argmax, const float* logits,
                                    const int* labels, int B, int NC, float smoothing) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < B) row_loss[b] = xent_row(probs + b * NC, &row_argmax[b], logits + b * NC, labels[b], NC, smoothing);
}

static __global__ void xent_backward_kernel(float* dlogits, const float* probs, const int* labels, int B, int NC,
                                     float smoothing) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < B * NC; i += gridDim.x * blockDim.x)
    dlogits[i] = xent_grad(probs[i], i % NC, labels[i / NC], NC, smoothing, 1.0f / B);
}

// labels: device (B). scratch: at least B doubles + B ints of device memory.
inline float softmax_xent_forward(float* probs, int* correct, const float* logits, const int* labels,
                                  const int* host_labels, int B, int NC, float smoothing, void* scratch) {
  auto s = cuda_ctx().stream;
  auto* row_loss = static_cast<double*>(scratch);
  auto* row_argmax = reinterpret_cast<int*>(row_loss + B);
  xent_forward_kernel<<<(B + 127) / 128, 128, 0, s>>>(probs, row_loss, row_argmax, logits, labels, B, NC, smoothing);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
  std::vector<double> loss(static_cast<std::size_t>(B));
  std::vector<int> argmax(static_cast<std::size_t>(B));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(loss.data(), row_loss, B * sizeof(double), cudaMemcpyDeviceToHost, s));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(argmax.data(), row_argmax, B * sizeof(int), cudaMemcpyDeviceToHost, s));
  LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
  double total = 0;
  int hits = 0;
  for (int b = 0; b < B; ++b) total += loss[b], hits += argmax[b] == host_labels[b];
  if (correct) *correct = hits;
  return static_cast<float>(total / B);
}

inline void softmax_xent_backward(float* dlogits, const float* probs, const int* labels, int B, int NC,
                                  float smoothing) {
  xent_backward_kernel<<<grid_for(static_cast<std::size_t>(B) * NC), 256, 0, cuda_ctx().stream>>>(
      dlogits, probs, labels, B, NC, smoothing);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

}  // namespace fashion::gpu
