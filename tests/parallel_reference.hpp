// The model-parallel test problem and its fp64 reference, shared by tests/test_parallel.cpp
// (ranks as threads) and tests/mpi/test_mpi_parallel.cpp (ranks under mpirun): a column-split FC
// (in -> hid) followed by a row-split FC (hid -> out), seeded inputs that are a function of the
// row's place in the whole batch, and the bounds stated in tests/test_parallel.cpp.
// Include after Catch2 (or thread_safe_catch.hpp).
#pragma once

#include <lockstep/lockstep.hpp>

#include "collective_bounds.hpp"

#include <cmath>
#include <cstring>
#include <vector>

namespace lockstep_test::parallel_reference {

using namespace lockstep;


// The test's matrix product: a plain loop, summed in fp32 like a BLAS.
inline void naive_gemm(const parallel::gemm_args& g) {
  for (std::size_t i = 0; i < g.m; ++i)
    for (std::size_t j = 0; j < g.n; ++j) {
      float s = 0.0f;
      for (std::size_t p = 0; p < g.k; ++p) {
        const float a = g.trans_a ? g.a[p * g.lda + i] : g.a[i * g.lda + p];
        const float b = g.trans_b ? g.b[j * g.ldb + p] : g.b[p * g.ldb + j];
        s += a * b;
      }
      g.c[i * g.ldc + j] = s + (g.beta == 0.0f ? 0.0f : g.beta * g.c[i * g.ldc + j]);
    }
}

inline float value(std::uint64_t seed, std::size_t i) {
  std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1p-52 - 1.0);
}

// Row-major matrix in fp64 for the reference.
struct mat {
  std::size_t r = 0, c = 0;
  std::vector<double> v;
  mat(std::size_t rr, std::size_t cc) : r(rr), c(cc), v(rr * cc, 0.0) {}
  double& operator()(std::size_t i, std::size_t j) { return v[i * c + j]; }
  double operator()(std::size_t i, std::size_t j) const { return v[i * c + j]; }
};
// a (m x k) times b (k x n), and the sum of |terms| per element.
inline std::pair<mat, mat> mul(const mat& a, const mat& b) {
  mat y(a.r, b.c), mag(a.r, b.c);
  for (std::size_t i = 0; i < a.r; ++i)
    for (std::size_t j = 0; j < b.c; ++j)
      for (std::size_t p = 0; p < a.c; ++p) y(i, j) += a(i, p) * b(p, j), mag(i, j) += std::abs(a(i, p) * b(p, j));
  return {y, mag};
}
inline mat transpose(const mat& a) {
  mat t(a.c, a.r);
  for (std::size_t i = 0; i < a.r; ++i)
    for (std::size_t j = 0; j < a.c; ++j) t(j, i) = a(i, j);
  return t;
}
inline double max_abs(const mat& a) {
  double m = 0;
  for (double x : a.v) m = std::max(m, std::abs(x));
  return m;
}

template <class C>
constexpr double gather_delta() { return delta<C>(); }

// What each rank hands back for the main thread to check.
struct rank_out {
  std::vector<float> x_used;  // column layer's gathered X (B x in)
  std::vector<float> y1;      // B x cols_k
  std::vector<float> y2;      // B_k x out
  std::vector<float> dy_used; // row layer's gathered dY (B x out)
  std::vector<float> dh;      // B x m_k
  std::vector<float> dw2;     // m_k x out
  std::vector<float> dw1;     // in x cols_k
  std::vector<float> dx;      // B_k x in
  std::size_t first_col = 0, cols = 0;
};

struct problem {
  std::size_t in, hid, out;
  std::vector<std::size_t> rows;  // (rank)
  std::size_t total() const {
    std::size_t t = 0;
    for (auto r : rows) t += r;
    return t;
  }
  std::size_t first(std::size_t k) const {
    std::size_t t = 0;
    for (std::size_t q = 0; q < k; ++q) t += rows[q];
    return t;
  }
  // Seeded inputs: x row i of the whole batch, W1 (in x hid), W2 (hid x out), dY2 row i.
  float x(std::size_t i, std::size_t f) const { return value(1, i * in + f); }
  float w1(std::size_t f, std::size_t j) const { return 0.5f * value(2, f * hid + j); }
  float w2(std::size_t j, std::size_t o) const { return 0.5f * value(3, j * out + o); }
  float dy2(std::size_t i, std::size_t o) const { return value(4, i * out + o); }
};

