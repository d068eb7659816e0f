// samples/fashion_cnn/head_cpu.hpp: the AlexNet-like head of the Fashion CNN on the CPU (--fc
// H1,H2): features -> FC -> ReLU -> FC -> ReLU -> the classifier, with every product one
// dnnl_sgemm call through lockstep::parallel::gemm_args, the argument block the model-parallel
// layers hand their products to (head_hybrid.hpp runs the same products on slices).
//
// The element math (bias_relu, relu_back) is layers_math.hpp's, shared with the GPU head
// (layers_cuda.cuh).
// Shape legend: B images of this replica, F features out of the conv blocks, H1, H2 hidden widths,
// NC classes. fc1_w is (F, H1), fc2_w (H1, H2): in x out, Y = X · W.
#pragma once

#include <oneapi/dnnl/dnnl.h>

#include <stdexcept>
#include <string>

#include <lockstep/parallel/gemm.hpp>

#include "layers_math.hpp"

namespace fashion {

// C = op(A) op(B) + beta C, row-major, on oneDNN.
inline void sgemm(const lockstep::parallel::gemm_args& a) {
  if (a.m == 0 || a.n == 0) return;
  const dnnl_status_t st =
      dnnl_sgemm(a.trans_a ? 'T' : 'N', a.trans_b ? 'T' : 'N', static_cast<dnnl_dim_t>(a.m), static_cast<dnnl_dim_t>(a.n),
                 static_cast<dnnl_dim_t>(a.k), 1.0f, a.a, static_cast<dnnl_dim_t>(a.lda), a.b, static_cast<dnnl_dim_t>(a.ldb),
                 a.beta, a.c, static_cast<dnnl_dim_t>(a.ldc));
  if (st != dnnl_success) throw std::runtime_error("dnnl_sgemm failed with status " + std::to_string(static_cast<int>(st)));
}

// y (rows, n) += b (n), then ReLU, in place.
inline void bias_relu_forward(float* y, const float* b, std::size_t rows, std::size_t n) {
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < n; ++j) y[i * n + j] = bias_relu(y[i * n + j], b[j]);
}

// dy (rows, n) *= [y > 0] in place (y: the ReLU's output), and db (n) = the sum over rows of the
// result (overwritten).
inline void bias_relu_backward(float* dy, float* db, const float* y, std::size_t rows, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) db[j] = 0.0f;
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      dy[i * n + j] = relu_back(dy[i * n + j], y[i * n + j]);
      db[j] += dy[i * n + j];
    }
}

// One hidden FC with ReLU, forward: y (B, out) = relu(x (B, in) · w (in, out) + b).
inline void fc_relu_forward(float* y, const float* x, const float* w, const float* b, std::size_t B, std::size_t in,
                            std::size_t out) {
  sgemm({false, false, B, out, in, x, in, w, out, 0.0f, y, out});
  bias_relu_forward(y, b, B, out);
}

// Its backward: dy (B, out) is turned into the pre-ReLU gradient in place; dw (in, out), db (out)
// and dx (B, in, or null) are overwritten. dx is computed before the caller may change w.
inline void fc_relu_backward(float* dx, float* dw, float* db, float* dy, const float* x, const float* y, const float* w,
                             std::size_t B, std::size_t in, std::size_t out) {
  bias_relu_backward(dy, db, y, B, out);
  sgemm({true, false, in, out, B, x, in, dy, out, 0.0f, dw, out});
  if (dx) sgemm({false, true, B, in, out, dy, out, w, out, 0.0f, dx, in});
}

}  // namespace fashion
