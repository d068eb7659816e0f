// Model-parallel layers (parallel/) over a stream-ordered group: tests/test_parallel.cpp's stack
// (a column-split FC, then a row-split FC, forward and backward) over inproc_deferred, the CPU
// twin of inproc_device and NCCL: every rank's collectives are queued on its host_stream, the
// products are enqueued by the caller's matmul on a compute stream, and nothing is read on the
// host until the rank has enqueued the whole stack and waited for its compute stream once.
// Every scheme x activation codec x 1..8 ranks, uneven rows, against the same fp64 one-rank
// reference and bounds as the host test (tests/parallel_reference.hpp), in three orders:
//   group     products on the group's own stream (one queue, no events);
//   split     products on a compute stream of the rank's own, ordered with the group's by events;
//   slow      split, each product and copy on the compute stream started 200 us late, so a
//             missing event lets the group's stream read an input or a round before the compute
//             stream wrote it (or free what it still reads).
#include <lockstep/lockstep.hpp>

#include "thread_safe_catch.hpp"
#include "parallel_reference.hpp"

#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

using namespace lockstep;
using namespace std::chrono_literals;
using stream_group = group<transport::inproc_deferred>;

namespace {

using namespace lockstep_test::parallel_reference;

enum class order { group, split, slow };

// parallel_reference.hpp's Order: products and result copies enqueued on the compute stream.
struct on_stream {
  host_stream* s;  // the compute stream
  order how;
  void gemm(const parallel::gemm_args& a) const {
    s->enqueue([a, slow = how == order::slow] {
      if (slow) std::this_thread::sleep_for(200us);
      naive_gemm(a);
    });
  }
  void copy(std::vector<float>& to, std::span<const float> from) const {
    to.assign(from.size(), -9.0f);
    if (!from.empty())
      s->enqueue([d = to.data(), f = from.data(), n = from.size(), slow = how == order::slow] {
        if (slow) std::this_thread::sleep_for(200us);
        std::memcpy(d, f, n * sizeof(float));
      });
  }
  template <class Layer>
  void bind(Layer& l) const {
    if (how != order::group) l.set_compute_stream(s);
  }
  void finish() const { s->synchronize(); }
};

template <class S, class C>
void check(const problem& p, order how) {
  const int K = static_cast<int>(p.rows.size());
  std::vector<rank_out> outs(static_cast<std::size_t>(K));
  group_options opt;
  opt.timeout = 60s;
  run_inproc_deferred(K, [&](stream_group& g) {
    std::optional<host_stream> own;  // before the layers (run_rank's): they free on it
    host_stream* compute = g.stream();
    if (how != order::group) compute = &own.emplace(opt.timeout);
    outs[static_cast<std::size_t>(g.rank())] = run_rank<S, C>(g, p, on_stream{compute, how});
  }, opt);
  check_stack<C>(p, outs);
}

template <class S, class C>
void every_size(order how) {
  for (std::size_t K = 1; K <= 8; ++K)
    for (const auto& rows : row_patterns(K)) {
      INFO("K = " << K << ", scheme " << S::name() << ", rows " << detail::chunk_layout::from_counts(rows).str()
                  << ", order " << static_cast<int>(how));
      check<S, C>({13, 10, 7, rows}, how);
    }
}

}  // namespace

TEMPLATE_TEST_CASE("stream-ordered: column-split then row-split FC, every scheme, 1..8 ranks, uneven rows, against one rank",
                   "[parallel][stream]", codec::fp32, codec::bf16, codec::int8, codec::dyntree8) {
  for (order how : {order::group, order::split}) {
    every_size<parallel::gather_all, TestType>(how);
    every_size<parallel::by_rank, TestType>(how);
    every_size<parallel::by_slice, TestType>(how);
  }
}

TEST_CASE("stream-ordered: a slow compute stream (products and copies started late) still reads and writes in order",
          "[parallel][stream]") {
  for (std::size_t K : {1, 2, 3, 5, 8})
    for (const auto& rows : row_patterns(K)) {
      INFO("K = " << K << ", rows " << detail::chunk_layout::from_counts(rows).str());
      check<parallel::gather_all, codec::fp32>({13, 10, 7, rows}, order::slow);
      check<parallel::by_rank, codec::int8>({13, 10, 7, rows}, order::slow);
      check<parallel::by_slice, codec::dyntree8>({13, 10, 7, rows}, order::slow);
    }
}

