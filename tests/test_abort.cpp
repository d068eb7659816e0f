// The abort contract in-process (transport/concept.hpp: abort; collective/group.hpp: abort): a
// rank that fails tells every rank of its group, not only its neighbours, and each stops with
// errc::aborted naming the failing rank and its message, long before the group's timeout. The MPI
// transport's version is tests/mpi/fault_inject.cpp (real processes, killed ones too).
#include <catch2/catch.hpp>

#include <chrono>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/transport/run_inproc.hpp"

using namespace lockstep;
using namespace std::chrono_literals;
using inproc_group = group<transport::inproc>;

namespace {

// What one rank saw: the error it threw (if a lockstep::error), or another exception's text.
struct outcome {
  std::optional<errc> code;
  int peer = -1;
  std::string what;
  std::chrono::steady_clock::duration took{};
};

// Runs `n` ranks with a 20 s timeout; `body` runs inside a try on each, timed.
template <class F>
std::vector<outcome> run(int n, F body) {
  std::vector<outcome> out(static_cast<std::size_t>(n));
  run_inproc(n, [&](inproc_group& g) {
    auto& o = out[static_cast<std::size_t>(g.rank())];
    const auto t0 = std::chrono::steady_clock::now();
    try {
      body(g);
    } catch (const error& e) {
      o.code = e.code();
      o.peer = e.peer();
      o.what = e.what();
    } catch (const std::exception& e) {
      o.what = e.what();
    }
    o.took = std::chrono::steady_clock::now() - t0;
  }, group_options{20s});
  return out;
}

}  // namespace

TEST_CASE("a failing rank stops every rank of the group at once, naming it", "[abort]") {
  const int n = GENERATE(3, 6);
  INFO(n << " ranks");
  std::vector<float> v0(4096, 1.0f);

  SECTION("an epilogue that throws: its rank's exception goes on, the others are aborted") {
    const int bad = n - 2;
    const auto out = run(n, [&](inproc_group& g) {
      std::vector<float> v = v0;
      codec::int8 c;
      for (int i = 0; i < 5; ++i) {
        auto ep = [&](std::size_t, std::size_t) {
          if (g.rank() == bad && i == 3) throw std::runtime_error("diverged at step 3");
        };
        all_reduce(g, std::span<float>(v), topology::ring{}, c, reduce_op::sum, ep);
      }
    });
    for (int r = 0; r < n; ++r) {
      const auto& o = out[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << o.what);
      CHECK(o.took < 1s);
      if (r == bad) {
        CHECK_FALSE(o.code);
        CHECK(o.what == "diverged at step 3");
      } else {
        REQUIRE(o.code);
        CHECK(*o.code == errc::aborted);
        CHECK(o.peer == bad);
        CHECK_THAT(o.what, Catch::Contains("rank " + std::to_string(bad) + " failed") &&
                               Catch::Contains("the epilogue threw: diverged at step 3"));
      }
    }
  }
  SECTION("a mismatch seen by two ranks reaches the ranks that are not their neighbours") {
    const auto out = run(n, [&](inproc_group& g) {
      std::vector<float> v(g.rank() == 1 ? 4097 : 4096, 1.0f);
      codec::fp32 c;
      all_reduce(g, std::span<float>(v), topology::ring{}, c);
    });
    for (int r = 0; r < n; ++r) {
      const auto& o = out[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << o.what);
      REQUIRE(o.code);
      CHECK(o.took < 1s);
      CHECK((*o.code == errc::mismatch || *o.code == errc::aborted));
      CHECK_THAT(o.what, Catch::Contains("element count"));
    }
  }
  SECTION("group::abort outside a collective: the others leave the call they are in") {
    const auto out = run(n, [&](inproc_group& g) {
      std::vector<float> v = v0;
      codec::fp32 c;
      if (g.rank() == 0) {
        g.abort("rank 0 ran out of data");
        return;
      }
      all_reduce(g, std::span<float>(v), topology::ring{}, c);
    });
    for (int r = 1; r < n; ++r) {
      const auto& o = out[static_cast<std::size_t>(r)];
      INFO("rank " << r << ": " << o.what);
      REQUIRE(o.code);
      CHECK(*o.code == errc::aborted);
      CHECK(o.peer == 0);
      CHECK(o.took < 1s);
      CHECK_THAT(o.what, Catch::Contains("rank 0 failed: rank 0 ran out of data"));
    }
  }
}
