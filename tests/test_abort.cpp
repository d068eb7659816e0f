// The abort contract in-process (transport/concept.hpp: abort; collective/group.hpp: abort): a
// rank that fails tells every rank of its group, not only its neighbours, and each stops with
// errc::aborted naming the failing rank and its message, long before the group's timeout. The MPI
// transport's version is tests/mpi/fault_inject.cpp (real processes, killed ones too).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <latch>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/transport/run_inproc.hpp"
#include "failing_async.hpp"

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

// Rank `bad` failed on its own with `own` (its exception goes on, not a lockstep::error); every
// other rank was aborted in its name at once, its message relaying `relayed`.
void check_others_aborted(const std::vector<outcome>& out, int bad, const std::string& own, const std::string& relayed) {
  for (int r = 0; r < static_cast<int>(out.size()); ++r) {
    const auto& o = out[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << o.what);
    CHECK(o.took < 1s);
    if (r == bad) {
      CHECK_FALSE(o.code);
      CHECK(o.what == own);
    } else {
      REQUIRE(o.code);
      CHECK(*o.code == errc::aborted);
      CHECK(o.peer == bad);
      CHECK_THAT(o.what, Catch::Contains("rank " + std::to_string(bad) + " failed") && Catch::Contains(relayed));
    }
  }
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
    check_others_aborted(out, bad, "diverged at step 3", "the epilogue threw: diverged at step 3");
  }
  SECTION("a set-up that fails on one rank after the call began (its scratch cannot be allocated)") {
    // The codec's wire_bytes, which sizes the scratch, throws what a failed allocation throws: the
    // failing rank has taken the call's number, so its peers are in the call and must hear of it.
    struct no_memory_on_bad_rank : codec::bf16 {
      bool fail = false;
      std::size_t wire_bytes(std::size_t n) const {
        if (fail) throw std::bad_alloc();
        return codec::bf16::wire_bytes(n);
      }
    };
    const int bad = 1;
    const auto out = run(n, [&](inproc_group& g) {
      std::vector<float> v = v0;
      no_memory_on_bad_rank c;
      for (int i = 0; i < 4; ++i) {
        c.fail = g.rank() == bad && i == 2;
        all_reduce(g, std::span<float>(v), topology::ring{}, c);
      }
    });
    check_others_aborted(out, bad, std::bad_alloc().what(), std::string("the set-up failed: ") + std::bad_alloc().what());
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

// The groups split from one group are a family: a failure in any of them aborts all of them
// (docs/reliability.md, "Every group of a rank"), so a rank waiting in the parent or in a sibling
// group is not left to its timeout. Each rank says which of its groups threw; the failing rank is
// named in that group's numbering (peer(); -1 where it is not a member) and in the parent's.
namespace {

struct family_outcome {
  outcome o;
  std::string where;  // the group whose call threw
  std::vector<int> members;  // that group's ranks, in the parent's numbering
};

// rows: {0,1}, {2,3}, ...; cols: the even ranks and the odd ranks. `fail_in` ("rows" or "cols"):
// where rank `bad` throws (its epilogue, on the first call there); every rank runs rows, cols,
// then the parent, each an all-reduce.
std::vector<family_outcome> run_family(int n, int bad, const std::string& fail_in) {
  std::vector<family_outcome> out(static_cast<std::size_t>(n));
  std::vector<float> v0(4096, 1.0f);
  run_inproc(n, [&](inproc_group& g) {
    auto& f = out[static_cast<std::size_t>(g.rank())];
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> v = v0;
    codec::fp32 c;
    try {
      inproc_group rows = g.split(g.rank() / 2, g.rank()), cols = g.split(g.rank() % 2, g.rank());
      for (auto [name, h] : {std::pair<const char*, inproc_group*>{"rows", &rows}, {"cols", &cols}, {"parent", &g}}) {
        f.where = name;
        f.members.clear();
        for (int r = 0; r < n; ++r)
          if (std::string(name) == "parent" || (std::string(name) == "rows" ? r / 2 == g.rank() / 2 : r % 2 == g.rank() % 2))
            f.members.push_back(r);
        auto ep = [&](std::size_t, std::size_t) {
          if (g.rank() == bad && fail_in == name) throw std::runtime_error("injected fault in " + fail_in);
        };
        all_reduce(*h, std::span<float>(v), topology::ring{}, c, reduce_op::sum, ep);
      }
    } catch (const error& e) {
      f.o.code = e.code();
      f.o.peer = e.peer();
      f.o.what = e.what();
    } catch (const std::exception& e) {
      f.o.what = e.what();
    }
    f.o.took = std::chrono::steady_clock::now() - t0;
  }, group_options{20s});
  return out;
}

}  // namespace

TEST_CASE("a failure in one group of a rank aborts the parent and the sibling groups, naming it", "[abort][split]") {
  const int n = GENERATE(4, 5);
  const std::string fail_in = GENERATE(as<std::string>{}, "rows", "cols");
  const int bad = 1;
  INFO(n << " ranks, rank " << bad << " fails in " << fail_in);
  const auto out = run_family(n, bad, fail_in);
  for (int r = 0; r < n; ++r) {
    const auto& f = out[static_cast<std::size_t>(r)];
    INFO("rank " << r << " (in " << f.where << "): " << f.o.what);
    CHECK(f.o.took < 2s);  // the group timeout is 20 s
    if (r == bad) {
      CHECK(f.where == fail_in);
      CHECK_FALSE(f.o.code);
      CHECK(f.o.what == "injected fault in " + fail_in);
      continue;
    }
    REQUIRE(f.o.code);
    CHECK(*f.o.code == errc::aborted);
    CHECK_THAT(f.o.what, Catch::Contains("injected fault in " + fail_in));
    const auto it = std::find(f.members.begin(), f.members.end(), bad);
    const int here = it == f.members.end() ? -1 : static_cast<int>(it - f.members.begin());
    CHECK(f.o.peer == here);
    if (f.where == fail_in && here >= 0) {
      CHECK_THAT(f.o.what, Catch::Contains("rank " + std::to_string(here) + (here != bad ? " (rank 1 of the parent group)" : "") +
                                           " failed: "));
    } else if (here < 0) {
      CHECK_THAT(f.o.what, Catch::Contains("rank 1 of the parent group failed in another of its groups"));
    } else {
      CHECK_THAT(f.o.what, Catch::Contains("failed in another of its groups") &&
                               Catch::Contains(here == bad ? "rank 1 " : "(rank 1 of the parent group)"));
    }
  }
}

TEST_CASE("a failure in a group split from a split reaches the first group; later splits fail at once", "[abort][split]") {
  const int n = 6;
  std::vector<outcome> out(n);
  std::vector<float> v0(1000, 1.0f);
  run_inproc(n, [&](inproc_group& g) {
    auto& o = out[static_cast<std::size_t>(g.rank())];
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> v = v0;
    codec::fp32 c;
    try {
      inproc_group half = g.split(g.rank() / 3, g.rank());
      inproc_group sub = half.split(half.rank() / 2, half.rank());  // {0,1} {2} {3,4} {5}
      if (g.rank() == 4) {
        sub.abort("rank 4 lost its data loader");
        inproc_group again = g.split(0, g.rank());  // the family has failed: no new group of it
        return;
      }
      if (sub.size() == 1) all_reduce(half, std::span<float>(v), topology::ring{}, c);
      all_reduce(g, std::span<float>(v), topology::ring{}, c);
    } catch (const error& e) {
      o.code = e.code();
      o.peer = e.peer();
      o.what = e.what();
    }
    o.took = std::chrono::steady_clock::now() - t0;
  }, group_options{20s});
  for (int r = 0; r < n; ++r) {
    const auto& o = out[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << o.what);
    REQUIRE(o.code);
    CHECK(*o.code == errc::aborted);
    CHECK(o.took < 2s);
    CHECK_THAT(o.what, Catch::Contains("rank 4 lost its data loader"));
    if (r == 4) CHECK_THAT(o.what, Catch::Contains("split"));
  }
}

namespace {

// NCCL's group on the host: ncclGroupStart / End move a per-thread depth, and a call on an aborted
// communicator throws (lockstep's nccl transport turns its error into an exception) while a group
// is open. `grouped` is inproc with both: its data sends throw once `fail` is set.
thread_local int group_depth = 0;

class grouped {
 public:
  using request = transport::inproc::request;
  static constexpr std::size_t segment_bytes = transport::inproc::segment_bytes;
  static constexpr bool send_completion_means_taken = true;

  grouped(transport::inproc t, bool fail) : t_(std::move(t)), fail_(fail) {}
  int rank() const { return t_.rank(); }
  int size() const { return t_.size(); }
  std::string name() const { return "grouped(" + t_.name() + ")"; }
  void group_begin() { ++group_depth; }
  void group_end() { --group_depth; }
  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    if (fail_ && !(tag & (1u << 24)))  // data, not the collectives' headers (tag bit 24)
      throw error(errc::aborted, "send", rank(), peer, "the communicator was aborted");
    return t_.isend(peer, tag, data, bytes);
  }
  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) { return t_.irecv(peer, tag, data, bytes); }
  bool wait(request& r, transport::clock::time_point deadline) { return t_.wait(r, deadline); }
  template <class F>
  bool consume(request& r, transport::clock::time_point deadline, F&& fn) {
    return t_.consume(r, deadline, std::forward<F>(fn));
  }
  void abort(const std::string& reason) { t_.abort(reason); }

 private:
  transport::inproc t_;
  bool fail_;
};

}  // namespace

