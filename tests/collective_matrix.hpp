// tests/collective_matrix.hpp: the in-process collective matrix's runners, inputs and checks,
// shared by tests/test_collective.cpp (over inproc, and every other collective case),
// tests/test_collective_stream.cpp (the same matrix over inproc_deferred) and
// tests/test_collective_v.cpp (per-rank counts; its runners and results from here). Two programs, so that
// the two template-heavy matrices compile in parallel: under ASan one file of both took 12 minutes
// of a core, the longest step of CI's sanitizer builds. What the matrix checks: test_collective.cpp.
#pragma once

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
// segment_bytes 0: the group's default.
inline group_options matrix_options(std::size_t segment_bytes = 0) {
  group_options o;
  o.timeout = std::chrono::seconds(60);
  o.segment_bytes = segment_bytes;
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

inline bool small_matrix() {
  static const bool small = [] {
    const char* e = std::getenv("LOCKSTEP_SMALL_MATRIX");
    return e && std::string(e) == "1";
  }();
  return small;
}
inline int max_ranks() { return small_matrix() ? 5 : 9; }

// Inputs: integers in [-8, 8] for exact fp32 checks; Gaussian values for lossy codecs.
inline float input(int rank, std::size_t i, bool integer) {
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
  const auto [ref, m] = lockstep_test::reference_all_reduce(n, count, op == reduce_op::average,
                                                           [&](int r, std::size_t i) { return input(r, i, integer); });
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
    // direct's fan-in (every peer's copy added in one pass on a host group) from 3 ranks on.
    if (n == 2 || n == 3 || n == 4 || n == 7) f(topology::direct{});
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