// Rank k's share of the problem: its rows of x (B_k x in) and dY2 (B_k x out), its columns
// [c0, c0 + nc) of W1 (in x nc) and the same rows of W2 (nc x out).
struct rank_in {
  std::vector<float> x, w1, w2, dy2;
};
inline rank_in rank_inputs(const problem& p, std::size_t k, std::size_t c0, std::size_t nc) {
  const std::size_t r0 = p.first(k), nr = p.rows[k];
  rank_in in{std::vector<float>(nr * p.in), std::vector<float>(p.in * nc), std::vector<float>(nc * p.out),
             std::vector<float>(nr * p.out)};
  for (std::size_t i = 0; i < nr; ++i)
    for (std::size_t f = 0; f < p.in; ++f) in.x[i * p.in + f] = p.x(r0 + i, f);
  for (std::size_t f = 0; f < p.in; ++f)
    for (std::size_t j = 0; j < nc; ++j) in.w1[f * nc + j] = p.w1(f, c0 + j);
  for (std::size_t j = 0; j < nc; ++j)
    for (std::size_t o = 0; o < p.out; ++o) in.w2[j * p.out + o] = p.w2(c0 + j, o);
  for (std::size_t i = 0; i < nr; ++i)
    for (std::size_t o = 0; o < p.out; ++o) in.dy2[i * p.out + o] = p.dy2(r0 + i, o);
  return in;
}

// How a rank runs the stack's products and reads its results: on a host group, now (`at_once`);
// on a stream-ordered group (tests/test_parallel_stream.cpp) the products and the copies of the
// results are enqueued on the compute stream and finish() waits for it once, at the end.
struct at_once {
  static void gemm(const parallel::gemm_args& a) { naive_gemm(a); }
  static void copy(std::vector<float>& to, std::span<const float> from) { to.assign(from.begin(), from.end()); }
  template <class Layer>
  static void bind(Layer&) {}
  static void finish() {}
};

// One rank's part of the stack: forward through both layers, backward through both.
template <class S, class C, class G, class Order = at_once>
rank_out run_rank(G& g, const problem& p, Order order = {}) {
    using Tr = typename G::transport_type;
    const auto k = static_cast<std::size_t>(g.rank());
    parallel::column_linear<S, Tr, C> fc1(g, p.in, p.hid);
    parallel::row_linear<S, Tr, C> fc2(g, p.hid, p.out);
    order.bind(fc1);
    order.bind(fc2);
    auto mm = [&](const parallel::gemm_args& a) { order.gemm(a); };
    const std::size_t c0 = fc1.first_col(), nc = fc1.cols(), nr = p.rows[k];
    if (fc2.first_in_row() != c0 || fc2.in_rows() != nc) throw std::logic_error("column and row splits differ");
    const auto [x, w1, w2, dy2] = rank_inputs(p, k, c0, nc);

    rank_out o;
    o.first_col = c0, o.cols = nc;
    // The inputs as a model would hand them on: written in the compute order (on a stream, the
    // layer's wire must wait for these copies before it sends a row).
    std::vector<float> xs, dy2s;
    order.copy(xs, x);
    order.copy(dy2s, dy2);
    auto y1 = fc1.forward(std::span<const float>(xs), std::span<const float>(w1), mm);
    order.copy(o.y1, y1);
    order.copy(o.x_used, fc1.inputs());
    auto y2 = fc2.forward(std::span<const float>(o.y1), nr, std::span<const float>(w2), mm);
    order.copy(o.y2, y2);
    const std::size_t B = fc1.rows().total();
    o.dh.assign(B * nc, -7.0f);
    o.dw2.assign(nc * p.out, -7.0f);
    fc2.backward(std::span<const float>(o.y1), std::span<const float>(dy2s), std::span<const float>(w2), std::span<float>(o.dw2),
                 std::span<float>(o.dh), mm);
    order.copy(o.dy_used, fc2.output_gradients());
    o.dw1.assign(p.in * nc, -7.0f);
    o.dx.assign(nr * p.in, -7.0f);
    fc1.backward(std::span<const float>(o.dh), std::span<const float>(w1), std::span<float>(o.dw1), std::span<float>(o.dx), mm);
    order.finish();
    return o;
}

