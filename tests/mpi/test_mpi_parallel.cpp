// Model-parallel layers (parallel/) over the mpi transport under mpirun -np 1..4: the stack of
// tests/test_parallel.cpp (column-split FC then row-split FC), every scheme x activation codec,
// equal, uneven (with a zero) and one-rank row counts, checked against the same fp64 reference
// and bounds (tests/parallel_reference.hpp). Each rank's results are all-gathered (fp32, exact) so
// that every rank checks the whole problem. Mismatched schemes fail on every rank in seconds.
#include <lockstep/lockstep.hpp>
#include <lockstep/transport/mpi.hpp>

#include <catch2/catch.hpp>

#include "../parallel_reference.hpp"

#include <chrono>
#include <vector>

using namespace lockstep;
using namespace lockstep_test::parallel_reference;
using namespace std::chrono_literals;
using mpi_group = group<transport::mpi>;

namespace {

mpi_group world_group(std::chrono::milliseconds timeout = 60s) {
  group_options o;
  o.timeout = timeout;
  return mpi_group(transport::mpi(MPI_COMM_WORLD), o);
}

template <class S, class C>
void check_on_world(mpi_group& g, const problem& p) {
  const rank_out mine = run_rank<S, C>(g, p);
  const std::size_t K = p.rows.size();
  std::vector<std::size_t> counts(K);
  for (std::size_t k = 0; k < K; ++k) counts[k] = packed_size(p, k);
  std::vector<float> own = pack(mine), all;
  for (std::size_t c : counts) all.resize(all.size() + c);
  codec::fp32 c;
  all_gather_v(g, std::span<const float>(own), std::span<float>(all), std::span<const std::size_t>(counts), topology::ring{}, c);
  std::vector<rank_out> outs;
  const float* at = all.data();
  for (std::size_t k = 0; k < K; ++k) outs.push_back(unpack(p, k, at)), at += counts[k];
  check_stack<C>(p, outs);
}

template <class S, class C>
void every_pattern() {
  auto g = world_group();
  for (const auto& rows : row_patterns(static_cast<std::size_t>(g.size()))) check_on_world<S, C>(g, {13, 10, 7, rows});
  check_on_world<S, C>(g, {300, 97, 11, std::vector<std::size_t>(static_cast<std::size_t>(g.size()), 9)});
}

}  // namespace

TEMPLATE_TEST_CASE("column-split then row-split FC over MPI, every scheme", "[parallel]", codec::fp32, codec::bf16,
                   codec::int8, codec::dyntree8) {
  every_pattern<parallel::gather_all, TestType>();
  every_pattern<parallel::by_rank, TestType>();
  every_pattern<parallel::by_slice, TestType>();
}

TEST_CASE("ranks with different schemes fail on every rank with a mismatch", "[parallel][errors]") {
  auto g = world_group(10s);
  if (g.size() < 2) return;  // nothing to disagree with
  std::vector<float> x(2 * 6), w(6 * 4);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (g.rank() == g.size() - 1) {
      parallel::column_linear<parallel::by_slice, transport::mpi> fc(g, 6, 5);
      fc.forward(std::span<const float>(x), std::span<const float>(w).first(6 * fc.cols()), naive_gemm);
    } else {
      parallel::column_linear<parallel::gather_all, transport::mpi> fc(g, 6, 5);
      fc.forward(std::span<const float>(x), std::span<const float>(w).first(6 * fc.cols()), naive_gemm);
    }
    FAIL("no error");
  } catch (const error& e) {
    CHECK(e.code() == errc::mismatch);
    CHECK_THAT(e.what(), Catch::Contains("scheme gather_all (a) on rank 0, by_slice (c) on rank"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}
