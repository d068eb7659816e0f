// transport/poll.hpp: the bounded wait of the polling transports (mpi_p2p and shm wait through it;
// tests/mpi covers them end to end). Here the loop alone: what it calls, in which order, and when.
#include <catch2/catch.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/transport/poll.hpp>

namespace lt = lockstep::transport;
using namespace std::chrono_literals;

TEST_CASE("a request already done is done even with a deadline in the past", "[poll]") {
  int looks = 0, betweens = 0, pauses = 0;
  const bool ok = lt::detail::poll_until(
      lt::clock::now() - 1s, {4, 8}, [&] { return ++looks == 1; }, [&] { ++betweens; },
      [&](lt::clock::time_point) { ++pauses; });
  CHECK(ok);
  CHECK(looks == 1);
  CHECK(betweens == 0);
  CHECK(pauses == 0);
}

TEST_CASE("a past deadline gives up after one look and its checks", "[poll]") {
  int looks = 0, betweens = 0;
  const bool ok = lt::detail::poll_until(
      lt::clock::now() - 1ms, {4, 8}, [&] { return ++looks > 100; }, [&] { ++betweens; },
      [&](lt::clock::time_point) { FAIL("paused after the deadline"); });
  CHECK_FALSE(ok);
  CHECK(looks == 1);
  CHECK(betweens == 1);
}

TEST_CASE("spins, then yields, then pauses; done on the look that finds it", "[poll]") {
  for (const int done_at : {1, 2, 5, 13, 14, 40}) {
    std::vector<std::string> calls;
    int looks = 0;
    const bool ok = lt::detail::poll_until(
        lt::clock::now() + 60s, {3, 10},
        [&] {
          calls.push_back("look");
          return ++looks == done_at;
        },
        [&] { calls.push_back("between"); },
        [&](lt::clock::time_point now) {
          CHECK(now <= lt::clock::now());
          calls.push_back("pause");
        });
    INFO("done at look " << done_at);
    CHECK(ok);
    CHECK(looks == done_at);
    // Every look that found nothing is followed by its checks; pauses start after 3 + 10 looks.
    std::vector<std::string> want;
    for (int k = 1; k < done_at; ++k) {
      want.push_back("look");
      want.push_back("between");
      if (k > 13) want.push_back("pause");
    }
    want.push_back("look");
    CHECK(calls == want);
  }
}

TEST_CASE("the deadline is kept: a wait that never completes ends soon after it", "[poll]") {
  const auto start = lt::clock::now();
  int looks = 0;
  const bool ok = lt::detail::poll_until(
      start + 30ms, {2, 2}, [&] { return ++looks < 0; }, [] {},
      [](lt::clock::time_point) { std::this_thread::sleep_for(1ms); });
  const auto took = lt::clock::now() - start;
  CHECK_FALSE(ok);
  CHECK(took >= 30ms);
  CHECK(took < 2s);
  CHECK(looks > 4);
}

TEST_CASE("a failure found by a look or by the checks between looks goes to the caller", "[poll]") {
  int looks = 0;
  CHECK_THROWS_WITH(lt::detail::poll_until(
                        lt::clock::now() + 60s, {1, 1},
                        [&] {
                          if (++looks == 3) throw std::runtime_error("peer 2 failed");
                          return false;
                        },
                        [] {}, [](lt::clock::time_point) {}),
                    "peer 2 failed");
  CHECK(looks == 3);
  int betweens = 0;
  CHECK_THROWS_WITH(lt::detail::poll_until(
                        lt::clock::now() + 60s, {1, 1}, [] { return false; },
                        [&] {
                          if (++betweens == 2) throw std::runtime_error("aborted");
                        },
                        [](lt::clock::time_point) {}),
                    "aborted");
  CHECK(betweens == 2);
}
