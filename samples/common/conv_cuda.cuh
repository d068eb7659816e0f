// samples/common/conv_cuda.cuh: a convolution on cuDNN (R x R kernel, stride S, padding R/2, no
// bias), forward, backward-data and backward-filter, for both samples' GPU backends: the Fashion
// CNN's NCHW 3x3 convolutions and ResNet-50's NHWC ones.
//
// Activations and filters share one layout (NCHW tensors with KCRS filters, or NHWC tensors with
// KRSC filters): cuDNN's algorithms for NHWC, its tensor-core kernels above all, want NHWC filters.
// fp32: every tensor fp32, FMA math (no TF32). bf16: every tensor bf16, compute type fp32, tensor
// cores allowed. Algorithms are cuDNN's heuristic choice among the deterministic ones in that math
// type (pick_algorithm), chosen once per shape and thread and kept with their descriptors.
//
// Shape legend: B images, C input channels, H x W input side, K output channels, R kernel side,
// S stride, OH x OW output side.
#pragma once

#include <array>
#include <map>
#include <memory>

#include "cuda_context.cuh"

namespace sample::gpu {

struct conv_desc {
  int B, C, H, W, K, R, S;
  int OH() const { return (H + 2 * (R / 2) - R) / S + 1; }
  int OW() const { return (W + 2 * (R / 2) - R) / S + 1; }
};

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

// format: CUDNN_TENSOR_NCHW or CUDNN_TENSOR_NHWC (activations and filters); dt: CUDNN_DATA_FLOAT or
// CUDNN_DATA_BFLOAT16.
inline conv_plan& conv_lookup(const conv_desc& s, cudnnTensorFormat_t format, cudnnDataType_t dt) {
  thread_local std::map<std::array<int, 9>, std::unique_ptr<conv_plan>> cache;
  const std::array<int, 9> key{s.B, s.C, s.H, s.W, s.K, s.R, s.S, static_cast<int>(format), static_cast<int>(dt)};
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  auto& ctx = cuda_ctx();
  auto plan = std::make_unique<conv_plan>();  // owns its descriptors, also if a call below throws
  conv_plan& p = *plan;
  const bool bf16 = dt == CUDNN_DATA_BFLOAT16;
  const int P = s.R / 2;
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateTensorDescriptor(&p.src));
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateTensorDescriptor(&p.dst));
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateFilterDescriptor(&p.wei));
  LOCKSTEP_SAMPLE_CHECK(cudnnCreateConvolutionDescriptor(&p.conv));
  // Dimensions are always given as (N, C, H, W); the format says how they lie in memory.
  LOCKSTEP_SAMPLE_CHECK(cudnnSetTensor4dDescriptor(p.src, format, dt, s.B, s.C, s.H, s.W));
  LOCKSTEP_SAMPLE_CHECK(cudnnSetTensor4dDescriptor(p.dst, format, dt, s.B, s.K, s.OH(), s.OW()));
  LOCKSTEP_SAMPLE_CHECK(cudnnSetFilter4dDescriptor(p.wei, dt, format, s.K, s.C, s.R, s.R));
  LOCKSTEP_SAMPLE_CHECK(
      cudnnSetConvolution2dDescriptor(p.conv, P, P, s.S, s.S, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  const cudnnMathType_t math = bf16 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
  LOCKSTEP_SAMPLE_CHECK(cudnnSetConvolutionMathType(p.conv, math));
  constexpr int max_algos = 16;
  int n = 0;
  cudnnConvolutionFwdAlgoPerf_t fp[max_algos];
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(ctx.dnn, p.src, p.wei, p.conv, p.dst, max_algos, &n, fp));
  p.fwd = pick_algorithm(fp, n, "the forward convolution", math).algo;
  cudnnConvolutionBwdDataAlgoPerf_t dp[max_algos];
  LOCKSTEP_SAMPLE_CHECK(
      cudnnGetConvolutionBackwardDataAlgorithm_v7(ctx.dnn, p.wei, p.dst, p.conv, p.src, max_algos, &n, dp));
  p.bwd_data = pick_algorithm(dp, n, "the backward-data convolution", math).algo;
  cudnnConvolutionBwdFilterAlgoPerf_t wp[max_algos];
  LOCKSTEP_SAMPLE_CHECK(
      cudnnGetConvolutionBackwardFilterAlgorithm_v7(ctx.dnn, p.src, p.dst, p.conv, p.wei, max_algos, &n, wp));
  p.bwd_filter = pick_algorithm(wp, n, "the backward-filter convolution", math).algo;
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionForwardWorkspaceSize(ctx.dnn, p.src, p.wei, p.conv, p.dst, p.fwd, &p.fwd_ws));
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(ctx.dnn, p.wei, p.dst, p.conv, p.src, p.bwd_data,
                                                                     &p.bwd_data_ws));
  LOCKSTEP_SAMPLE_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(ctx.dnn, p.src, p.dst, p.conv, p.wei,
                                                                       p.bwd_filter, &p.bwd_filter_ws));
  return *cache.emplace(key, std::move(plan)).first->second;
}

// out = conv(inp, weight); every pointer of the plan's type and layout.
inline void conv_run_forward(void* out, const void* inp, const void* weight, const conv_plan& p) {
  auto& ctx = cuda_ctx();
  const float one = 1.0f, zero = 0.0f;
  LOCKSTEP_SAMPLE_CHECK(cudnnConvolutionForward(ctx.dnn, &one, p.src, inp, p.wei, weight, p.conv, p.fwd,
                                                ctx.scratch(p.fwd_ws), p.fwd_ws, &zero, p.dst, out));
}

// dweight = the gradient of the filter, overwritten.
inline void conv_run_backward_filter(void* dweight, const void* dout, const void* inp, const conv_plan& p) {
  auto& ctx = cuda_ctx();
  const float one = 1.0f, zero = 0.0f;
  LOCKSTEP_SAMPLE_CHECK(cudnnConvolutionBackwardFilter(ctx.dnn, &one, p.src, inp, p.dst, dout, p.conv, p.bwd_filter,
                                                       ctx.scratch(p.bwd_filter_ws), p.bwd_filter_ws, &zero, p.wei,
                                                       dweight));
}

// dinp = the gradient of the input, overwritten.
inline void conv_run_backward_data(void* dinp, const void* dout, const void* weight, const conv_plan& p) {
  auto& ctx = cuda_ctx();
  const float one = 1.0f, zero = 0.0f;
  LOCKSTEP_SAMPLE_CHECK(cudnnConvolutionBackwardData(ctx.dnn, &one, p.wei, weight, p.dst, dout, p.conv, p.bwd_data,
                                                     ctx.scratch(p.bwd_data_ws), p.bwd_data_ws, &zero, p.src, dinp));
}

}  // namespace sample::gpu
