// Collectives with per-rank counts (all_gather_v, reduce_scatter_v: MPI's allgatherv and
// reduce_scatter): rank k contributes / owns counts[k] elements. Every topology x codec for 1..9
// ranks, over inproc and inproc_deferred (the stream-ordered path), with counts that are all zero,
// one-hot (reduce_scatter_v then reduces to one rank), uneven with zeros, prime, and large enough
// to be cut into several segments. fp32 is exact on integer inputs; lossy codecs stay within the
// bounds of tests/collective_bounds.hpp (an all-gather quantises each value once). Every rank ends
// with the same bits. Ranks handed different counts fail with errc::mismatch within seconds.
#include "collective_matrix.hpp"

#include <numeric>

namespace {

// Integers in [-8, 8] for exact fp32 checks, else uniform in [-1, 1): seeded by (rank, index).
float uniform_input(int rank, std::size_t i, bool integer) {
  std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ (static_cast<std::uint64_t>(rank) + 7) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  if (integer) return static_cast<float>(static_cast<int>(z % 17) - 8);
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1p-52 - 1.0);
}

std::vector<std::size_t> offsets_of(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> off(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
  return off;
}

template <class C>
void check_within(const std::vector<float>& y, const std::vector<double>& ref, double bound, const char* what) {
  REQUIRE(y.size() == ref.size());
  for (std::size_t i = 0; i < y.size(); ++i) {
    if constexpr (exact<C>) {
      if (y[i] != ref[i]) FAIL(what << " element " << i << ": " << y[i] << " != " << ref[i]);
    } else {
      if (!(std::abs(y[i] - ref[i]) <= bound)) FAIL(what << " element " << i << ": " << y[i] << " vs " << ref[i] << ", bound " << bound);
    }
  }
}

template <class Run, class T, class C>
void all_gather_v_case(const T& topo, const std::vector<std::size_t>& counts, group_options opt) {
  const int n = static_cast<int>(counts.size());
  const auto off = offsets_of(counts);
  const bool integer = exact<C>;
  results out(n);
  Run::run(n, [&](auto& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    std::vector<float> in(counts[r]), o(off.back(), -1.0f);
    for (std::size_t k = 0; k < in.size(); ++k) in[k] = uniform_input(g.rank(), k, integer);
    C c{};
    all_gather_v(g, std::span<const float>(in), std::span<float>(o), std::span<const std::size_t>(counts), topo, c);
    out.put(g.rank(), std::move(o));
  }, opt);
  std::vector<double> ref(off.back());
  double mx = 1;
  for (int r = 0; r < n; ++r)
    for (std::size_t k = 0; k < counts[static_cast<std::size_t>(r)]; ++k) {
      ref[off[static_cast<std::size_t>(r)] + k] = uniform_input(r, k, integer);
      mx = std::max(mx, std::abs(ref[off[static_cast<std::size_t>(r)] + k]));
    }
  check_within<C>(out.per_rank[0], ref, lockstep_test::error_factor<C>(1, 1) * mx + 1e-6 * mx, "all_gather_v");
  for (int r = 1; r < n; ++r)
    REQUIRE((ref.empty() || std::memcmp(out.per_rank[0].data(), out.per_rank[static_cast<std::size_t>(r)].data(),
                                        ref.size() * sizeof(float)) == 0));
}

template <class Run, class T, class C>
void reduce_scatter_v_case(const T& topo, const std::vector<std::size_t>& counts, group_options opt, reduce_op op) {
  const int n = static_cast<int>(counts.size());
  const auto off = offsets_of(counts);
  const bool integer = exact<C>;
  results out(n);
  Run::run(n, [&](auto& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    std::vector<float> in(off.back()), o(counts[r], -1.0f);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = uniform_input(g.rank(), i, integer);
    const auto copy = in;
    C c{};
    reduce_scatter_v(g, std::span<const float>(in), std::span<float>(o), std::span<const std::size_t>(counts), topo, c, op);
    REQUIRE(in == copy);
    out.put(g.rank(), std::move(o));
  }, opt);
  for (int r = 0; r < n; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    std::vector<double> ref(counts[rr], 0.0);
    double mx = 1;
    for (std::size_t k = 0; k < counts[rr]; ++k) {
      double a = 0;
      for (int q = 0; q < n; ++q) {
        const float x = uniform_input(q, off[rr] + k, integer);
        ref[k] += x, a += std::abs(x);
      }
      if (op == reduce_op::average) ref[k] = static_cast<float>(static_cast<float>(ref[k]) / static_cast<float>(n));
      mx = std::max(mx, a);
    }
    const double scale = op == reduce_op::average ? 1.0 / n : 1.0;
    const double bound = (lockstep_test::error_factor<C>(hops(topo, n) + 1, lockstep_test::quantisations(topo, n)) * (codec::feedback_codec<C> ? 2 : 1) + n * 1e-6) * mx * scale;
    check_within<C>(out.per_rank[rr], ref, bound, "reduce_scatter_v");
  }
}

// Count vectors for n ranks: the edge cases the brief names, and one large enough for segments.
std::vector<std::vector<std::size_t>> count_vectors(int n) {
  const auto N = static_cast<std::size_t>(n);
  std::vector<std::vector<std::size_t>> v;
  v.push_back(std::vector<std::size_t>(N, 0));                     // nothing anywhere
  for (std::size_t hot : {std::size_t{0}, N - 1}) {                // one rank has everything
    std::vector<std::size_t> c(N, 0);
    c[hot] = 37;
    v.push_back(c);
  }
  std::vector<std::size_t> uneven(N), prime(N, 13), large(N);
  for (std::size_t k = 0; k < N; ++k) {
    uneven[k] = (k * 7 + 3) % 5 == 0 ? 0 : (k * 7 + 3) % 11;         // zeros among small counts
    large[k] = 2003 + 997 * k;                                       // several segments at 1 KiB
  }
  v.push_back(uneven);
  v.push_back(prime);
  v.push_back(large);
  return v;
}

template <class Run, class C>
void every_v_op(int n) {
  auto for_topologies = [&](auto&& f) {
    f(topology::ring{});
    f(topology::torus2d{});
    if (n == 6) f(topology::torus2d{3, 2});
    if (n == 8) f(topology::torus2d{4, 2});
    // Their reduce-scatter and all-gather schedules (one chunk per rank, as per-rank counts need):
    // a power of two and folded pairs. automatic picks one of the four per call.
    if (n == 4 || n == 5 || n == 7) {
      f(topology::halving_doubling{});
      f(topology::recursive_doubling{});
      f(topology::automatic{});
    }
    if (n == 3 || n == 5) f(topology::direct{});  // the fan-in over chunks of unequal length
  };
  for_topologies([&](const auto& topo) {
    using T = std::decay_t<decltype(topo)>;
    for (const auto& counts : count_vectors(n)) {
      INFO("topology " << topo.name() << ", N = " << n << ", counts " << detail::chunk_layout::from_counts(counts).str());
      // Small segments (1 KiB) cut the large counts into several messages per chunk.
      for (std::size_t seg : {std::size_t{0}, std::size_t{1024}}) {
        all_gather_v_case<Run, T, C>(topo, counts, matrix_options(seg));
        reduce_scatter_v_case<Run, T, C>(topo, counts, matrix_options(seg), reduce_op::sum);
      }
      reduce_scatter_v_case<Run, T, C>(topo, counts, matrix_options(), reduce_op::average);
    }
  });
}

}  // namespace

