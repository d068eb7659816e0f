// topology::automatic: the choice is the simulator's fastest candidate, deterministic and shared
// by copies; LOCKSTEP_TOPOLOGY forces one; every op and codec through it gives bitwise what the
// chosen topology gives; ranks that choose differently fail with a mismatch; calibrate_automatic
// leaves every rank with the same parameters.
#include <lockstep/lockstep.hpp>

#include "thread_safe_catch.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

using namespace lockstep;
using topology::automatic;
using topology::choice;
using topology::operation;

namespace {

// Sets LOCKSTEP_TOPOLOGY for one scope.
struct forced_topology {
  explicit forced_topology(const char* v) { setenv("LOCKSTEP_TOPOLOGY", v, 1); }
  ~forced_topology() { unsetenv("LOCKSTEP_TOPOLOGY"); }
};

float input(int rank, std::size_t i) { return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 13) % 17) - 8); }

// The op through automatic and through the topology it chose: the same bits on every rank.
template <class C>
void same_as_choice(int n, std::size_t count, operation op) {
  std::mutex m;
  std::vector<std::string> failures;
  const automatic a;
  run_inproc(n, [&](auto& g) {
    C c1{}, c2{};
    const std::size_t total = op == operation::all_reduce || op == operation::broadcast ? count : count * static_cast<std::size_t>(n);
    std::vector<float> x(total), y;
    for (std::size_t i = 0; i < total; ++i) x[i] = input(g.rank(), i);
    y = x;
    const choice pick = a.choose(op, g.size(), total, c1, g.segment_bytes());
    if (op == operation::all_reduce) all_reduce(g, std::span<float>(x), a, c1);
    else if (op == operation::reduce_scatter) reduce_scatter_inplace(g, std::span<float>(x), a, c1);
    else if (op == operation::all_gather) all_gather_inplace(g, std::span<float>(x), a, c1);
    else broadcast(g, std::span<float>(x), n - 1, a, c1);
    // The same call over the chosen topology (at the group's segment size: segments are whole
    // codec blocks counted from each chunk's start, so their size changes no bits).
    automatic::visit(pick.kind, [&](const auto& topo) {
      if (op == operation::all_reduce) all_reduce(g, std::span<float>(y), topo, c2);
      else if (op == operation::reduce_scatter) reduce_scatter_inplace(g, std::span<float>(y), topo, c2);
      else if (op == operation::all_gather) all_gather_inplace(g, std::span<float>(y), topo, c2);
      else broadcast(g, std::span<float>(y), n - 1, topo, c2);
    });
    // reduce_scatter: only this rank's chunk is defined
    std::size_t lo = 0, hi = total;
    if (op == operation::reduce_scatter) std::tie(lo, hi) = chunk_range(total, static_cast<std::size_t>(n), static_cast<std::size_t>(g.rank()));
    if (hi > lo && std::memcmp(x.data() + lo, y.data() + lo, (hi - lo) * sizeof(float)) != 0) {
      std::lock_guard lk(m);
      failures.push_back(std::string("rank ") + std::to_string(g.rank()) + ": automatic (" + pick.name() + ") differs");
    }
  });
  for (const auto& f : failures) FAIL(f);
}

}  // namespace

TEST_CASE("automatic picks the simulator's fastest candidate, the earlier one on a tie", "[automatic]") {
  const automatic a;  // the simulator's default link: 25 us, 1 Gbit/s
  codec::fp32 c;
  for (int n : {2, 3, 4, 8, 13}) {
    for (std::size_t count : {std::size_t{1024}, std::size_t{1} << 16, std::size_t{1} << 22}) {
      CAPTURE(n, count);
      const auto all = a.explain(operation::all_reduce, n, count, c, std::size_t{1} << 20);
      REQUIRE(all.size() == 12);  // 4 topologies x (the group's segment, 256 KiB, 4 MiB)
      const choice pick = a.choose(operation::all_reduce, n, count, c, std::size_t{1} << 20);
      // The fastest at the group's segment (the earlier on a tie), unless another segment size
      // is faster by more than the margin.
      double own = 1e300, other = 1e300;
      for (const choice& x : all) (x.segment_bytes ? other : own) = std::min(x.segment_bytes ? other : own, x.predicted_s);
      const bool switch_segment = other < own * (1 - a.segment_margin);
      CHECK((pick.segment_bytes != 0) == switch_segment);
      CHECK(pick.predicted_s == (switch_segment ? other : own));
      const auto first = std::find_if(all.begin(), all.end(), [&](const choice& x) {
        return x.predicted_s == pick.predicted_s && (x.segment_bytes != 0) == switch_segment;
      });
      CHECK(first->kind == pick.kind);
      CHECK(first->segment_bytes == pick.segment_bytes);
      // The cached answer is the same, in this object and in a copy.
      const automatic copy = a;
      CHECK(copy.choose(operation::all_reduce, n, count, c, std::size_t{1} << 20).kind == pick.kind);
    }
  }
  // Latency-bound: recursive doubling's log2 N steps; bandwidth-bound: never its log2 N passes.
  CHECK(a.choose(operation::all_reduce, 8, 1024, c, 1 << 20).kind == choice::recursive_doubling);
  CHECK(a.choose(operation::all_reduce, 8, std::size_t{1} << 24, c, 1 << 20).kind != choice::recursive_doubling);
  // One rank: nothing to choose.
  CHECK(a.choose(operation::all_reduce, 1, 1024, c, 1 << 20).kind == choice::ring);
}

