// The inproc transport: rendezvous sends, borrowed receives, size mismatches, deadlines, abort,
// and split — each with ranks as threads. Catch2 v2 assertions are not thread-safe: the threads
// record what they saw and the main thread asserts after joining them.
#include <lockstep/transport/inproc.hpp>
#include <lockstep/transport/run_inproc.hpp>

#include <lockstep/collective.hpp>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace lockstep;
using transport::inproc;
using namespace std::chrono_literals;

namespace {
auto soon(std::chrono::milliseconds d = 5000ms) { return transport::clock::now() + d; }
}  // namespace

TEST_CASE("inproc moves bytes, in order per (peer, tag), and borrows without a copy", "[inproc]") {
  auto w = inproc::make_world(2);
  bool sent1 = false, sent2 = false;  // the sending thread records, the main thread asserts
  std::thread t1([&] {
    inproc a(w, 1);
    int x[3] = {1, 2, 3}, y[3] = {4, 5, 6};
    auto r1 = a.isend(0, 7, x, sizeof x);
    auto r2 = a.isend(0, 7, y, sizeof y);
    sent1 = a.wait(r1, soon());
    sent2 = a.wait(r2, soon());
  });
  inproc b(w, 0);
  int got[3] = {};
  auto r = b.irecv(1, 7, got, sizeof got);
  REQUIRE(b.wait(r, soon()));
  CHECK(got[0] == 1);
  CHECK(got[2] == 3);
  auto v = b.borrow(1, 7, 3 * sizeof(int), soon());
  REQUIRE(v.data);
  CHECK(reinterpret_cast<const int*>(v.data)[1] == 5);
  b.release(v);
  t1.join();
  CHECK(sent1);
  CHECK(sent2);
}

TEST_CASE("inproc reports a size mismatch and a timeout, never truncates or hangs", "[inproc]") {
  auto w = inproc::make_world(2);
  inproc a(w, 0), b(w, 1);
  float x[4] = {};
  auto s = a.isend(1, 1, x, sizeof x);
  float y[2];
  auto r = b.irecv(0, 1, y, sizeof y);
  CHECK_THROWS_WITH(b.wait(r, soon()), Catch::Contains("expected a message of 8 bytes, the peer sent 16"));
  CHECK(a.wait(s, soon()));  // the sender is released even so

  auto r2 = b.irecv(0, 2, y, sizeof y);
  const auto t0 = transport::clock::now();
  CHECK_FALSE(b.wait(r2, soon(50ms)));
  CHECK(transport::clock::now() - t0 < 2s);
  CHECK_THROWS_AS(a.isend(5, 0, x, 4), error);
}

TEST_CASE("inproc abort wakes every waiting rank with the failing rank's message", "[inproc]") {
  auto w = inproc::make_world(3);
  std::string what = "no exception";  // the waiting thread records, the main thread asserts
  std::thread waiter([&] {
    inproc c(w, 2);
    float y;
    auto r = c.irecv(0, 1, &y, sizeof y);
    try {
      c.wait(r, soon(60000ms));
    } catch (const std::exception& e) {
      what = e.what();
    }
  });
  std::this_thread::sleep_for(20ms);
  inproc(w, 1).abort("disk on fire");
  waiter.join();
  CHECK_THAT(what, Catch::Contains("rank 1 failed: disk on fire"));
}

TEST_CASE("run_inproc rethrows the first real failure and releases the others at once", "[inproc]") {
  const auto t0 = transport::clock::now();
  CHECK_THROWS_WITH(run_inproc(4, [](group<inproc>& g) {
                      if (g.rank() == 2) throw std::runtime_error("rank two fails");
                      float y;
                      auto r = g.transport().irecv((g.rank() + 1) % 4, 9, &y, sizeof y);
                      g.transport().wait(r, transport::clock::now() + 60s);
                    }),
                    "rank two fails");
  CHECK(transport::clock::now() - t0 < 10s);
}

TEST_CASE("split makes sub-groups ordered by key then rank", "[inproc][split]") {
  // The ranks record, the main thread asserts.
  std::vector<int> new_rank(6), new_size(6), again_size(6);
  run_inproc(6, [&](group<inproc>& g) {
    auto sub = g.split(g.rank() % 2, -g.rank());  // keys reverse the order
    new_rank[static_cast<std::size_t>(g.rank())] = sub.rank();
    new_size[static_cast<std::size_t>(g.rank())] = sub.size();
    auto again = sub.split(0, 0);  // a second round on the sub-group
    again_size[static_cast<std::size_t>(g.rank())] = again.size();
  });
  CHECK(new_size == std::vector<int>{3, 3, 3, 3, 3, 3});
  CHECK(new_rank == std::vector<int>{2, 2, 1, 1, 0, 0});
  CHECK(again_size == std::vector<int>{3, 3, 3, 3, 3, 3});
}

