// Topologies: schedule properties checked by a symbolic execution of every rank's steps.
// Each rank holds, per chunk, the set of ranks whose contribution it contains; a reduce must join
// disjoint sets (a contribution counted twice is a bug), a copy overwrites. For N = 1..64 and
// every factorisation of N, every rank must end with every chunk holding each contribution once.
#include <lockstep/topology.hpp>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

using namespace lockstep;
using topology::schedule;

namespace {

using mask = std::uint64_t;
struct message {
  topology::chunk_span span;
  std::vector<mask> data;
};

// Runs all ranks' schedules against each other with FIFO channels; returns each rank's final
// per-chunk masks. Fails the test on a deadlock, a span mismatch, or a double count.
std::vector<std::vector<mask>> execute(const std::vector<schedule>& s, std::vector<std::vector<mask>> state) {
  const int n = static_cast<int>(s.size());
  std::map<std::pair<int, int>, std::deque<message>> channel;
  std::vector<std::size_t> next(static_cast<std::size_t>(n), 0);
  std::vector<bool> sent(static_cast<std::size_t>(n), false);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      auto& i = next[static_cast<std::size_t>(r)];
      while (i < s[static_cast<std::size_t>(r)].steps.size()) {
        const auto& st = s[static_cast<std::size_t>(r)].steps[i];
        // Only an exchange sends and receives one span (both ends send what they held before).
        if (!topology::is_exchange(st)) REQUIRE_FALSE(st.send.overlaps(st.recv));
        if (st.send_peer >= 0 && !sent[static_cast<std::size_t>(r)]) {
          message m{st.send, {}};
          for (auto c = st.send.first; c < st.send.end(); ++c) m.data.push_back(state[static_cast<std::size_t>(r)][c]);
          channel[{r, st.send_peer}].push_back(m);
          sent[static_cast<std::size_t>(r)] = true;
          progress = true;
        }
        if (st.recv_peer >= 0) {
          auto& q = channel[{st.recv_peer, r}];
          if (q.empty()) break;
          message m = q.front();
          q.pop_front();
          REQUIRE(m.span == st.recv);
          for (std::uint32_t k = 0; k < st.recv.count; ++k) {
            mask& dst = state[static_cast<std::size_t>(r)][st.recv.first + k];
            if (st.act == topology::action::reduce) {
              REQUIRE((dst & m.data[k]) == 0);
              dst |= m.data[k];
            } else {
              dst = m.data[k];
            }
          }
        }
        sent[static_cast<std::size_t>(r)] = false;
        ++i;
        progress = true;
      }
    }
  }
  for (int r = 0; r < n; ++r) REQUIRE(next[static_cast<std::size_t>(r)] == s[static_cast<std::size_t>(r)].steps.size());
  for (auto& [k, q] : channel) REQUIRE(q.empty());
  return state;
}

template <class T>
void check_topology(const T& topo, int n) {
  const mask all = n == 64 ? ~mask{0} : ((mask{1} << n) - 1);
  std::vector<schedule> rs, ag, ar;
  for (int r = 0; r < n; ++r) {
    rs.push_back(topo.reduce_scatter(r, n));
    ag.push_back(topo.all_gather(r, n));
    ar.push_back(topology::all_reduce_schedule(topo, r, n));
    REQUIRE(rs.back().owned == topology::chunk_span{static_cast<std::uint32_t>(r), 1});
  }
  // Reduce-scatter: each rank starts with its own contribution in every chunk.
  std::vector<std::vector<mask>> own(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) own[static_cast<std::size_t>(r)].assign(static_cast<std::size_t>(n), mask{1} << r);
  auto after_rs = execute(rs, own);
  for (int r = 0; r < n; ++r) CHECK(after_rs[static_cast<std::size_t>(r)][static_cast<std::size_t>(r)] == all);
  // An all-reduce or broadcast schedule of a topology's own may cut the buffer differently
  // (recursive doubling: one chunk).
  const auto ar_chunks = static_cast<std::size_t>(ar[0].chunks);
  for (const auto& x : ar) REQUIRE(x.chunks == ar_chunks);
  std::vector<std::vector<mask>> own_ar(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) own_ar[static_cast<std::size_t>(r)].assign(ar_chunks, mask{1} << r);
  auto after_ar = execute(ar, own_ar);
  for (int r = 0; r < n; ++r)
    for (std::size_t c = 0; c < ar_chunks; ++c) CHECK(after_ar[static_cast<std::size_t>(r)][c] == all);
  // All-gather: rank r starts with only chunk r (marked by r); everyone ends with chunk c from c.
  std::vector<std::vector<mask>> gather(static_cast<std::size_t>(n), std::vector<mask>(static_cast<std::size_t>(n), 0));
  for (int r = 0; r < n; ++r) gather[static_cast<std::size_t>(r)][static_cast<std::size_t>(r)] = mask{1} << r;
  auto after_ag = execute(ag, gather);
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < n; ++c) CHECK(after_ag[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)] == mask{1} << c);
  // Broadcast from every root: everyone ends with the root's chunks.
  for (int root = 0; root < n; root += std::max(1, n / 3)) {
    std::vector<schedule> bc;
    for (int r = 0; r < n; ++r) bc.push_back(topology::broadcast_schedule(topo, root, r, n));
    const auto bc_chunks = static_cast<std::size_t>(bc[0].chunks);
    std::vector<std::vector<mask>> init(static_cast<std::size_t>(n), std::vector<mask>(bc_chunks, 0));
    init[static_cast<std::size_t>(root)].assign(bc_chunks, mask{1} << root);
    auto after = execute(bc, init);
    for (int r = 0; r < n; ++r)
      for (std::size_t c = 0; c < bc_chunks; ++c) CHECK(after[static_cast<std::size_t>(r)][c] == mask{1} << root);
  }
}

}  // namespace

