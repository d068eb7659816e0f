// lockstep/parallel/gemm.hpp: the one matrix product the model-parallel layers need, as the
// caller's callable, so the library carries no BLAS (the sample passes oneDNN's dnnl_sgemm, a
// test a loop).
//
//   C = op(A) · op(B) + beta · C,  row-major,  op(A) m x k, op(B) k x n, C m x n
//   trans_a: A is stored k x m (lda >= m), else m x k (lda >= k); likewise B
//
// The argument block is dnnl_sgemm's (and cblas_sgemm's row-major one) with alpha = 1, so a BLAS
// call is one line: dnnl_sgemm(a.trans_a ? 'T' : 'N', a.trans_b ? 'T' : 'N', m, n, k, 1.f, a.a,
// a.lda, a.b, a.ldb, a.beta, a.c, a.ldc).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>

namespace lockstep::parallel {

struct gemm_args {
  bool trans_a = false, trans_b = false;
  std::size_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  std::size_t lda = 0;
  const float* b = nullptr;
  std::size_t ldb = 0;
  float beta = 0.0f;
  float* c = nullptr;
  std::size_t ldc = 0;
};

template <class M>
concept matmul = std::invocable<M&, const gemm_args&>;

namespace detail {

// Empty products are settled here, so a caller's BLAS never sees m, n or k of 0 (a batch with no
// rows on some rank, a round with nothing in it): C = beta C when k is 0.
template <matmul M>
void run_gemm(M& mm, const gemm_args& a) {
  if (a.m == 0 || a.n == 0) return;
  if (a.k == 0) {
    for (std::size_t i = 0; i < a.m; ++i)
      for (std::size_t j = 0; j < a.n; ++j) a.c[i * a.ldc + j] = a.beta == 0.0f ? 0.0f : a.beta * a.c[i * a.ldc + j];
    return;
  }
  mm(a);
}

}  // namespace detail
}  // namespace lockstep::parallel
