// Collectives over in-process ranks: every op x topology x codec for 1..9 ranks, counts 0, 1,
// N-1, a prime and 4 Mi. fp32 results are exact on integer-valued inputs (nccl-tests style);
// lossy codecs stay within the bound of docs/codecs.md against an fp64 reference:
//   |y - exact| <= (N * delta_block + (H + 1) * delta_value) * M
// with H the reduce-scatter hops on the longest chain (N-1 ring, R+C-2 torus, log2 N halving),
// delta_block and delta_value the codec's error per quantisation relative to its block's absmax and
// to the value (tests/collective_bounds.hpp; recursive doubling quantises more often than N), and M = max_i sum_r |x_r[i]| (bounds every partial sum). Results must be bitwise identical on every rank and from run to run.
//
// LOCKSTEP_SMALL_MATRIX=1 (scripts/test --sanitize thread sets it) keeps every op x topology x
// codec but runs it at 1..5 ranks with counts 0, 1, N-1 and 1009 (reduce-scatter and all-gather
// 101 per rank), and the 4 Mi case at 64 Ki + 3: ThreadSanitizer's slowdown made the whole matrix
// take over six minutes.
//
// The matrix runs twice: over inproc (host threads, work done at once) and over inproc_deferred
// (every rank's work queued on a host_stream, completion by events: the path a GPU takes, run by
// the CPU), so the stream-ordered orchestration the device uses is tested here too.
#include <lockstep/lockstep.hpp>

#include "collective_bounds.hpp"

// Rank threads assert: every assertion macro takes one lock (see the header). Every expression
// asserted on a rank thread is local (no collective inside), so holding the lock while it is
// evaluated cannot block another rank.
#include "thread_safe_catch.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <mutex>
#include <random>
#include <vector>

using namespace lockstep;
using lockstep_test::delta;
using lockstep_test::exact;
using lockstep_test::hops;
using namespace std::chrono_literals;
using inproc_group = group<transport::inproc>;