TEST_CASE("ring: every contribution exactly once for N = 1..64", "[topology][ring]") {
  for (int n = 1; n <= 64; ++n) {
    INFO("N = " << n);
    check_topology(topology::ring{}, n);
    CHECK(topology::all_reduce_schedule(topology::ring{}, 0, n).steps.size() == static_cast<std::size_t>(2 * (n - 1)));
  }
}

TEST_CASE("torus2d: every contribution exactly once for every factorisation of N = 1..64", "[topology][torus2d]") {
  for (int n = 1; n <= 64; ++n)
    for (int r = 1; r <= n; ++r) {
      if (n % r) continue;
      const int c = n / r;
      INFO("N = " << n << " shape " << r << "x" << c);
      topology::torus2d t{r, c};
      check_topology(t, n);
      // The latency term: 2(R + C - 2) steps instead of the ring's 2(N - 1).
      CHECK(topology::all_reduce_schedule(t, 0, n).steps.size() == static_cast<std::size_t>(2 * (r + c - 2)));
    }
}

TEST_CASE("direct: every contribution exactly once for N = 1..64, each peer's copy sent unreduced", "[topology][direct]") {
  for (int n = 1; n <= 64; ++n) {
    INFO("N = " << n);
    check_topology(topology::direct{}, n);
    for (int r = 0; r < n; ++r) {
      const auto rs = topology::direct{}.reduce_scatter(r, n);
      REQUIRE(rs.steps.size() == static_cast<std::size_t>(n - 1));
      // What makes the executor's fan-in legal: every step receives the owned chunk, each from
      // another peer, and sends only chunks it never receives into.
      std::vector<int> from;
      for (const auto& st : rs.steps) {
        CHECK(st.recv == rs.owned);
        CHECK_FALSE(st.send.overlaps(rs.owned));
        from.push_back(st.recv_peer);
      }
      std::sort(from.begin(), from.end());
      CHECK(std::adjacent_find(from.begin(), from.end()) == from.end());
      CHECK(topology::all_reduce_schedule(topology::direct{}, r, n).steps.size() == static_cast<std::size_t>(2 * (n - 1)));
    }
  }
  const std::string d = topology::all_reduce_schedule(topology::direct{}, 1, 4).str();
  CHECK_THAT(d, Catch::Contains("0 [rs] send chunk 2 -> 2; recv chunk 1 <- 0 (reduce)"));
  CHECK_THAT(d, Catch::Contains("2 [rs] send chunk 0 -> 0; recv chunk 1 <- 2 (reduce)"));
  CHECK_THAT(d, Catch::Contains("3 [ag] send chunk 1 -> 2; recv chunk 0 <- 0 (copy)"));
  CHECK_THROWS_AS(topology::direct{}.validate(0), error);
}

// log2 of the largest power of two <= n, and whether ranks were folded in.
int log2_floor(int n) {
  int k = 0;
  while ((2 << k) <= n) ++k;
  return k;
}