TEMPLATE_TEST_CASE("all_gather_v and reduce_scatter_v: every topology x codec for 1..9 ranks", "[collective_v]",
                   codec::fp32, codec::bf16, codec::int8, codec::dyntree8, codec::error_feedback<codec::int8>) {
  for (int n = 1; n <= 9; ++n) every_v_op<on_host, TestType>(n);
}

TEMPLATE_TEST_CASE("all_gather_v and reduce_scatter_v, stream-ordered", "[collective_v][stream]", codec::fp32,
                   codec::bf16, codec::int8, codec::dyntree8) {
  for (int n = 1; n <= 9; n += 2) every_v_op<on_stream, TestType>(n);
}

TEST_CASE("in-place and asynchronous forms, with the epilogue seeing exactly this rank's part", "[collective_v][async]") {
  const std::vector<std::size_t> counts = {5, 0, 11, 2};
  const auto off = offsets_of(counts);
  std::vector<std::vector<int>> seen_of(4);
  std::vector<std::vector<float>> gathered(4), reduced(4);
  run_inproc(4, [&](inproc_group& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    std::vector<float> a(off.back(), 0.0f), b(off.back());
    for (std::size_t k = off[r]; k < off[r + 1]; ++k) a[k] = static_cast<float>(100 * r + k);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(r + i);
    std::vector<int> seen(off.back(), 0);
    codec::fp32 c;
    auto ra = all_gather_v_inplace_async(g, std::span<float>(a), std::span<const std::size_t>(counts), topology::ring{}, c);
    auto rb = reduce_scatter_v_inplace_async(g, std::span<float>(b), std::span<const std::size_t>(counts), topology::torus2d{}, c,
                                             reduce_op::sum, [&](std::size_t first, std::size_t count) {
                                               for (std::size_t i = first; i < first + count; ++i) ++seen[i];
                                             });
    ra.wait();
    rb.wait();
    seen_of[r] = seen;
    gathered[r] = a;
    reduced[r].assign(b.begin() + static_cast<std::ptrdiff_t>(off[r]), b.begin() + static_cast<std::ptrdiff_t>(off[r + 1]));
  });
  for (std::size_t r = 0; r < 4; ++r) {
    for (std::size_t i = 0; i < off.back(); ++i) REQUIRE(seen_of[r][i] == (i >= off[r] && i < off[r + 1] ? 1 : 0));
    for (std::size_t q = 0; q < 4; ++q)
      for (std::size_t k = off[q]; k < off[q + 1]; ++k) REQUIRE(gathered[r][k] == static_cast<float>(100 * q + k));
    for (std::size_t k = 0; k < counts[r]; ++k) REQUIRE(reduced[r][k] == static_cast<float>(6 + 4 * (off[r] + k)));
  }
}