namespace {

// Where the ranks run: host threads doing the work, or host threads enqueueing it on streams.
// A minute's timeout: a message the matrix never matches (a step-tagged broadcast, say) fails the
// case with the rank, peer and step instead of waiting out the default five minutes.
inline group_options matrix_options() {
  group_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}
struct on_host {
  template <class F>
  static void run(int n, F&& f, group_options opt = matrix_options()) {
    run_inproc(n, std::forward<F>(f), opt);
  }
};
struct on_stream {
  template <class F>
  static void run(int n, F&& f, group_options opt = matrix_options()) {
    run_inproc_deferred(n, std::forward<F>(f), opt);
  }
};

bool small_matrix() {
  static const bool small = [] {
    const char* e = std::getenv("LOCKSTEP_SMALL_MATRIX");
    return e && std::string(e) == "1";
  }();
  return small;
}
int max_ranks() { return small_matrix() ? 5 : 9; }

// Inputs: integers in [-8, 8] for exact fp32 checks; Gaussian values for lossy codecs.
float input(int rank, std::size_t i, bool integer) {
  const std::uint64_t h = (i * 2654435761u) ^ (static_cast<std::uint64_t>(rank) * 0x9e3779b97f4a7c15ull);
  if (integer) return static_cast<float>(static_cast<int>((h >> 7) % 17) - 8);
  // Box-Muller over two splitmix64 draws: a seeded N(0, 1) value that is cheap per element.
  auto mix = [](std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const double u1 = (static_cast<double>(mix(h) >> 11) + 0.5) * 0x1p-53;
  const double u2 = static_cast<double>(mix(h + 0x9e3779b97f4a7c15ull) >> 11) * 0x1p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

struct results {
  std::mutex m;
  std::vector<std::vector<float>> per_rank;
  explicit results(int n) : per_rank(static_cast<std::size_t>(n)) {}
  void put(int r, std::vector<float> v) {
    std::lock_guard lk(m);
    per_rank[static_cast<std::size_t>(r)] = std::move(v);
  }
};

// Checks y against the fp64 reference `ref` with the bound above, over [0, ref.size()).
// q: the quantisations on a value's path (collective_bounds.hpp: N, more on recursive doubling).
template <class C>
void check_close(const std::vector<float>& y, const std::vector<double>& ref, double m, int h, int n, double scale,
                 int q = 0) {
  REQUIRE(y.size() == ref.size());
  const double bound = lockstep_test::error_factor<C>(h + 1, q ? q : n) * m * scale *
                           (codec::feedback_codec<C> ? 2 : 1) + n * 1e-6 * m * scale;
  for (std::size_t i = 0; i < y.size(); ++i) {
    if constexpr (exact<C>) {
      if (y[i] != ref[i]) FAIL("element " << i << ": " << y[i] << " != " << ref[i]);
    } else {
      if (!(std::abs(y[i] - ref[i]) <= bound)) FAIL("element " << i << ": " << y[i] << " vs " << ref[i] << ", bound " << bound);
    }
  }
}

template <class Run, class T, class C>
void all_reduce_case(const T& topo, int n, std::size_t count, reduce_op op) {
  const bool integer = exact<C>;
  results out(n);
  Run::run(n, [&](auto& g) {
    std::vector<float> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = input(g.rank(), i, integer);
    C c{};
    all_reduce(g, std::span<float>(v), topo, c, op);
    out.put(g.rank(), std::move(v));
  });
  std::vector<double> ref(count, 0.0);
  double m = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double a = 0;
    for (int r = 0; r < n; ++r) ref[i] += input(r, i, integer), a += std::abs(input(r, i, integer));
    if (op == reduce_op::average) ref[i] = static_cast<float>(static_cast<float>(ref[i]) / static_cast<float>(n));
    m = std::max(m, a);
  }
  check_close<C>(out.per_rank[0], ref, m, hops(topo, n), n, op == reduce_op::average ? 1.0 / n : 1.0,
                 lockstep_test::quantisations(topo, n));
  for (int r = 1; r < n; ++r)  // (memcmp of no bytes may not be handed the null data() of empty vectors)
    REQUIRE((count == 0 ||
             std::memcmp(out.per_rank[0].data(), out.per_rank[static_cast<std::size_t>(r)].data(), count * sizeof(float)) == 0));
}

template <class Run, class T, class C>
void reduce_scatter_case(const T& topo, int n, std::size_t m_per) {
  const bool integer = exact<C>;
  const std::size_t count = m_per * static_cast<std::size_t>(n);
  results out(n);
  Run::run(n, [&](auto& g) {
    std::vector<float> in(count), o(m_per, -1.0f);
    for (std::size_t i = 0; i < count; ++i) in[i] = input(g.rank(), i, integer);
    const auto copy = in;
    C c{};
    reduce_scatter(g, std::span<const float>(in), std::span<float>(o), topo, c);
    REQUIRE(in == copy);  // the input is not touched
    out.put(g.rank(), std::move(o));
  });
  double mx = 0;
  for (int r = 0; r < n; ++r) {
    std::vector<double> ref(m_per, 0.0);
    for (std::size_t k = 0; k < m_per; ++k) {
      double a = 0;
      for (int q = 0; q < n; ++q) {
        const float x = input(q, static_cast<std::size_t>(r) * m_per + k, integer);
        ref[k] += x, a += std::abs(x);
      }
      mx = std::max(mx, a);
    }
    check_close<C>(out.per_rank[static_cast<std::size_t>(r)], ref, std::max(mx, 1.0), hops(topo, n), n, 1.0);
  }
}

template <class Run, class T, class C>
void all_gather_case(const T& topo, int n, std::size_t m_per) {
  const bool integer = exact<C>;
  results out(n);
  Run::run(n, [&](auto& g) {
    std::vector<float> in(m_per), o(m_per * static_cast<std::size_t>(n), -1.0f);
    for (std::size_t k = 0; k < m_per; ++k) in[k] = input(g.rank(), k, integer);
    C c{};
    all_gather(g, std::span<const float>(in), std::span<float>(o), topo, c);
    out.put(g.rank(), std::move(o));
  });
  std::vector<double> ref(m_per * static_cast<std::size_t>(n));
  double mx = 1;
  for (int r = 0; r < n; ++r)
    for (std::size_t k = 0; k < m_per; ++k) {
      ref[static_cast<std::size_t>(r) * m_per + k] = input(r, k, integer);
      mx = std::max(mx, std::abs(ref[static_cast<std::size_t>(r) * m_per + k]));
    }
  check_close<C>(out.per_rank[0], ref, mx, 0, 1, 1.0);
  for (int r = 1; r < n; ++r) REQUIRE(out.per_rank[static_cast<std::size_t>(r)] == out.per_rank[0]);
}

template <class Run, class T, class C>
void broadcast_case(const T& topo, int n, std::size_t count, int root) {
  const bool integer = exact<C>;
  results out(n);
  Run::run(n, [&](auto& g) {
    std::vector<float> v(count, 0.0f);
    if (g.rank() == root)
      for (std::size_t i = 0; i < count; ++i) v[i] = input(root, i, integer);
    C c{};
    broadcast(g, std::span<float>(v), root, topo, c);
    out.put(g.rank(), std::move(v));
  });
  std::vector<double> ref(count);
  double mx = 1;
  for (std::size_t i = 0; i < count; ++i) ref[i] = input(root, i, integer), mx = std::max(mx, std::abs(ref[i]));
  check_close<C>(out.per_rank[0], ref, mx, 0, 1, 1.0);
  for (int r = 1; r < n; ++r) REQUIRE(out.per_rank[static_cast<std::size_t>(r)] == out.per_rank[0]);
}

template <class Run, class C>
void every_op(int n) {
  const std::size_t prime = small_matrix() ? 1009 : 10007, prime_per = small_matrix() ? 101 : 1009;
  const std::vector<std::size_t> counts = {0, 1, static_cast<std::size_t>(n - 1), prime};
  auto for_topologies = [&](auto&& f) {
    f(topology::ring{});
    f(topology::torus2d{});
    if (n == 6) f(topology::torus2d{3, 2});
    if (n == 8) f(topology::torus2d{4, 2});
    // The latency topologies where their folds differ: a power of two, one and two folded pairs,
    // and 7 (three); 1..3 and 9 add nothing the others do not.
    if (n == 4 || n == 5 || n == 6 || n == 7 || n == 8) {
      f(topology::halving_doubling{});
      f(topology::recursive_doubling{});
    }
  };
  for_topologies([&](const auto& topo) {
    INFO("topology " << topo.name() << ", N = " << n);
    for (std::size_t count : counts) {
      INFO("count " << count);
      using T = std::decay_t<decltype(topo)>;
      all_reduce_case<Run, T, C>(topo, n, count, reduce_op::sum);
      all_reduce_case<Run, T, C>(topo, n, count, reduce_op::average);
      reduce_scatter_case<Run, T, C>(topo, n, count == prime ? prime_per : count);
      all_gather_case<Run, T, C>(topo, n, count == prime ? prime_per : count);
      // From every root: a root's k-th send and its receiver's first step must match.
      for (int root = 0; root < n; ++root) broadcast_case<Run, T, C>(topo, n, count, root);
    }
  });
}

}  // namespace

TEMPLATE_TEST_CASE("every op x topology for 1..9 ranks", "[collective]", codec::fp32, codec::bf16, codec::int8,
                   codec::dyntree8, codec::error_feedback<codec::int8>) {
  for (int n = 1; n <= max_ranks(); ++n) every_op<on_host, TestType>(n);
}

TEMPLATE_TEST_CASE("every op x topology for 1..9 ranks, stream-ordered", "[collective][stream]", codec::fp32,
                   codec::bf16, codec::int8, codec::dyntree8, codec::error_feedback<codec::int8>) {
  for (int n = 1; n <= max_ranks(); ++n) every_op<on_stream, TestType>(n);
}

TEST_CASE("4 Mi elements: fp32 exact and dyntree8 bounded, ring and torus", "[collective][large]") {
  const std::size_t big = small_matrix() ? std::size_t{64} << 10 : std::size_t{4} << 20;
  all_reduce_case<on_host, topology::ring, codec::fp32>({}, 4, big + 3, reduce_op::sum);
  all_reduce_case<on_host, topology::torus2d, codec::fp32>({}, 6, big, reduce_op::sum);
  all_reduce_case<on_host, topology::torus2d, codec::dyntree8>({}, 4, big, reduce_op::average);
  all_reduce_case<on_host, topology::ring, codec::bf16>({}, 3, big, reduce_op::sum);
  all_reduce_case<on_stream, topology::torus2d, codec::dyntree8>({}, 4, big, reduce_op::average);
}

TEST_CASE("results are identical from run to run", "[collective]") {
  auto once = [] {
    std::vector<float> r0;
    run_inproc(5, [&](inproc_group& g) {
      std::vector<float> v(50000);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = input(g.rank(), i, false);
      codec::dyntree8 c;
      all_reduce(g, std::span<float>(v), topology::ring{}, c);
      if (g.rank() == 0) r0 = v;
    });
    return r0;
  };
  const auto a = once(), b = once();
  REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("the epilogue sees every element once, with its final value", "[collective][epilogue]") {
  run_inproc(6, [](inproc_group& g) {
    std::vector<float> v(100003);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = input(g.rank(), i, false);
    std::vector<int> seen(v.size(), 0);
    std::vector<float> at_epilogue(v.size());
    codec::bf16 c;
    all_reduce(g, std::span<float>(v), topology::torus2d{2, 3}, c, reduce_op::average,
               [&](std::size_t first, std::size_t count) {
                 for (std::size_t i = first; i < first + count; ++i) ++seen[i], at_epilogue[i] = v[i];
               });
    for (std::size_t i = 0; i < v.size(); ++i) {
      REQUIRE(seen[i] == 1);
      REQUIRE(at_epilogue[i] == v[i]);
    }
    // The in-place reduce-scatter's epilogue covers exactly this rank's chunk.
    std::fill(seen.begin(), seen.end(), 0);
    codec::fp32 f;
    reduce_scatter_inplace(g, std::span<float>(v), topology::ring{}, f, reduce_op::sum,
                           [&](std::size_t first, std::size_t count) {
                             for (std::size_t i = first; i < first + count; ++i) ++seen[i];
                           });
    auto [lo, hi] = chunk_range(v.size(), 6, static_cast<std::size_t>(g.rank()));
    for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(seen[i] == (i >= lo && i < hi ? 1 : 0));
  });
}

TEST_CASE("asynchronous all-reduces overlap the caller and keep call order", "[collective][async]") {
  run_inproc(4, [](inproc_group& g) {
    std::vector<std::vector<float>> buckets(5, std::vector<float>(30000));
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (std::size_t i = 0; i < buckets[b].size(); ++i) buckets[b][i] = static_cast<float>(g.rank() + b);
    codec::fp32 c;
    std::vector<request> reqs;
    for (auto& b : buckets) reqs.push_back(all_reduce_async(g, std::span<float>(b), topology::ring{}, c));
    std::vector<float> tail(1000, 1.0f);
    all_reduce(g, std::span<float>(tail), topology::ring{}, c);  // blocking, queued behind the async ones
    for (auto& r : reqs) r.wait();
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (float x : buckets[b]) REQUIRE(x == static_cast<float>(6 + 4 * b));
    for (float x : tail) REQUIRE(x == 4.0f);
  });
}

TEST_CASE("error feedback makes repeated lossy all-reduces unbiased", "[collective][ef]") {
  // Catch2 v2 assertions are not thread-safe: the ranks record, the main thread checks.
  std::vector<double> single_of(4, 0.0), worst_of(4, 0.0);
  run_inproc(4, [&](inproc_group& g) {
    const std::size_t n = 20000;
    codec::error_feedback<codec::int8> ef;
    std::vector<double> mean(n, 0.0);
    double single = 0;
    const int calls = 64;
    // One buffer for all calls: residuals are kept per buffer address (a fresh vector per call
    // only reused the address by the allocator's grace; under ASan it does not).
    std::vector<float> v(n);
    for (int k = 0; k < calls; ++k) {
      for (std::size_t i = 0; i < n; ++i) v[i] = 0.01f * input(g.rank(), i, false) + 0.001f;
      all_reduce(g, std::span<float>(v), topology::ring{}, ef);
      for (std::size_t i = 0; i < n; ++i) {
        double exact_sum = 0;
        for (int r = 0; r < 4; ++r) exact_sum += 0.01f * input(r, i, false) + 0.001f;
        mean[i] += (v[i] - exact_sum) / calls;
        if (k == 0) single = std::max(single, std::abs(v[i] - exact_sum));
      }
    }
    double worst = 0;
    for (double e : mean) worst = std::max(worst, std::abs(e));
    single_of[static_cast<std::size_t>(g.rank())] = single;
    worst_of[static_cast<std::size_t>(g.rank())] = worst;
  });
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r << ": single-call max error " << single_of[r] << ", mean error over 64 calls " << worst_of[r]);
    CHECK(worst_of[r] * 8 < single_of[r]);
  }
}