TEST_CASE("halving_doubling: every contribution exactly once for N = 1..64", "[topology][halving_doubling]") {
  for (int n = 1; n <= 64; ++n) {
    INFO("N = " << n);
    check_topology(topology::halving_doubling{}, n);
    // 2 log2 N steps on a power of two; a folded pair's odd rank takes 3 more per phase.
    const int k = log2_floor(n), p = 1 << k;
    for (int r = 0; r < n; ++r) {
      const auto steps = topology::all_reduce_schedule(topology::halving_doubling{}, r, n).steps.size();
      if (n == p) CHECK(steps == static_cast<std::size_t>(2 * k));
      else CHECK(steps <= static_cast<std::size_t>(2 * k + 6));
    }
  }
}

TEST_CASE("recursive_doubling: every contribution exactly once for N = 1..64", "[topology][recursive_doubling]") {
  for (int n = 1; n <= 64; ++n) {
    INFO("N = " << n);
    check_topology(topology::recursive_doubling{}, n);
    const int k = log2_floor(n), p = 1 << k;
    for (int r = 0; r < n; ++r) {
      const auto ar = topology::all_reduce_schedule(topology::recursive_doubling{}, r, n);
      // log2 N exchanges of the whole buffer; a folded pair adds one step before and one after.
      CHECK(ar.steps.size() == static_cast<std::size_t>(k + (r < 2 * (n - p) ? (r % 2 ? 2 : 2 - k) : 0)));
      // Binomial broadcast: no rank takes more than ceil(log2 N) steps.
      const auto bc = topology::broadcast_schedule(topology::recursive_doubling{}, 0, r, n);
      CHECK(bc.steps.size() <= static_cast<std::size_t>(k + (n != p)));
    }
  }
}

TEST_CASE("halving_doubling and recursive_doubling print as readable steps", "[topology]") {
  const std::string hd = topology::all_reduce_schedule(topology::halving_doubling{}, 1, 4).str();
  CHECK_THAT(hd, Catch::Contains("rank 1 of 4, 4 chunks, owns chunk 1"));
  CHECK_THAT(hd, Catch::Contains("0 [rs] send chunks 2..3 -> 3; recv chunks 0..1 <- 3 (reduce)"));
  CHECK_THAT(hd, Catch::Contains("1 [rs] send chunk 0 -> 0; recv chunk 1 <- 0 (reduce)"));
  CHECK_THAT(hd, Catch::Contains("3 [ag] send chunks 0..1 -> 3; recv chunks 2..3 <- 3 (copy)"));
  const std::string rd = topology::all_reduce_schedule(topology::recursive_doubling{}, 2, 3).str();
  CHECK_THAT(rd, Catch::Contains("rank 2 of 3, 1 chunks, owns chunk 0"));
  CHECK_THAT(rd, Catch::Contains("0 [rs] exchange chunk 0 <-> 1 (reduce)"));
  const std::string folded = topology::all_reduce_schedule(topology::recursive_doubling{}, 0, 3).str();
  CHECK_THAT(folded, Catch::Contains("owns nothing"));
  CHECK_THAT(folded, Catch::Contains("1 [ag] recv chunk 0 <- 1 (copy)"));
  static_assert(topology::topology<topology::halving_doubling> && topology::topology<topology::recursive_doubling>);
}

TEST_CASE("torus2d picks the most square shape and rejects a wrong one", "[topology][torus2d]") {
  CHECK(topology::torus2d{}.shape(12) == std::pair{3, 4});
  CHECK(topology::torus2d{}.shape(16) == std::pair{4, 4});
  CHECK(topology::torus2d{}.shape(7) == std::pair{1, 7});
  CHECK(topology::torus2d{}.shape(1024) == std::pair{32, 32});
  CHECK(topology::all_reduce_schedule(topology::torus2d{}, 0, 1024).steps.size() == 124u);  // the paper's 124 vs 2046
  CHECK_THROWS_WITH(topology::torus2d({3, 3}).validate(8), Catch::Contains("shape 3x3 does not match a group of 8 ranks"));
  CHECK_THROWS_AS(topology::torus2d({0, 4}).reduce_scatter(0, 4), lockstep::error);
}

