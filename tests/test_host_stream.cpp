// core/host_stream.hpp: a CUDA stream's semantics on the CPU — in-order work, events, one stream
// waiting on another's event, sticky errors, bounded waits — which space::deferred and
// inproc_deferred (and so the stream-ordered collective tests) rely on.
#include <lockstep/core/host_stream.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace lockstep;
using namespace std::chrono_literals;

TEST_CASE("work runs in enqueue order, after enqueue returns", "[host_stream]") {
  host_stream s;
  std::atomic<bool> go{false};
  std::vector<int> order;
  s.enqueue([&] {
    while (!go.load()) std::this_thread::yield();
  });
  for (int i = 0; i < 100; ++i) s.enqueue([&, i] { order.push_back(i); });
  CHECK(order.empty());  // nothing behind the held task has run
  go = true;
  REQUIRE(s.synchronize(std::chrono::steady_clock::now() + 10s));
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("an event completes when its stream reaches it; another stream can wait on it", "[host_stream][event]") {
  host_stream a, b;
  std::atomic<bool> go{false};
  std::atomic<int> step{0};
  a.enqueue([&] {
    while (!go.load()) std::this_thread::yield();
    step = 1;
  });
  host_event e;
  e.record(a);
  CHECK_FALSE(e.ready());
  e.wait_on(b);
  int seen = -1;
  b.enqueue([&] { seen = step.load(); });  // must run after a's first task
  std::this_thread::sleep_for(20ms);
  CHECK(seen == -1);
  go = true;
  REQUIRE(b.synchronize(std::chrono::steady_clock::now() + 10s));
  CHECK(seen == 1);
  CHECK(e.ready());
  // A wait enqueued now refers to the last record, which is reached: it does not block.
  e.wait_on(b);
  REQUIRE(b.synchronize(std::chrono::steady_clock::now() + 10s));
}

TEST_CASE("errors are sticky: later work is skipped, events still complete, queries rethrow", "[host_stream][errors]") {
  host_stream s;
  bool later_ran = false;
  s.enqueue([] { throw std::runtime_error("kernel fault"); });
  s.enqueue([&] { later_ran = true; });
  host_event e;
  e.record(s);
  CHECK_THROWS_WITH(s.synchronize(std::chrono::steady_clock::now() + 10s), "kernel fault");
  CHECK_FALSE(later_ran);
  CHECK_THROWS_WITH(e.ready(), "kernel fault");
  CHECK_THROWS_WITH(s.rethrow_if_failed(), "kernel fault");
}

TEST_CASE("a stream waiting for an event that never comes fails after its wait limit", "[host_stream][errors]") {
  host_stream a(100ms), b(100ms);
  std::atomic<bool> release{false};
  a.enqueue([&] {
    while (!release.load()) std::this_thread::yield();
  });
  host_event e;
  e.record(a);
  e.wait_on(b);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(b.synchronize(t0 + 10s), Catch::Contains("waited 100 ms for an event of another stream"));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  release = true;
}

TEST_CASE("synchronize reports a deadline that passes first", "[host_stream]") {
  host_stream s;
  std::atomic<bool> go{false};
  s.enqueue([&] {
    while (!go.load()) std::this_thread::yield();
  });
  CHECK_FALSE(s.synchronize(std::chrono::steady_clock::now() + 20ms));
  go = true;
  CHECK(s.synchronize(std::chrono::steady_clock::now() + 10s));
}

TEST_CASE("a weak reference runs its work behind the stream while it lives, at once after", "[host_stream]") {
  bool ran = false;
  host_stream::weak_ref w;
  {
    host_stream s;
    w = s.weak();
    std::atomic<bool> go{false};
    s.enqueue([&] {
      while (!go.load()) std::this_thread::yield();
    });
    w.enqueue_or_run([&] { ran = true; });
    CHECK_FALSE(ran);  // queued behind the held task
    go = true;
  }  // the destructor drains the queue
  CHECK(ran);
  bool now = false;
  w.enqueue_or_run([&] { now = true; });  // the stream is gone: runs here
  CHECK(now);
}
