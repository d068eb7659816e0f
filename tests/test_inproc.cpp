// The inproc transport: rendezvous sends, borrowed receives, size mismatches, deadlines, abort,
// and split — each with ranks as threads. Catch2 v2 assertions are not thread-safe: the threads
// record what they saw and the main thread asserts after joining them.
#include <lockstep/transport/inproc.hpp>
#include <lockstep/transport/run_inproc.hpp>

#include <catch2/catch.hpp>
#include <chrono>
#include <exception>
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
