// Tests for lockstep/core/thread_pool.hpp: every task runs exactly once, concurrent and nested
// callers finish, the first exception comes back to the caller.
#include <catch2/catch.hpp>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include <lockstep/core/thread_pool.hpp>

TEST_CASE("parallel_for runs every index exactly once", "[thread_pool]") {
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    lockstep::thread_pool pool(threads);
    CHECK(pool.size() == threads);
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{1000}}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, [&](std::size_t i) { hits[i].fetch_add(1); });
      for (std::size_t i = 0; i < n; ++i) REQUIRE(hits[i].load() == 1);
    }
  }
}

TEST_CASE("several threads share one pool, and a task may call parallel_for again", "[thread_pool]") {
  lockstep::thread_pool pool(3);
  constexpr int callers = 4;
  constexpr std::size_t outer = 16, inner = 50;
  std::vector<std::vector<std::atomic<int>>> hits(callers);
  for (auto& h : hits) h = std::vector<std::atomic<int>>(outer * inner);
  std::vector<std::thread> ts;
  for (int c = 0; c < callers; ++c)
    ts.emplace_back([&, c] {
      for (int rep = 0; rep < 20; ++rep)
        pool.parallel_for(outer, [&](std::size_t i) {
          pool.parallel_for(inner, [&](std::size_t j) { hits[c][i * inner + j].fetch_add(1); });
        });
    });
  for (auto& t : ts) t.join();
  for (auto& h : hits)
    for (auto& x : h) REQUIRE(x.load() == 20);
}

TEST_CASE("the first exception of a task is rethrown after all tasks end", "[thread_pool]") {
  lockstep::thread_pool pool(4);
  std::atomic<int> ran{0};
  CHECK_THROWS_WITH(pool.parallel_for(100,
                                      [&](std::size_t i) {
                                        ran.fetch_add(1);
                                        if (i == 10) throw std::runtime_error("task 10 failed");
                                      }),
                    "task 10 failed");
  CHECK(ran.load() >= 1);
  CHECK(ran.load() <= 100);
  // The pool is still usable afterwards.
  std::atomic<int> after{0};
  pool.parallel_for(64, [&](std::size_t) { after.fetch_add(1); });
  CHECK(after.load() == 64);
}