// A post that throws between group_begin and group_end (an aborted communicator, a residual's
// allocation that fails) must still close the group: NCCL's depth is per thread, and a group left
// open swallows every later NCCL call of the thread (it was left open, one level more per call).
TEST_CASE("a step whose post throws closes the transport's group", "[abort]") {
  for (int n : {2, 3, 4}) {
    auto world = transport::inproc::make_world(n);
    std::vector<int> depth(static_cast<std::size_t>(n), -1);
    std::vector<std::string> what(static_cast<std::size_t>(n));
    std::mutex m;
    transport::detail::run_ranks(n, *world, [&](int r) {
      group_options o;
      o.timeout = 10s;
      group<grouped> g(grouped(transport::inproc(world, r), r == 0), o);
      std::vector<float> v(4096, 1.0f);
      codec::int8 c;
      try {
        all_reduce(g, std::span<float>(v), topology::ring{}, c);
      } catch (const error& e) {
        std::lock_guard lk(m);
        what[static_cast<std::size_t>(r)] = e.what();
      }
      std::lock_guard lk(m);
      depth[static_cast<std::size_t>(r)] = group_depth;
    });
    CAPTURE(n, what[0]);
    CHECK(what[0].find("the communicator was aborted") != std::string::npos);
    for (int d : depth) CHECK(d == 0);
  }
}

