// Model-parallel layers (parallel/): a column-split FC followed by a row-split FC, run over 1..8
// in-process ranks holding uneven data-parallel batches, every scheme x activation codec, against
// a single-rank fp64 reference computed from the same inputs (the whole batch, the whole weights).
//
// Bounds (docs/codecs.md, "Activations"): fp32 differs from the reference only by summation order
// (1e-5 of the sum of |terms|). A gathered value (X forward, dY backward) is quantised once, by at
// most delta times its block's absmax (int8, dyntree8: <= max|value|) or delta |value| (bf16), so a
// product with it errs by delta * (max|value| or |value|) * sum |other factor|. A reduced value
// (dX backward, Y forward) is a reduce-scatter over K ranks and errs as the collective tests bound
// it: error_factor(hops + 1, K) * M, M = max over rows of sum over ranks |partial|. All ranks must
// hold bitwise equal gathered rows. Different schemes, codecs or shapes fail on every rank with
// errc::mismatch; bad sizes with a message naming the buffer.
#include <lockstep/lockstep.hpp>

#include "thread_safe_catch.hpp"
#include "parallel_reference.hpp"

#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

using namespace lockstep;
using namespace std::chrono_literals;
using inproc_group = group<transport::inproc>;

namespace {

using namespace lockstep_test::parallel_reference;

template <class S, class C>
void check(const problem& p) {
  const int K = static_cast<int>(p.rows.size());
  std::vector<rank_out> outs(static_cast<std::size_t>(K));
  group_options opt;
  opt.timeout = 60s;
  run_inproc(K, [&](inproc_group& g) { outs[static_cast<std::size_t>(g.rank())] = run_rank<S, C>(g, p); }, opt);
  check_stack<C>(p, outs);
}

template <class S, class C>
void every_size() {
  for (std::size_t K = 1; K <= 8; ++K)
    for (const auto& rows : row_patterns(K)) {
      INFO("K = " << K << ", scheme " << S::name() << ", rows " << detail::chunk_layout::from_counts(rows).str());
      check<S, C>({13, 10, 7, rows});
    }
}

}  // namespace

TEMPLATE_TEST_CASE("column-split then row-split FC, every scheme, 1..8 ranks, uneven rows, against one rank",
                   "[parallel]", codec::fp32, codec::bf16, codec::int8, codec::dyntree8) {
  every_size<parallel::gather_all, TestType>();
  every_size<parallel::by_rank, TestType>();
  every_size<parallel::by_slice, TestType>();
}

TEST_CASE("edge shapes: fewer columns than ranks, an empty batch, wide layers cut into segments", "[parallel]") {
  check<parallel::by_slice, codec::int8>({5, 3, 2, {2, 0, 1, 4}});       // one rank owns no column
  check<parallel::gather_all, codec::fp32>({5, 3, 2, {0, 0, 0}});        // nobody has rows
  check<parallel::by_rank, codec::dyntree8>({4, 6, 3, {0, 0, 0, 0, 0}});
  check<parallel::by_rank, codec::bf16>({300, 97, 11, {40, 7, 33}});     // several segments per round
}

TEST_CASE("the schemes' rounds cover every row once", "[parallel][scheme]") {
  for (std::size_t K = 1; K <= 9; ++K) {
    std::vector<std::size_t> rows(K);
    for (std::size_t k = 0; k < K; ++k) rows[k] = (k * 5 + 3) % 7;
    for (const auto& rounds : {parallel::gather_all::rounds(rows), parallel::by_rank::rounds(rows), parallel::by_slice::rounds(rows)}) {
      std::vector<std::vector<int>> seen(K);
      for (std::size_t k = 0; k < K; ++k) seen[k].assign(rows[k], 0);
      for (const auto& r : rounds) {
        REQUIRE(r.size() == K);
        for (std::size_t k = 0; k < K; ++k)
          for (std::size_t i = r[k].lo; i < r[k].hi; ++i) ++seen[k][i];
      }
      for (std::size_t k = 0; k < K; ++k)
        for (int s : seen[k]) REQUIRE(s == 1);
    }
    REQUIRE(parallel::by_rank::rounds(rows).size() == K);
    REQUIRE(parallel::by_slice::rounds(rows).size() == K);
  }
}