TEST_CASE("a group's deadline saturates: a timeout of centuries waits, it does not expire at once", "[inproc][group]") {
  // steady_clock's nanoseconds wrap for "now + 1e10 s": every wait would time out at once. Held
  // at a century from now instead, which the clock and Gloo's milliseconds both still count.
  const auto now = transport::clock::now();
  const auto century = now + std::chrono::hours(24 * 36500);
  for (auto d : {deadline_after(std::chrono::milliseconds(std::numeric_limits<long long>::max())),
                 deadline_after(std::chrono::hours(24LL * 365 * 10000)), deadline_after(std::chrono::duration<double>(1e10)),
                 deadline_after(std::chrono::duration<double>(std::numeric_limits<double>::infinity())),
                 deadline_after(std::chrono::duration<double>(std::numeric_limits<double>::quiet_NaN()))}) {
    CHECK(d > century);
    CHECK(d < century + std::chrono::hours(24 * 365));
    // what a layer beneath does with it: the time left, in its own unit, added to its own now
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(d - transport::clock::now());
    CHECK(transport::clock::now() + left > century);
  }
  const auto soon_ = deadline_after(std::chrono::milliseconds(1500));
  CHECK(soon_ > now + 1s);
  CHECK(soon_ < now + 60s);
  for (auto d : {deadline_after(-5s), deadline_after(std::chrono::milliseconds::min()),
                 deadline_after(std::chrono::duration<double>(-1e300)),
                 deadline_after(std::chrono::duration<double>(-std::numeric_limits<double>::infinity()))}) {
    CHECK(d >= now);  // over already: now, not a wrapped time in the future or the far past
    CHECK(d < now + 1s);
  }
  group_options o;
  o.timeout = std::chrono::milliseconds(std::numeric_limits<long long>::max() / 2);
  group<inproc> g(inproc(inproc::make_world(1), 0), o);
  CHECK(g.deadline() > century);
  // Ranks whose every wait has that deadline, and one of them late: the others wait for it.
  std::vector<float> got(3, 0.0f);
  run_inproc(3, [&](group<inproc>& h) {
    if (h.rank() == 2) std::this_thread::sleep_for(50ms);
    std::vector<float> v(1000, static_cast<float>(h.rank() + 1));
    all_reduce(h, std::span<float>(v));
    got[static_cast<std::size_t>(h.rank())] = v[999];
  }, o);
  for (float x : got) CHECK(x == 6.0f);
}

TEST_CASE("a group whose last reference goes with a task its own worker runs is destroyed cleanly", "[inproc][group]") {
  // A completion callback that drops the last reference to its group (lockstep_torch's State,
  // collected from its own hook): the group's state is then destroyed on its own worker thread,
  // which can neither join itself nor take the lock it holds.
  for (int round = 0; round < 20; ++round) {
    auto g = std::make_shared<group<inproc>>(inproc(inproc::make_world(1), 0));
    std::atomic<bool> ran{false};
    std::promise<void> release;
    std::shared_future<void> go = release.get_future().share();
    // Even rounds drop the reference inside the task, odd ones when the finished task is destroyed.
    request r = g->submit([keep = g, &ran, go, inside = round % 2 == 0]() mutable {
      go.wait();
      ran = true;
      if (inside) keep.reset();
    }, "self");
    g.reset();  // from here the queued task holds the only reference
    release.set_value();
    CHECK(r.wait_for(10s));
    CHECK(ran.load());
  }
  // Calls queued behind the one that dropped the last reference never run: they fail, they do
  // not leave their waiters hanging.
  auto g = std::make_shared<group<inproc>>(inproc(inproc::make_world(1), 0));
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  request first = g->submit([keep = g, go]() mutable {
    go.wait();
    keep.reset();
  }, "drops the group");
  request second = g->submit([] {}, "queued behind it");
  g.reset();
  release.set_value();
  CHECK(first.wait_for(10s));
  CHECK_THROWS_WITH(second.wait_for(10s), Catch::Contains("destroyed"));
}