using lockstep::testing::failing_async;

namespace {

// n ranks of failing_async (20 s timeout), rank 0's transport failing once `failed` is set.
// Rank 0's stream is busy (a long kernel, 1.5 s) when body(g, stream, buffer) queues its call;
// the buffers outlive what rank 0's stream still reads (a latch before the groups end).
template <class F>
void run_busy_rank_0(const std::shared_ptr<transport::inproc_deferred::world_type>& world, const std::atomic<bool>& failed, F body) {
  const int n = world->size();
  std::atomic<bool> never{false};
  std::latch all_done(n);
  transport::detail::run_ranks(n, *world, [&](int r) {
    host_stream s(20s);
    {
      group_options o;
      o.timeout = 20s;
      group<failing_async> g(failing_async(transport::inproc_deferred(world, r, &s), r == 0 ? &failed : &never), o);
      std::vector<float> v(4096, 1.0f);
      if (r == 0) s.enqueue([] { std::this_thread::sleep_for(1500ms); });
      body(g, s, v);
      all_done.arrive_and_wait();
    }
    s.synchronize();
  });
}

}  // namespace

// The wait of a stream-ordered call must report the transport's own failure when it happens, by
// its cause, not the group's timeout later; and it must let the stream finish what it holds before
// the error reaches code that frees the buffers (here: the work queued behind the call has run).
TEST_CASE("a stream-ordered wait reports the transport's asynchronous error at once, after draining the stream", "[abort][stream]") {
  const int n = 3;
  auto world = transport::inproc_deferred::make_world(n);
  std::atomic<bool> failed{false}, tail_ran{false};
  std::vector<outcome> out(static_cast<std::size_t>(n));
  bool tail_ran_at_throw = false;
  run_busy_rank_0(world, failed, [&](group<failing_async>& g, host_stream& s, std::vector<float>& v) {
    const int r = g.rank();
    codec::fp32 c;
    auto& mine = out[static_cast<std::size_t>(r)];
    const auto t0 = std::chrono::steady_clock::now();
    try {
      auto req = all_reduce_async(g, std::span<float>(v), topology::ring{}, c);
      if (r == 0) {
        s.enqueue([&] { tail_ran = true; });
        failed = true;
      }
      req.wait();
    } catch (const error& e) {
      mine.code = e.code();
      mine.what = e.what();
      if (r == 0) tail_ran_at_throw = tail_ran.load();
    }
    mine.took = std::chrono::steady_clock::now() - t0;
  });
  INFO("rank 0: " << out[0].what);
  REQUIRE(out[0].code);
  CHECK(*out[0].code == errc::transport);
  CHECK_THAT(out[0].what, Catch::Contains("the connection to rank 1 was closed") && Catch::Contains("on rank 0"));
  CHECK(tail_ran_at_throw);
  for (const auto& o : out) CHECK(o.took < 10s);
}