TEST_CASE("per-rank counts: bad input and ranks handed different counts fail clearly within seconds", "[collective_v][errors]") {
  group_options quick;
  quick.timeout = 2000ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto code_and_text = [&](int n, auto&& body) -> std::pair<errc, std::string> {
    try {
      run_inproc(n, body, quick);
    } catch (const error& e) {
      return {e.code(), e.what()};
    }
    return {errc::invalid_argument, "no error"};
  };

  SECTION("same total, different counts") {
    auto [code, what] = code_and_text(3, [](inproc_group& g) {
      const std::vector<std::size_t> counts = g.rank() == 1 ? std::vector<std::size_t>{4, 2, 3} : std::vector<std::size_t>{3, 3, 3};
      std::vector<float> in(counts[static_cast<std::size_t>(g.rank())]), out(9);
      codec::int8 c;
      all_gather_v(g, std::span<const float>(in), std::span<float>(out), std::span<const std::size_t>(counts), topology::ring{}, c);
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("per-rank counts differ"));
    CHECK_THAT(what, Catch::Contains("this rank's: ["));
  }
  SECTION("different totals") {
    auto [code, what] = code_and_text(2, [](inproc_group& g) {
      const std::vector<std::size_t> counts = g.rank() == 0 ? std::vector<std::size_t>{4, 2} : std::vector<std::size_t>{4, 3};
      std::vector<float> in(7), out(counts[static_cast<std::size_t>(g.rank())]);
      codec::fp32 c;
      reduce_scatter_v(g, std::span<const float>(in).first(counts[0] + counts[1]), std::span<float>(out),
                       std::span<const std::size_t>(counts), topology::ring{}, c);
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("per-rank counts differ"));
    CHECK_THAT(what, Catch::Contains("total 6 here, 7 on the peer") || Catch::Contains("total 7 here, 6 on the peer"));
  }
  SECTION("per-rank counts on one rank, the equal-count call on another") {
    auto [code, what] = code_and_text(2, [](inproc_group& g) {
      std::vector<float> buf(8);
      codec::fp32 c;
      const std::vector<std::size_t> counts = {4, 4};
      if (g.rank() == 0) all_gather_v_inplace(g, std::span<float>(buf), std::span<const std::size_t>(counts), topology::ring{}, c);
      else all_gather_inplace(g, std::span<float>(buf), topology::ring{}, c);
    });
    CHECK(code == errc::mismatch);
    CHECK_THAT(what, Catch::Contains("per-rank counts given here, equal (not given) on the peer") ||
                         Catch::Contains("per-rank counts equal (not given) here, given on the peer"));
  }
  SECTION("a count vector that does not fit the group or the buffers") {
    run_inproc(2, [](inproc_group& g) {
      codec::fp32 c;
      std::vector<float> in(3), out(5);
      const std::vector<std::size_t> three = {1, 2, 2}, two = {2, 3};
      CHECK_THROWS_WITH(all_gather_v(g, std::span<const float>(in), std::span<float>(out), std::span<const std::size_t>(three),
                                     topology::ring{}, c),
                        Catch::Contains("3 per-rank counts for a group of 2 ranks"));
      CHECK_THROWS_WITH(all_gather_v(g, std::span<const float>(in).first(1), std::span<float>(out),
                                     std::span<const std::size_t>(two), topology::ring{}, c),
                        Catch::Contains("input has 1 elements; this rank's count is"));
      CHECK_THROWS_WITH(reduce_scatter_v(g, std::span<const float>(in), std::span<float>(out), std::span<const std::size_t>(two),
                                         topology::ring{}, c),
                        Catch::Contains("buffer has 3 elements; the per-rank counts [2, 3] sum to 5"));
      const std::vector<std::size_t> huge = {std::size_t{1} << 47, std::size_t{1} << 48};
      CHECK_THROWS_WITH(all_gather_v_inplace(g, std::span<float>(out), std::span<const std::size_t>(huge), topology::ring{}, c),
                        Catch::Contains("overflow"));
    }, quick);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);
}