// ASan under either compiler (GCC defines the first, clang answers the second).
#if defined(__SANITIZE_ADDRESS__)
#define LOCKSTEP_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOCKSTEP_TEST_ASAN 1
#endif
#endif
#ifndef LOCKSTEP_TEST_ASAN
#define LOCKSTEP_TEST_ASAN 0
#endif

TEST_CASE("ranks configured differently fail on every rank with a mismatch, within seconds", "[parallel][errors]") {
  group_options quick;
  quick.timeout = 3000ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto failure = [&](int n, auto&& body) -> std::pair<errc, std::string> {
    try {
      run_inproc(n, body, quick);
    } catch (const error& e) {
      return {e.code(), e.what()};
    }
    return {errc::invalid_argument, "no error"};
  };
  std::vector<float> x(2 * 6), w(6 * 4);  // 2 rows of 6 features; room for any rank's W_k
  auto fwd = [&](auto& layer) {
    layer.forward(std::span<const float>(x), std::span<const float>(w).first(6 * layer.cols()), naive_gemm);
  };

  SECTION("schemes") {
    auto [code, what] = failure(3, [&](inproc_group& g) {
      if (g.rank() == 1) {
        parallel::column_linear<parallel::by_rank, transport::inproc> fc(g, 6, 5);
        fwd(fc);
      } else {
        parallel::column_linear<parallel::gather_all, transport::inproc> fc(g, 6, 5);
        fwd(fc);
      }
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("scheme gather_all (a) on rank 0, by_rank (b) on rank 1"));
  }
  SECTION("activation codecs") {
    auto [code, what] = failure(2, [&](inproc_group& g) {
      if (g.rank() == 0) {
        parallel::column_linear<parallel::by_slice, transport::inproc, codec::int8> fc(g, 6, 5);
        fwd(fc);
      } else {
        parallel::column_linear<parallel::by_slice, transport::inproc, codec::dyntree8> fc(g, 6, 5);
        fwd(fc);
      }
    });
    CHECK(code == errc::mismatch);
    // The descriptor holds fingerprints; the reporting rank names its own codec, block included.
    CHECK_THAT(what, Catch::Contains("activation codec") &&
                         (Catch::Contains("this rank (0) uses int8 (block") || Catch::Contains("this rank (1) uses dyntree8 (block")));
  }
  SECTION("activation codecs that differ only in their block") {
    auto [code, what] = failure(2, [&](inproc_group& g) {
      parallel::column_linear<parallel::gather_all, transport::inproc, codec::int8> fc(g, 6, 5, codec::int8{g.rank() == 0 ? 512u : 64u});
      fwd(fc);
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("uses int8 (block 512)") || Catch::Contains("uses int8 (block 64)"));
  }
  SECTION("shapes") {
    auto [code, what] = failure(4, [&](inproc_group& g) {
      parallel::column_linear<parallel::gather_all, transport::inproc> fc(g, 6, g.rank() == 3 ? 7 : 5);
      fwd(fc);
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("shape (in x out) 6 x 5 on rank 0, 6 x 7 on rank 3"));
  }
  SECTION("a column-split layer against a row-split one") {
    auto [code, what] = failure(2, [&](inproc_group& g) {
      if (g.rank() == 0) {
        parallel::column_linear<parallel::gather_all, transport::inproc> fc(g, 6, 4);
        fwd(fc);
      } else {
        parallel::row_linear<parallel::gather_all, transport::inproc> fc(g, 6, 4);
        std::vector<float> h(4 * 3);
        fc.forward(std::span<const float>(h), 2, std::span<const float>(w).first(3 * 4), naive_gemm);
      }
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("layer column-split on rank 0, row-split on rank 1"));
  }
  SECTION("bad sizes name the buffer") {
    run_inproc(2, [&](inproc_group& g) {
      parallel::column_linear<parallel::by_rank, transport::inproc, codec::bf16> fc(g, 6, 4);
      CHECK_THROWS_WITH(fc.forward(std::span<const float>(x).first(7), std::span<const float>(w).first(12), naive_gemm),
                        Catch::Contains("input x has 7 elements, not a whole number of rows of 6"));
      CHECK_THROWS_WITH(fc.forward(std::span<const float>(x), std::span<const float>(w).first(11), naive_gemm),
                        Catch::Contains("weights W_k (in x cols) has 11 elements; expected 12"));
      std::vector<float> dy(8), dw(12), dx(12);
      CHECK_THROWS_WITH(fc.backward(std::span<const float>(dy), std::span<const float>(w).first(12), std::span<float>(dw),
                                    std::span<float>(dx), naive_gemm),
                        Catch::Contains("backward before any forward"));
      CHECK_THROWS_WITH((parallel::column_linear<parallel::by_rank, transport::inproc>(g, 0, 4)),
                        Catch::Contains("both dimensions must be positive"));
    }, quick);
  }
  SECTION("a bad size found after the batch exchange fails the peers at once, naming it") {
    // row_linear's H_k holds all ranks' rows, so its size is checked only once the row counts are
    // in; the peers are then inside the call's collectives. Each rank catches its error and goes
    // on: the peers must fail with rank 0's reason (the group aborted), not at their timeout.
    std::vector<std::string> seen(3);
    std::vector<float> h(64);
    run_inproc(3, [&](inproc_group& g) {
      parallel::row_linear<parallel::by_rank, transport::inproc> fc(g, 6, 5);
      const std::size_t want = 6 * fc.in_rows();  // 2 rows on each of 3 ranks
      try {
        fc.forward(std::span<const float>(h).first(want - (g.rank() == 0 ? 1 : 0)), 2,
                   std::span<const float>(w).first(5 * fc.in_rows()), naive_gemm);
        seen[static_cast<std::size_t>(g.rank())] = "no error";
      } catch (const error& e) {
        seen[static_cast<std::size_t>(g.rank())] = e.what();
      }
    }, quick);
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << seen[static_cast<std::size_t>(r)]);
      CHECK_THAT(seen[static_cast<std::size_t>(r)], Catch::Contains("input H_k (all ranks' rows x in_rows) has 11 elements; expected 12"));
      CHECK_THAT(seen[static_cast<std::size_t>(r)], !Catch::Contains("timeout"));
    }
  }
#if !LOCKSTEP_TEST_ASAN  // ASan stops the process at an allocation of terabytes
  SECTION("a rank that claims terabytes of rows fails clearly, and so do the others") {
    // The rank of a row-split layer with one input feature that holds no input rows: no size check
    // of its own catches a wrong row count, and its workspaces cannot be allocated. 2^45 rows x 4
    // outputs are 512 TiB, more than a process can map (47-bit addresses) whatever the overcommit.
    std::vector<std::string> seen(2);
    std::vector<bool> empty(2);
    run_inproc(2, [&](inproc_group& g) {
      parallel::row_linear<parallel::gather_all, transport::inproc> fc(g, 1, 4);
      empty[static_cast<std::size_t>(g.rank())] = fc.in_rows() == 0;
      const std::size_t rows = fc.in_rows() == 0 ? std::size_t{1} << 45 : 2;
      std::vector<float> h(fc.in_rows() * 4);
      try {
        fc.forward(std::span<const float>(h), rows, std::span<const float>(w).first(fc.in_rows() * 4), naive_gemm);
        seen[static_cast<std::size_t>(g.rank())] = "no error";
      } catch (const error& e) {
        seen[static_cast<std::size_t>(g.rank())] = e.what();
      }
    }, quick);
    REQUIRE(empty[0] != empty[1]);
    const std::size_t liar = empty[0] ? 0 : 1;
    CHECK_THAT(seen[1 - liar], Catch::Contains("row_linear"));
    CHECK_THAT(seen[liar], Catch::Contains("cannot allocate the workspaces of a batch of 35184372088834 rows"));
  }
#endif
  SECTION("a backward after a forward that failed does not go back over its rows") {
    // Every rank's matmul fails alike, so nothing aborts the group: the layer itself must refuse
    // the backward (it used to run it over the rows gathered before the failure, and over the
    // batch of the forward before).
    std::vector<std::string> seen(2);
    run_inproc(2, [&](inproc_group& g) {
      parallel::column_linear<parallel::by_slice, transport::inproc> fc(g, 6, 4);
      fwd(fc);  // a good forward first: its batch must not survive the failed one
      int calls = 0;
      try {
        fc.forward(std::span<const float>(x), std::span<const float>(w).first(6 * fc.cols()), [&](const parallel::gemm_args& a) {
          if (++calls == 1) throw std::runtime_error("the caller's matmul failed");
          naive_gemm(a);
        });
      } catch (const std::runtime_error&) {
      }
      std::vector<float> dy(4 * fc.cols()), dw(6 * fc.cols()), dx(2 * 6);
      try {
        fc.backward(std::span<const float>(dy), std::span<const float>(w).first(6 * fc.cols()), std::span<float>(dw),
                    std::span<float>(dx), naive_gemm);
        seen[static_cast<std::size_t>(g.rank())] = "no error";
      } catch (const error& e) {
        seen[static_cast<std::size_t>(g.rank())] = e.what();
      }
    }, quick);
    for (const auto& s : seen) CHECK_THAT(s, Catch::Contains("after a forward that failed"));
  }
  SECTION("a backward after a forward that failed its own argument checks is refused") {
    // The checks before the batch exchange throw on every rank alike (no collective started, so
    // nothing aborts): the previous step's batch must not survive them either (the layers used to
    // check first and reset after, so this backward ran over step 1's rows).
    std::vector<std::string> seen(4);
    run_inproc(2, [&](inproc_group& g) {
      const auto me = static_cast<std::size_t>(g.rank());
      parallel::column_linear<parallel::gather_all, transport::inproc> fc(g, 6, 4);
      fwd(fc);
      std::vector<float> dy(4 * fc.cols()), dw(6 * fc.cols()), dx(2 * 6);
      CHECK_THROWS_AS(fc.forward(std::span<const float>(x), std::span<const float>(w).first(6 * fc.cols() - 1), naive_gemm),
                      error);
      try {
        fc.backward(std::span<const float>(dy), std::span<const float>(w).first(6 * fc.cols()), std::span<float>(dw),
                    std::span<float>(dx), naive_gemm);
        seen[me] = "no error";
      } catch (const error& e) {
        seen[me] = e.what();
      }
      parallel::row_linear<parallel::by_rank, transport::inproc> rl(g, 6, 5);
      std::vector<float> h(4 * rl.in_rows()), ry(2 * 5), rdw(rl.in_rows() * 5), rdh(4 * rl.in_rows());
      rl.forward(std::span<const float>(h), 2, std::span<const float>(w).first(5 * rl.in_rows()), naive_gemm);
      CHECK_THROWS_AS(rl.forward(std::span<const float>(h), 2, std::span<const float>(w).first(5 * rl.in_rows() - 1), naive_gemm),
                      error);
      try {
        rl.backward(std::span<const float>(h), std::span<const float>(ry), std::span<const float>(w).first(5 * rl.in_rows()),
                    std::span<float>(rdw), std::span<float>(rdh), naive_gemm);
        seen[2 + me] = "no error";
      } catch (const error& e) {
        seen[2 + me] = e.what();
      }
    }, quick);
    for (const auto& s : seen) CHECK_THAT(s, Catch::Contains("after a forward that failed"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);
}