TEST_CASE("stream-ordered edge shapes: fewer columns than ranks (empty products), an empty batch, wide layers",
          "[parallel][stream]") {
  for (order how : {order::group, order::split, order::slow}) {
    check<parallel::by_slice, codec::int8>({5, 3, 2, {2, 0, 1, 4}}, how);  // one rank owns no column: k = 0
    check<parallel::gather_all, codec::fp32>({5, 3, 2, {0, 0, 0}}, how);   // nobody has rows
    check<parallel::by_rank, codec::dyntree8>({4, 6, 3, {0, 0, 0, 0, 0}}, how);
    check<parallel::by_rank, codec::bf16>({300, 97, 11, {40, 7, 33}}, how);  // one message per round
  }
}

TEST_CASE("stream-ordered: ranks configured differently fail on every rank with a mismatch, within seconds",
          "[parallel][stream][errors]") {
  group_options quick;
  quick.timeout = 3000ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto failure = [&](int n, auto&& body) -> std::pair<errc, std::string> {
    try {
      run_inproc_deferred(n, body, quick);
    } catch (const error& e) {
      return {e.code(), e.what()};
    }
    return {errc::invalid_argument, "no error"};
  };
  std::vector<float> x(2 * 6), w(6 * 4);  // 2 rows of 6 features; room for any rank's W_k
  auto fwd = [&](auto& layer) {
    auto& g = layer.group_ref();
    layer.forward(std::span<const float>(x), std::span<const float>(w).first(6 * layer.cols()),
                  [&g](const parallel::gemm_args& a) { g.stream()->enqueue([a] { naive_gemm(a); }); });
  };

  SECTION("schemes") {
    auto [code, what] = failure(3, [&](stream_group& g) {
      if (g.rank() == 1) {
        parallel::column_linear<parallel::by_rank, transport::inproc_deferred> fc(g, 6, 5);
        fwd(fc);
      } else {
        parallel::column_linear<parallel::gather_all, transport::inproc_deferred> fc(g, 6, 5);
        fwd(fc);
      }
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("scheme gather_all (a) on rank 0, by_rank (b) on rank 1"));
  }
  SECTION("activation codecs") {
    auto [code, what] = failure(2, [&](stream_group& g) {
      if (g.rank() == 0) {
        parallel::column_linear<parallel::by_slice, transport::inproc_deferred, codec::int8> fc(g, 6, 5);
        fwd(fc);
      } else {
        parallel::column_linear<parallel::by_slice, transport::inproc_deferred, codec::dyntree8> fc(g, 6, 5);
        fwd(fc);
      }
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("activation codec"));
  }
  SECTION("shapes") {
    auto [code, what] = failure(4, [&](stream_group& g) {
      parallel::column_linear<parallel::gather_all, transport::inproc_deferred> fc(g, 6, g.rank() == 3 ? 7 : 5);
      fwd(fc);
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("shape (in x out) 6 x 5 on rank 0, 6 x 7 on rank 3"));
  }
  SECTION("bad sizes name the buffer") {
    run_inproc_deferred(2, [&](stream_group& g) {
      parallel::column_linear<parallel::by_rank, transport::inproc_deferred, codec::bf16> fc(g, 6, 4);
      auto mm = [&g](const parallel::gemm_args& a) { g.stream()->enqueue([a] { naive_gemm(a); }); };
      CHECK_THROWS_WITH(fc.forward(std::span<const float>(x).first(7), std::span<const float>(w).first(12), mm),
                        Catch::Contains("input x has 7 elements, not a whole number of rows of 6"));
      std::vector<float> dy(8), dw(12), dx(12);
      CHECK_THROWS_WITH(fc.backward(std::span<const float>(dy), std::span<const float>(w).first(12), std::span<float>(dw),
                                    std::span<float>(dx), mm),
                        Catch::Contains("backward before any forward"));
    }, quick);
  }
  SECTION("a product that fails on the compute stream surfaces at its synchronisation, and the peers do not hang") {
    auto [code, what] = failure(3, [&](stream_group& g) {
      host_stream compute(quick.timeout);
      parallel::column_linear<parallel::by_slice, transport::inproc_deferred, codec::int8> fc(g, 6, 5);
      fc.set_compute_stream(&compute);
      fc.forward(std::span<const float>(x), std::span<const float>(w).first(6 * fc.cols()),
                 [&](const parallel::gemm_args& a) {
                   compute.enqueue([a, bad = g.rank() == 2] {
                     if (bad) throw error(errc::invalid_argument, "test gemm", 2, -1, "this product fails");
                     naive_gemm(a);
                   });
                 });
      compute.synchronize();
    });
    CHECK(code == errc::invalid_argument);
    CHECK_THAT(what, Catch::Contains("this product fails"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);
}
