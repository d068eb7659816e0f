// samples/common/cuda_context.cuh: what the samples' cuDNN/cuBLAS backends (Fashion CNN, ResNet-50)
// share of the CUDA runtime: error checks for cuDNN and cuBLAS that name the call, the per-thread
// context (stream, cuDNN and cuBLAS handles, scratch), grid sizes, blocking host/device copies of
// small arrays, fp32 -> bf16 rounding on the device, and the choice of a deterministic cuDNN
// algorithm.
//
// One context per host thread, so replicas running as threads never share a stream or a handle.
// Scratch is a few numbered slots grown on demand (stream ordered: a slot freed while earlier
// kernels still read it is freed after them); a caller names the slot it owns:
//   slot_workspace  cuDNN's workspace          slot_weights  a convolution's reordered weights
//   slot_grad       a bf16 copy of an output gradient
//   slot_out        a convolution's result before it reaches the caller's buffer: a bf16 output
//                   before widening to fp32, or a weight gradient in cuDNN's filter layout (KRSC,
//                   fp32 or bf16) before reordering
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include <lockstep/codec/bf16.hpp>
#include <lockstep/device/runtime.hpp>

namespace sample::gpu {

using lockstep::device::check;  // cudaError_t: lockstep's own, a lockstep::error naming the call
inline void check(cudnnStatus_t e, const char* what) {
  if (e != CUDNN_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": " + cudnnGetErrorString(e));
}
inline void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + cublasGetStatusString(e));
}
#define LOCKSTEP_SAMPLE_CHECK(call) ::sample::gpu::check((call), #call)

enum scratch_slot : int { slot_workspace, slot_weights, slot_out, slot_grad, slot_count };

struct cuda_context {
  cudaStream_t stream = nullptr;
  cudnnHandle_t dnn = nullptr;
  cublasHandle_t blas = nullptr;
  std::array<void*, slot_count> slots{};             // device scratch, grown on demand
  std::array<std::size_t, slot_count> slot_bytes{};

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
    for (void* p : slots)
      if (p) cudaFreeAsync(p, stream);
    cudaStreamSynchronize(stream);
    cublasDestroy(blas);
    cudnnDestroy(dnn);
    cudaStreamDestroy(stream);
  }

  // At least `bytes` of device scratch in slot `s`, valid for work enqueued on `stream` until the
  // next call for the same slot with more bytes.
  void* scratch(std::size_t bytes, scratch_slot s = slot_workspace) {
    if (bytes > slot_bytes[s]) {
      if (slots[s]) {
        void* old = std::exchange(slots[s], nullptr);
        slot_bytes[s] = 0;
        LOCKSTEP_SAMPLE_CHECK(cudaFreeAsync(old, stream));
      }
      LOCKSTEP_SAMPLE_CHECK(cudaMallocAsync(&slots[s], bytes, stream));
      slot_bytes[s] = bytes;
    }
    return slots[s];
  }
};

inline cuda_context& cuda_ctx() {
  thread_local cuda_context c;
  return c;
}

// Blocks for a grid-stride loop over n elements.
inline unsigned grid_for(std::size_t n, unsigned threads = 256) {
  const std::size_t g = (n + threads - 1) / threads;
  return static_cast<unsigned>(g < 65535 * 16 ? (g ? g : 1) : 65535 * 16);
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

static __global__ void round_bf16_kernel(std::uint16_t* out, const float* inp, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    out[i] = lockstep::codec::bf16::to_wire(inp[i]);
}

// out = inp rounded to bf16 (nearest even, the bits of lockstep::codec::bf16::to_wire as on the
// CPU), on the context's stream.
inline void round_bf16(std::uint16_t* out,  // (n) bf16 bits
                       const float* inp,    // (n)
                       std::size_t n) {
  round_bf16_kernel<<<grid_for(n), 256, 0, cuda_ctx().stream>>>(out, inp, n);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// The first algorithm of cuDNN's heuristic list that works, is deterministic (so that a resumed run
// repeats the uninterrupted one) and runs in `math`, the math type set on the convolution
// descriptor: fp32 CUDNN_FMA_MATH (fp32 FMAs only, never TF32 on tensor cores), bf16
// CUDNN_TENSOR_OP_MATH (tensor cores, accumulating in fp32). The heuristic may also list an
// algorithm under another math type (CUDNN_DEFAULT_MATH, which lets fp32 run as TF32); its
// determinism is that of another engine than the one the descriptor runs, so such results are
// skipped rather than adopted by setting the descriptor to them: one descriptor serves the
// forward and both backward passes, and fp32 must stay free of TF32.
template <class Perf>
auto pick_algorithm(const Perf* perf, int n, const char* what, cudnnMathType_t math) {
  for (int i = 0; i < n; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC &&
        perf[i].mathType == math)
      return perf[i];
  throw std::runtime_error(std::string("cuDNN offers no deterministic ") +
                           (math == CUDNN_TENSOR_OP_MATH ? "bf16" : "fp32") + " algorithm for " + what);
}

}  // namespace sample::gpu
