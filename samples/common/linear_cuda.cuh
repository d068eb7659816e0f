// samples/common/linear_cuda.cuh: the classifier of both samples' GPU backends on cuBLAS:
// out = inp weight^T + bias. T is the type of inp and weight: float (cublasSgemm, fp32 FMAs), or
// bf16 bits (std::uint16_t; cublasGemmEx with bf16 inputs, fp32 outputs and CUBLAS_COMPUTE_32F,
// as oneDNN's bf16 inner product on the CPU); out, bias and every gradient are fp32. Under bf16
// the output gradient is rounded to bf16 for the two products of backward (scratch slot_grad), as
// the CPU backend does.
// cuBLAS is column-major: a row-major (R, C) matrix is its transpose, so
// out^T (NC, B) = W (NC, F) inp^T (F, B) is gemm(T, N) on the row-major data.
//
// Shape legend: B rows, F features, NC classes.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda_context.cuh"

namespace sample::gpu {

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

// C (m, n) = op(A) op(B), column-major, A and B of T, C fp32.
template <class T>
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const T* A, int lda, const T* B, int ldb,
          float* C, int ldc) {
  auto& ctx = cuda_ctx();
  const float one = 1.0f, zero = 0.0f;
  if constexpr (std::is_same_v<T, float>)
    LOCKSTEP_SAMPLE_CHECK(cublasSgemm(ctx.blas, ta, tb, m, n, k, &one, A, lda, B, ldb, &zero, C, ldc));
  else
    LOCKSTEP_SAMPLE_CHECK(cublasGemmEx(ctx.blas, ta, tb, m, n, k, &one, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &zero,
                                       C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

template <class T>
void linear_forward(float* out,          // (B, NC)
                    const T* inp,        // (B, F)
                    const T* weight,     // (NC, F)
                    const float* bias,   // (NC)
                    int B, int F, int NC) {
  gemm<T>(CUBLAS_OP_T, CUBLAS_OP_N, NC, B, F, weight, F, inp, F, out, NC);
  add_bias_kernel<<<grid_for(static_cast<std::size_t>(B) * NC), 256, 0, cuda_ctx().stream>>>(out, bias, B, NC);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

template <class T>
void linear_backward(float* dinp,         // (B, F), overwritten
                     float* dweight,      // (NC, F), overwritten
                     float* dbias,        // (NC), overwritten
                     const float* dout,   // (B, NC)
                     const T* inp,        // (B, F)
                     const T* weight,     // (NC, F)
                     int B, int F, int NC) {
  auto& ctx = cuda_ctx();
  const T* g = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    g = dout;
  } else {
    const std::size_t n = static_cast<std::size_t>(B) * NC;
    auto* r = static_cast<std::uint16_t*>(ctx.scratch(n * sizeof(std::uint16_t), slot_grad));
    round_bf16(r, dout, n);
    g = r;
  }
  // dW^T (F, NC) = inp^T (F, B) dout (B, NC)
  gemm<T>(CUBLAS_OP_N, CUBLAS_OP_T, F, NC, B, inp, F, g, NC, dweight, F);
  // dinp^T (F, B) = W^T (F, NC) dout^T (NC, B)
  gemm<T>(CUBLAS_OP_N, CUBLAS_OP_N, F, B, NC, weight, F, g, NC, dinp, F);
  bias_grad_kernel<<<(NC + 255) / 256, 256, 0, ctx.stream>>>(dbias, dout, B, NC);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

}  // namespace sample::gpu