TEST_CASE("schedules print as readable steps", "[topology]") {
  auto s = topology::all_reduce_schedule(topology::torus2d{2, 2}, 3, 4);
  const std::string text = s.str();
  CHECK_THAT(text, Catch::Contains("rank 3 of 4, 4 chunks, owns chunk 3"));
  CHECK_THAT(text, Catch::Contains("[rs] send chunks 0..1 -> 1; recv chunks 2..3 <- 1 (reduce)"));
  CHECK_THAT(text, Catch::Contains("[ag]"));
  static_assert(topology::topology<topology::ring> && topology::topology<topology::torus2d>);
}

TEST_CASE("a torus shape that does not fit names the calling rank", "[topology][torus2d]") {
  auto error_of = [](auto&& f) -> lockstep::error {
    try {
      f();
    } catch (const lockstep::error& e) {
      return e;
    }
    FAIL("no lockstep::error thrown");
    throw;
  };
  const topology::torus2d t{3, 3};
  for (int rank : {0, 5}) {
    CAPTURE(rank);
    auto e = error_of([&] { t.reduce_scatter(rank, 8); });
    CHECK(e.rank() == rank);
    CHECK(e.code() == errc::invalid_argument);
    CHECK_THAT(e.detail(), Catch::Contains("shape 3x3 does not match a group of 8 ranks"));
    CHECK(error_of([&] { t.all_gather(rank, 8); }).rank() == rank);
    CHECK(error_of([&] { t.validate(8, rank); }).rank() == rank);
    CHECK(error_of([&] { topology::ring{}.validate(0, rank); }).rank() == rank);
  }
  // No calling rank (a tool, not a member of the group): -1, as before.
  CHECK(error_of([&] { t.validate(8); }).rank() == -1);
  // The default shape refuses an empty group instead of dividing by its 0 columns.
  CHECK(error_of([] { topology::torus2d{}.reduce_scatter(0, 0); }).rank() == 0);
}

// The symmetry ring and torus2d declare is checked here for every rank and step, not trusted.
TEST_CASE("ring and torus2d schedules have the translation symmetry they declare", "[topology][symmetry]") {
  static_assert(topology::symmetric_topology<topology::ring> && topology::symmetric_topology<topology::torus2d>);
  auto check = [](const auto& t, int n) {
    const topology::grid_symmetry sym = t.symmetry(n);
    REQUIRE(sym.rows * sym.cols == n);
    const schedule s0 = topology::all_reduce_schedule(t, 0, n);
    for (int m = 0; m < n; ++m) {
      const schedule sm = topology::all_reduce_schedule(t, m, n);
      REQUIRE(sm.steps.size() == s0.steps.size());
      for (std::size_t k = 0; k < s0.steps.size(); ++k) {
        const auto &x = s0.steps[k], &y = sm.steps[k];
        CAPTURE(n, sym.rows, sym.cols, m, k);
        REQUIRE(sym.move(x.send_peer, m) == y.send_peer);
        REQUIRE(sym.move(x.recv_peer, m) == y.recv_peer);
        REQUIRE(x.send.count == y.send.count);
        REQUIRE(x.recv.count == y.recv.count);
        REQUIRE(x.act == y.act);
        REQUIRE(x.phase == y.phase);
      }
    }
  };
  for (int n = 1; n <= 24; ++n) {
    check(topology::ring{}, n);
    check(topology::torus2d{}, n);
    for (int r = 1; r <= n; ++r)
      if (n % r == 0) check(topology::torus2d{r, n / r}, n);
  }
  CHECK(topology::ring{}.symmetry(6) == topology::grid_symmetry{1, 6});
  CHECK(topology::torus2d{}.symmetry(12) == topology::grid_symmetry{3, 4});
  CHECK(topology::torus2d{4, 3}.symmetry(12) == topology::grid_symmetry{4, 3});
}

TEST_CASE("grid_symmetry moves ranks on the torus and leaves 'no peer' alone", "[topology][symmetry]") {
  constexpr topology::grid_symmetry g{3, 4};  // r = i*4 + j
  static_assert(g.move(-1, 7) == -1);
  static_assert(g.move(0, 7) == 7);
  static_assert(g.move(7, 0) == 7);
  CHECK(g.move(3, 1) == 0);    // (0,3) + (0,1) wraps the row
  CHECK(g.move(9, 4) == 1);    // (2,1) + (1,0) wraps the column
  CHECK(g.move(11, 5) == 0);   // (2,3) + (1,1) wraps both
  constexpr topology::grid_symmetry ring{1, 5};
  CHECK(ring.move(4, 3) == 2);
}