TEST_CASE("error feedback shows in the collective's label, and pairs with a rank without it", "[collective][ef]") {
  // The wire format is the same with and without feedback (same codec id): a group where only
  // some ranks keep residuals all-reduces as usual. The ranks record, the main thread checks.
  std::vector<float> got(3, 0.0f);
  std::vector<std::string> label(3);
  run_inproc(3, [&](inproc_group& g) {
    std::vector<float> v(300, static_cast<float>(g.rank() + 1));
    codec::int8 plain;
    codec::error_feedback<codec::int8> ef;
    if (g.rank() == 1) all_reduce(g, std::span<float>(v), topology::ring{}, ef);
    else all_reduce(g, std::span<float>(v), topology::ring{}, plain);
    got[static_cast<std::size_t>(g.rank())] = v[299];
    try {
      all_reduce(g, std::span<float>(static_cast<float*>(nullptr), 5), topology::ring{}, ef);
    } catch (const error& e) {
      label[static_cast<std::size_t>(g.rank())] = e.op();
    }
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(got[r] == Approx(6.0f).epsilon(1.0 / 127));
    CHECK(label[r] == "all_reduce(ring, int8+ef)");
  }
}

TEST_CASE("bad input and disagreeing ranks give clear errors within seconds", "[collective][errors]") {
  group_options quick;
  quick.timeout = 1000ms;
  const auto t0 = std::chrono::steady_clock::now();

  SECTION("mismatched counts") {
    CHECK_THROWS_WITH(run_inproc(4, [](inproc_group& g) {
                        std::vector<float> v(g.rank() == 2 ? 1000 : 1001);
                        codec::fp32 c;
                        all_reduce(g, std::span<float>(v), topology::ring{}, c);
                      }, quick),
                      Catch::Contains("mismatch between ranks: element count"));
  }
  SECTION("mismatched codecs") {
    CHECK_THROWS_WITH(run_inproc(3, [](inproc_group& g) {
                        std::vector<float> v(100);
                        if (g.rank() == 0) {
                          codec::bf16 c;
                          all_reduce(g, std::span<float>(v), topology::ring{}, c);
                        } else {
                          codec::fp32 c;
                          all_reduce(g, std::span<float>(v), topology::ring{}, c);
                        }
                      }, quick),
                      Catch::Contains("codecs differ"));
  }
  SECTION("a rank that never calls: the others time out naming the peer") {
    try {
      run_inproc(3, [](inproc_group& g) {
        if (g.rank() == 1) return;
        std::vector<float> v(100);
        codec::fp32 c;
        all_reduce(g, std::span<float>(v), topology::ring{}, c);
      }, quick);
      FAIL("no error");
    } catch (const error& e) {
      // Rank 2 waits for 1's header, rank 0 for 1 to take its data (and header), or for 2's data:
      // whichever deadline passes first reports.
      CHECK(e.code() == errc::timeout);
      CHECK((e.peer() == 1 || e.peer() == 2));
      CHECK_THAT(e.what(), Catch::Contains("all_reduce(ring, fp32) on rank"));
      if (e.peer() == 1) CHECK_THAT(e.what(), Catch::Contains("has not entered this collective"));
      else CHECK_THAT(e.what(), Catch::Contains("no data from the peer"));
    }
  }
  SECTION("null buffer, overflowing count, wrong torus shape, wrong sizes, bad root") {
    run_inproc(2, [](inproc_group& g) {
      codec::fp32 c;
      CHECK_THROWS_WITH(all_reduce(g, std::span<float>(static_cast<float*>(nullptr), 5), topology::ring{}, c),
                        Catch::Contains("null buffer with 5 elements"));
      float x = 0;
      CHECK_THROWS_WITH(all_reduce(g, std::span<float>(&x, std::size_t{1} << 60), topology::ring{}, c),
                        Catch::Contains("overflows"));
      std::vector<float> v(10), o(3);
      CHECK_THROWS_WITH(all_reduce(g, std::span<float>(v), topology::torus2d{2, 2}, c),
                        Catch::Contains("shape 2x2 does not match a group of 2 ranks"));
      CHECK_THROWS_WITH(reduce_scatter(g, std::span<const float>(v), std::span<float>(o), topology::ring{}, c),
                        Catch::Contains("input has 10 elements"));
      CHECK_THROWS_WITH(broadcast(g, std::span<float>(v), 7, topology::ring{}, c), Catch::Contains("root 7"));
    }, quick);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 15s);
}

TEST_CASE("split groups: per-row and per-column all-reduces, as for distributed batch norm", "[collective][split]") {
  run_inproc(6, [](inproc_group& g) {
    auto row = g.split(g.rank() / 3, g.rank());
    auto col = g.split(g.rank() % 3, g.rank());
    std::vector<float> stats = {1.0f, static_cast<float>(g.rank()), static_cast<float>(g.rank() * g.rank())};
    codec::fp32 c;
    all_reduce(row, std::span<float>(stats), topology::ring{}, c);
    const int base = (g.rank() / 3) * 3;
    CHECK(stats[0] == 3.0f);
    CHECK(stats[1] == static_cast<float>(3 * base + 3));
    std::vector<float> one = {static_cast<float>(g.rank())};
    all_reduce(col, std::span<float>(one), topology::ring{}, c);
    CHECK(one[0] == static_cast<float>(2 * (g.rank() % 3) + 3));
    barrier(g);
  });
}

TEST_CASE("nested collectives: an epilogue all-reduces, six levels deep, each with scratch of its own", "[collective][nested]") {
  for (auto* which : {"host", "stream"}) {
    INFO(which);
    auto body = [](auto& g) {
      constexpr int levels = 6;
      std::vector<std::vector<float>> bufs(levels + 1);
      for (int l = 0; l <= levels; ++l) {
        bufs[static_cast<std::size_t>(l)].resize(5000 + 977 * static_cast<std::size_t>(l));
        for (std::size_t i = 0; i < bufs[static_cast<std::size_t>(l)].size(); ++i)
          bufs[static_cast<std::size_t>(l)][i] = input(g.rank() + 10 * l, i, true);
      }
      codec::int8 c;  // lossy: every level encodes into its own scratch, so a shared one would corrupt
      std::vector<std::size_t> depth_seen;
      std::function<void(int)> level = [&](int l) {
        bool first = true;
        all_reduce(g, std::span<float>(bufs[static_cast<std::size_t>(l)]), topology::ring{}, c, reduce_op::sum,
                   [&](std::size_t, std::size_t) {
                     if (!first || l == levels) return;
                     first = false;
                     depth_seen.push_back(g.depth());
                     level(l + 1);
                   });
      };
      level(0);
      return std::make_pair(bufs, depth_seen);
    };
    // The reference: the same all-reduces one after another, no nesting.
    std::vector<std::vector<std::vector<float>>> nested(4), flat(4);
    std::vector<std::vector<std::size_t>> depths(4);
    auto record = [&](auto& g) {
      auto [b, d] = body(g);
      nested[static_cast<std::size_t>(g.rank())] = b;
      depths[static_cast<std::size_t>(g.rank())] = d;
    };
    if (std::string(which) == "host") on_host::run(4, record);
    else on_stream::run(4, record);
    on_host::run(4, [&](auto& g) {
      std::vector<std::vector<float>> bufs(7);
      codec::int8 c;
      for (int l = 0; l <= 6; ++l) {
        bufs[static_cast<std::size_t>(l)].resize(5000 + 977 * static_cast<std::size_t>(l));
        for (std::size_t i = 0; i < bufs[static_cast<std::size_t>(l)].size(); ++i)
          bufs[static_cast<std::size_t>(l)][i] = input(g.rank() + 10 * l, i, true);
        all_reduce(g, std::span<float>(bufs[static_cast<std::size_t>(l)]), topology::ring{}, c);
      }
      flat[static_cast<std::size_t>(g.rank())] = bufs;
    });
    for (std::size_t r = 0; r < 4; ++r) {
      REQUIRE(depths[r] == std::vector<std::size_t>{0, 1, 2, 3, 4, 5});  // the depth of the caller
      for (std::size_t l = 0; l <= 6; ++l) REQUIRE(nested[r][l] == flat[r][l]);
    }
  }
}

TEST_CASE("stream-ordered: the epilogue enqueues behind the range's last work", "[collective][stream][epilogue]") {
  run_inproc_deferred(5, [](auto& g) {
    std::vector<float> v(70001), snapshot(v.size(), -1.0f);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = input(g.rank(), i, false);
    std::vector<int> seen(v.size(), 0);
    codec::dyntree8 c;
    all_reduce(g, std::span<float>(v), topology::torus2d{}, c, reduce_op::average, [&](std::size_t first, std::size_t count) {
      for (std::size_t i = first; i < first + count; ++i) ++seen[i];
      // Runs on the stream after the range's decode: it must see the final values.
      g.space().copy(snapshot.data() + first, v.data() + first, count * sizeof(float));
    });
    for (std::size_t i = 0; i < v.size(); ++i) {
      REQUIRE(seen[i] == 1);
      REQUIRE(snapshot[i] == v[i]);
    }
  });
}

TEST_CASE("stream-ordered: asynchronous calls return before the work is done and keep call order", "[collective][stream][async]") {
  run_inproc_deferred(4, [](auto& g) {
    std::vector<std::vector<float>> buckets(5, std::vector<float>(30000));
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (std::size_t i = 0; i < buckets[b].size(); ++i) buckets[b][i] = static_cast<float>(g.rank() + b);
    codec::bf16 c;
    // Hold the stream: nothing queued behind this can have run when the calls return.
    std::atomic<bool> go{false};
    g.space().handle()->enqueue([&] {
      while (!go.load()) std::this_thread::yield();
    });
    std::vector<request> reqs;
    for (auto& b : buckets) reqs.push_back(all_reduce_async(g, std::span<float>(b), topology::ring{}, c));
    for (auto& r : reqs) REQUIRE_FALSE(r.ready());
    REQUIRE(buckets[4][0] == static_cast<float>(g.rank() + 4));
    go = true;
    for (auto& r : reqs) r.wait();
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (float x : buckets[b]) REQUIRE(x == static_cast<float>(6 + 4 * b));
  });
}

TEST_CASE("stream-ordered: disagreeing ranks and absent peers give clear errors within seconds", "[collective][stream][errors]") {
  group_options quick;
  quick.timeout = 1000ms;
  const auto t0 = std::chrono::steady_clock::now();
  SECTION("mismatched counts: a message of the wrong size") {
    CHECK_THROWS_WITH(run_inproc_deferred(4, [](auto& g) {
                        std::vector<float> v(g.rank() == 2 ? 1000 : 1001);
                        codec::fp32 c;
                        all_reduce(g, std::span<float>(v), topology::ring{}, c);
                      }, quick),
                      Catch::Contains("mismatch between ranks") && Catch::Contains("all_reduce(ring, fp32)"));
  }
  SECTION("a rank that never calls: the others time out naming the peer") {
    try {
      run_inproc_deferred(3, [](auto& g) {
        if (g.rank() == 1) return;
        std::vector<float> v(100);
        codec::fp32 c;
        all_reduce(g, std::span<float>(v), topology::ring{}, c);
      }, quick);
      FAIL("no error");
    } catch (const error& e) {
      CHECK(e.code() == errc::timeout);
      CHECK((e.peer() == 1 || e.peer() == 2));
      CHECK_THAT(e.what(), Catch::Contains("all_reduce(ring, fp32) on rank"));
    }
  }
  SECTION("an asynchronous call's error surfaces from wait()") {
    CHECK_THROWS_WITH(run_inproc_deferred(2, [](auto& g) {
                        codec::fp32 c;
                        auto r = all_reduce_async(g, std::span<float>(static_cast<float*>(nullptr), 5), topology::ring{}, c);
                        r.wait();
                      }, quick),
                      Catch::Contains("null buffer with 5 elements"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 15s);
}

TEST_CASE("error-feedback residuals saved after k calls and loaded into a fresh codec continue bit for bit", "[collective][ef]") {
  auto check = [](auto runner) {
    using Run = decltype(runner);
    const std::size_t n = 12345;
    std::vector<std::vector<float>> straight(3), resumed(3);
    auto calls = [&](auto& g, codec::error_feedback<codec::dyntree8>& ef, std::vector<float>& v, int from, int to) {
      for (int k = from; k < to; ++k) {
        for (std::size_t i = 0; i < n; ++i) v[i] = input(g.rank() + 7 * k, i, false);
        all_reduce(g, std::span<float>(v), topology::torus2d{}, ef, reduce_op::average);
      }
    };
    Run::run(3, [&](auto& g) {
      codec::error_feedback<codec::dyntree8> ef;
      std::vector<float> v(n);
      calls(g, ef, v, 0, 6);
      straight[static_cast<std::size_t>(g.rank())] = v;
    });
    Run::run(3, [&](auto& g) {
      std::vector<float> v(n), saved(codec::error_feedback<codec::dyntree8>::state_floats(n));
      {
        codec::error_feedback<codec::dyntree8> ef;
        calls(g, ef, v, 0, 3);
        ef.save(std::span<const float>(v), saved.data(), g.space());
        if constexpr (std::decay_t<decltype(g)>::ordered) g.space().drain(std::chrono::steady_clock::now() + 10s);
      }
      codec::error_feedback<codec::dyntree8> fresh;  // as a resumed run has it: no residuals yet
      fresh.load(std::span<const float>(v), saved.data(), g.space());
      calls(g, fresh, v, 3, 6);
      resumed[static_cast<std::size_t>(g.rank())] = v;
    });
    for (std::size_t r = 0; r < 3; ++r)
      REQUIRE(std::memcmp(straight[r].data(), resumed[r].data(), n * sizeof(float)) == 0);
  };
  check(on_host{});
  check(on_stream{});
}