inline std::vector<std::vector<std::size_t>> row_patterns(std::size_t K) {
  std::vector<std::vector<std::size_t>> v;
  v.push_back(std::vector<std::size_t>(K, 3));  // equal
  std::vector<std::size_t> uneven(K), one(K, 0);
  for (std::size_t k = 0; k < K; ++k) uneven[k] = (k * 5 + 3) % 7;  // 3 1 6 4 2 0 5 3: a zero among them
  one[K - 1] = 5;                                                   // all rows on the last rank
  v.push_back(uneven);
  v.push_back(one);
  return v;
}

// |got - want| <= bound, else FAIL naming the quantity and the element.
// A rank's results as one flat vector and back (the MPI test all-gathers them, so every rank checks
// the whole problem). Sizes follow from the problem: rank k's columns are chunk_range(hid, K, k).
inline std::vector<float> pack(const rank_out& o) {
  std::vector<float> v;
  for (const auto* part : {&o.x_used, &o.y1, &o.y2, &o.dy_used, &o.dh, &o.dw2, &o.dw1, &o.dx}) v.insert(v.end(), part->begin(), part->end());
  return v;
}
inline std::size_t packed_size(const problem& p, std::size_t k) {
  const std::size_t K = p.rows.size(), B = p.total(), nc = chunk_range(p.hid, K, k).second - chunk_range(p.hid, K, k).first;
  return B * p.in + B * nc + p.rows[k] * p.out + B * p.out + B * nc + nc * p.out + p.in * nc + p.rows[k] * p.in;
}
inline rank_out unpack(const problem& p, std::size_t k, const float* v) {
  const std::size_t K = p.rows.size(), B = p.total();
  const auto [c0, c1] = chunk_range(p.hid, K, k);
  const std::size_t nc = c1 - c0;
  rank_out o;
  o.first_col = c0, o.cols = nc;
  for (auto [part, n] : {std::pair{&o.x_used, B * p.in}, {&o.y1, B * nc}, {&o.y2, p.rows[k] * p.out}, {&o.dy_used, B * p.out},
                         {&o.dh, B * nc}, {&o.dw2, nc * p.out}, {&o.dw1, p.in * nc}, {&o.dx, p.rows[k] * p.in}}) {
    part->assign(v, v + n);
    v += n;
  }
  return o;
}

inline void close(const char* what, std::size_t i, std::size_t j, double got, double want, double bound) {
  if (!(std::abs(got - want) <= bound))
    FAIL(what << "(" << i << ", " << j << "): " << got << " vs reference " << want << ", bound " << bound);
}