TEST_CASE("LOCKSTEP_TOPOLOGY forces a topology, and a bad value is an error naming it", "[automatic]") {
  const automatic a;
  codec::fp32 c;
  {
    forced_topology f("ring");
    CHECK(a.choose(operation::all_reduce, 8, 1024, c, 1 << 20).kind == choice::ring);
  }
  {
    forced_topology f("halving_doubling");
    CHECK(a.choose(operation::all_reduce, 8, 1024, c, 1 << 20).kind == choice::halving_doubling);
  }
  {
    forced_topology f("hypercube");
    CHECK_THROWS_WITH(a.choose(operation::all_reduce, 8, 1024, c, 1 << 20), Catch::Contains("LOCKSTEP_TOPOLOGY=hypercube"));
  }
  CHECK(a.choose(operation::all_reduce, 8, 1024, c, 1 << 20).kind == choice::recursive_doubling);
}

TEMPLATE_TEST_CASE("every op through automatic gives the bits of the topology it chose", "[automatic]", codec::fp32,
                   codec::int8, codec::dyntree8) {
  for (int n : {1, 2, 3, 4, 5})
    for (std::size_t count : {std::size_t{0}, std::size_t{7}, std::size_t{3001}, std::size_t{1} << 19})
      for (operation op : {operation::all_reduce, operation::reduce_scatter, operation::all_gather, operation::broadcast}) {
        CAPTURE(n, count, static_cast<int>(op));
        same_as_choice<TestType>(n, count, op);
      }
}

TEST_CASE("ranks whose automatic chooses differently fail with a mismatch naming the topologies", "[automatic]") {
  std::mutex m;
  std::vector<std::string> what;
  group_options opt;
  opt.timeout = std::chrono::seconds(20);
  run_inproc(
      4,
      [&](auto& g) {
        automatic a;
        // Rank 0's link is all latency (recursive doubling); the others' all bandwidth.
        a.link = g.rank() == 0 ? sim::link_params{1.0, 1e15} : sim::link_params{1e-12, 1e6};
        std::vector<float> v(1024, 1.0f);
        codec::fp32 c;
        try {
          all_reduce(g, std::span<float>(v), a, c);
        } catch (const error& e) {
          std::lock_guard lk(m);
          what.push_back(e.what());
        }
      },
      opt);
  REQUIRE(!what.empty());
  bool named = false;
  for (const auto& w : what) named = named || w.find("topologies differ") != std::string::npos;
  CHECK(named);
}

TEST_CASE("calibrate_automatic leaves every rank with the same parameters", "[automatic]") {
  std::mutex m;
  std::vector<automatic> got(4);
  run_inproc(4, [&](auto& g) {
    automatic a = calibrate_automatic(g);
    std::lock_guard lk(m);
    got[static_cast<std::size_t>(g.rank())] = a;
  });
  for (const automatic& a : got) {
    CHECK(a.link.latency_s == got[0].link.latency_s);
    CHECK(a.link.bandwidth_Bps == got[0].link.bandwidth_Bps);
    CHECK(a.link.exchange_efficiency == got[0].link.exchange_efficiency);
    CHECK(a.link.overhead_s == got[0].link.overhead_s);
    CHECK(a.rates.size() == 4);
    CHECK(a.rates.at("int8").encode_s == got[0].rates.at("int8").encode_s);
  }
  CHECK(got[0].link.bandwidth_Bps > 0);
  CHECK(got[0].link.latency_s >= 0);
  CHECK(got[0].link.overhead_s >= 0);
  CHECK(got[0].rates.at("fp32").decode_add_s > 0);
}