// wait_for reports the asynchronous error and does no more: no abort, no drain (its caller may
// hold a lock an abort must not run without, and its d bounds it). wait() then does both.
TEST_CASE("a stream-ordered wait_for reports the transport's asynchronous error and leaves the abort to its caller", "[abort][stream]") {
  auto world = transport::inproc_deferred::make_world(2);
  std::atomic<bool> failed{false}, tail_ran{false};
  std::optional<errc> code, then_code;
  bool tail_ran_at_throw = true, aborted_at_throw = true;
  std::chrono::steady_clock::duration took{};
  run_busy_rank_0(world, failed, [&](group<failing_async>& g, host_stream& s, std::vector<float>& v) {
    codec::fp32 c;
    auto req = all_reduce_async(g, std::span<float>(v), topology::ring{}, c);
    if (g.rank() != 0) {
      try {
        req.wait();
      } catch (const error&) {  // rank 0's abort may reach it
      }
      return;
    }
    s.enqueue([&] { tail_ran = true; });
    failed = true;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      req.wait_for(10s);
    } catch (const error& e) {
      code = e.code();
      tail_ran_at_throw = tail_ran.load();
      aborted_at_throw = world->aborted();
    }
    took = std::chrono::steady_clock::now() - t0;
    try {
      req.wait();
    } catch (const error& e) {
      then_code = e.code();
    }
  });
  REQUIRE(code);
  CHECK(*code == errc::transport);
  CHECK(took < 1s);  // not the 1.5 s the stream still holds
  CHECK_FALSE(tail_ran_at_throw);
  CHECK_FALSE(aborted_at_throw);
  REQUIRE(then_code);
  CHECK(*then_code == errc::transport);
  CHECK(world->aborted());
}