// Checks every rank's results (outs, by rank) against the fp64 reference.
template <class C>
void check_stack(const problem& p, const std::vector<rank_out>& outs) {
  const std::size_t K = p.rows.size(), B = p.total();
  const int hops = static_cast<int>(K) - 1;  // a ring
  const double d = gather_delta<C>(), fp = 1e-5, red = lockstep_test::error_factor<C>(hops + 1, static_cast<int>(K));
  const bool rel = lockstep_test::value_relative<C>;

  for (std::size_t k = 1; k < K; ++k) {  // every rank computed with the same rows, bit for bit
    REQUIRE(outs[k].x_used.size() == outs[0].x_used.size());
    REQUIRE((B == 0 || std::memcmp(outs[k].x_used.data(), outs[0].x_used.data(), outs[0].x_used.size() * 4) == 0));
    REQUIRE((B == 0 || std::memcmp(outs[k].dy_used.data(), outs[0].dy_used.data(), outs[0].dy_used.size() * 4) == 0));
  }

  // ---- column_linear forward: Y1 = X W1 (X quantised once) ----
  mat X(B, p.in), W1(p.in, p.hid), W2(p.hid, p.out), DY2(B, p.out);
  for (std::size_t i = 0; i < B; ++i)
    for (std::size_t f = 0; f < p.in; ++f) X(i, f) = p.x(i, f);
  for (std::size_t f = 0; f < p.in; ++f)
    for (std::size_t j = 0; j < p.hid; ++j) W1(f, j) = p.w1(f, j);
  for (std::size_t j = 0; j < p.hid; ++j)
    for (std::size_t o = 0; o < p.out; ++o) W2(j, o) = p.w2(j, o);
  for (std::size_t i = 0; i < B; ++i)
    for (std::size_t o = 0; o < p.out; ++o) DY2(i, o) = p.dy2(i, o);
  const double xmax = max_abs(X);
  const auto [Y1, Y1mag] = mul(X, W1);
  mat H(B, p.hid);  // the Y1 every rank handed on, assembled from the column slices
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t i = 0; i < B; ++i)
      for (std::size_t j = 0; j < outs[k].cols; ++j) {
        const double got = outs[k].y1[i * outs[k].cols + j];
        const std::size_t J = outs[k].first_col + j;
        double colsum = 0;
        for (std::size_t f = 0; f < p.in; ++f) colsum += std::abs(W1(f, J));
        const double bound = fp * Y1mag(i, J) + (rel ? d * Y1mag(i, J) : d * xmax * colsum);
        close("Y1", i, J, got, Y1(i, J), bound);
        H(i, J) = got;
      }

  // ---- row_linear forward: Y2 = H W2, reduced over ranks ----
  const auto [Y2, Y2mag] = mul(H, W2);
  const double m2 = max_abs(Y2mag) + 1e-30;
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t i = 0; i < p.rows[k]; ++i)
      for (std::size_t o = 0; o < p.out; ++o) {
        const std::size_t I = p.first(k) + i;
        close("Y2", I, o, outs[k].y2[i * p.out + o], Y2(I, o), fp * Y2mag(I, o) + (red + K * 1e-6) * m2);
      }

  // ---- row_linear backward: dH = dY2 W2ᵀ, dW2 = Hᵀ dY2 (dY2 quantised once) ----
  const double dymax = max_abs(DY2);
  const auto [DH, DHmag] = mul(DY2, transpose(W2));
  const auto [DW2, DW2mag] = mul(transpose(H), DY2);
  mat DH_used(B, p.hid);
  for (std::size_t k = 0; k < K; ++k) {
    for (std::size_t i = 0; i < B; ++i)
      for (std::size_t j = 0; j < outs[k].cols; ++j) {
        const std::size_t J = outs[k].first_col + j;
        double rowsum = 0;
        for (std::size_t o = 0; o < p.out; ++o) rowsum += std::abs(W2(J, o));
        const double got = outs[k].dh[i * outs[k].cols + j];
        close("dH", i, J, got, DH(i, J), fp * DHmag(i, J) + (rel ? d * DHmag(i, J) : d * dymax * rowsum));
        DH_used(i, J) = got;
      }
    for (std::size_t j = 0; j < outs[k].cols; ++j)
      for (std::size_t o = 0; o < p.out; ++o) {
        const std::size_t J = outs[k].first_col + j;
        double hsum = 0;
        for (std::size_t i = 0; i < B; ++i) hsum += std::abs(H(i, J));
        close("dW2", J, o, outs[k].dw2[j * p.out + o], DW2(J, o), fp * DW2mag(J, o) + (rel ? d * DW2mag(J, o) : d * dymax * hsum));
      }
  }

  // ---- column_linear backward: dX = dH W1ᵀ reduced over ranks, dW1 = Xᵀ dH (X quantised once) ----
  const auto [DX, DXmag] = mul(DH_used, transpose(W1));
  const auto [DW1, DW1mag] = mul(transpose(X), DH_used);
  const double mx = max_abs(DXmag) + 1e-30;
  for (std::size_t k = 0; k < K; ++k) {
    for (std::size_t i = 0; i < p.rows[k]; ++i)
      for (std::size_t f = 0; f < p.in; ++f) {
        const std::size_t I = p.first(k) + i;
        close("dX", I, f, outs[k].dx[i * p.in + f], DX(I, f), fp * DXmag(I, f) + (red + K * 1e-6) * mx);
      }
    for (std::size_t f = 0; f < p.in; ++f)
      for (std::size_t j = 0; j < outs[k].cols; ++j) {
        const std::size_t J = outs[k].first_col + j;
        double gsum = 0;
        for (std::size_t i = 0; i < B; ++i) gsum += std::abs(DH_used(i, J));
        close("dW1", f, J, outs[k].dw1[f * outs[k].cols + j], DW1(f, J),
              fp * DW1mag(f, J) + (rel ? d * DW1mag(f, J) : d * xmax * gsum));
      }
  }
}


}  // namespace lockstep_test::parallel_reference
