// lockstep_torch's stream engine (python/lockstep_torch/csrc/stream_engine.hpp), the code that
// reduces CUDA buckets over NCCL, run here over inproc_deferred: every rank's "torch stream" is a
// host_stream, so the ordering a GPU relies on is checked on the CPU.
//  - A bucket written by work still queued on the caller's stream, reduced, then read by work queued
//    after the call: the read sees the host group's all_reduce bits, for every codec, ring and
//    torus2d, 1..4 ranks, a prime count.
//  - Error feedback per bucket index: a bucket that moves between two addresses every step gives
//    the bits of error_feedback on one fixed buffer, step after step; a resized bucket is refused.
//  - Failures: a size mismatch between ranks, and a peer that never calls, end as errors within
//    the group's timeout, never a hang; the failure is sticky, as an aborted communicator is. The
//    transport's asynchronous error (NCCL's) fails the engine at once, and its watcher aborts.
#include <catch2/catch.hpp>

#include <lockstep/transport/inproc_stream.hpp>
#include <lockstep/transport/run_inproc.hpp>

#include "../python/lockstep_torch/csrc/stream_engine.hpp"
#include "failing_async.hpp"

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace ls = lockstep;
using lockstep_torch::codec_kind;
using lockstep_torch::topology_spec;
using deferred_group = ls::group<ls::transport::inproc_deferred>;
using engine = lockstep_torch::stream_engine<deferred_group>;

float value(int rank, std::size_t i, int step) {
  std::uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull ^ (static_cast<std::uint64_t>(rank * 31 + step) + 7) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1p-52 - 1.0) * (1 + static_cast<float>(i % 7));
}

ls::group_options quick(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  ls::group_options o;
  o.timeout = timeout;
  return o;
}

// n ranks of the stream engine, each with a host_stream standing for torch's current stream. The
// streams' own bound on a wait is the group's timeout unless stream_limit says otherwise. An engine
// that failed leaves its streams failed too, as an aborted communicator's would be: their errors
// are then the engine's, already reported.
template <class F>
void run_engines(int n, F&& f, ls::group_options opt = quick(), std::chrono::milliseconds stream_limit = {}) {
  auto world = ls::transport::inproc_deferred::make_world(n);
  const auto limit = stream_limit.count() ? stream_limit : opt.timeout;
  ls::transport::detail::run_ranks(n, *world, [&](int r) {
    ls::host_stream group_stream(limit), torch_stream(limit);
    bool failed = false;
    {
      engine e(std::make_unique<deferred_group>(ls::transport::inproc_deferred(world, r, &group_stream), opt));
      f(e, torch_stream);
      failed = !e.failure().empty();
      try {
        torch_stream.synchronize();
      } catch (...) {
        if (!failed) throw;
      }
    }
    try {
      group_stream.synchronize();
    } catch (...) {
      if (!failed) throw;
    }
  });
}

// What the host group gives: the reference bits, per rank, of `steps` averaging all-reduces.
template <class C>
std::vector<std::vector<std::vector<float>>> host_reference(int n, std::size_t count, const topology_spec& ts, int steps) {
  std::vector<std::vector<std::vector<float>>> out(static_cast<std::size_t>(n));
  ls::run_inproc(n, [&](auto& g) {
    C codec{};
    std::vector<float> buf(count);
    for (int s = 0; s < steps; ++s) {
      for (std::size_t i = 0; i < count; ++i) buf[i] = value(g.rank(), i, s);
      lockstep_torch::with_topology(ts, [&](const auto& topo) { ls::all_reduce(g, buf, topo, codec, ls::reduce_op::average); });
      out[static_cast<std::size_t>(g.rank())].push_back(buf);
    }
  });
  return out;
}

template <class C>
void same_bits_as_host(codec_kind ck, const char* name) {
  constexpr std::size_t count = 1009;
  for (int n = 1; n <= 4; ++n) {
    for (const topology_spec ts : {topology_spec{}, topology_spec{true, 0, 0}}) {
      INFO(name << ", " << n << " ranks, " << (ts.torus ? "torus2d" : "ring"));
      const auto ref = host_reference<C>(n, count, ts, 1);
      std::vector<std::vector<float>> seen(static_cast<std::size_t>(n));
      run_engines(n, [&](engine& e, ls::host_stream& torch) {
        const int r = e.rank();
        std::vector<float> bucket(count, 0.0f), out(count, -1.0f);
        // The backward pass, still queued when the hook runs: the engine must wait for it.
        torch.enqueue([&bucket, r] {
          std::this_thread::sleep_for(std::chrono::milliseconds(3));
          for (std::size_t i = 0; i < bucket.size(); ++i) bucket[i] = value(r, i, 0);
        });
        e.reduce_bucket(bucket, &torch, ck, ts, -1);
        // What torch does next on its stream reads the reduced values.
        torch.enqueue([&bucket, &out] { out = bucket; });
        torch.synchronize();
        e.synchronize();
        seen[static_cast<std::size_t>(r)] = out;
      });
      for (int r = 0; r < n; ++r)
        REQUIRE(std::memcmp(seen[static_cast<std::size_t>(r)].data(), ref[static_cast<std::size_t>(r)][0].data(),
                            count * sizeof(float)) == 0);
    }
  }
}

}  // namespace

TEST_CASE("stream engine: a bucket reduced in the caller's stream order has the host group's bits", "[stream_engine]") {
  same_bits_as_host<ls::codec::fp32>(codec_kind::fp32, "fp32");
  same_bits_as_host<ls::codec::bf16>(codec_kind::bf16, "bf16");
  same_bits_as_host<ls::codec::int8>(codec_kind::int8, "int8");
  same_bits_as_host<ls::codec::dyntree8>(codec_kind::dyntree8, "dyntree8");
}

TEST_CASE("stream engine: all_reduce sums in stream order, exactly on integers", "[stream_engine]") {
  std::vector<std::vector<float>> seen(3);  // (Catch2 asserts on the main thread only)
  run_engines(3, [&](engine& e, ls::host_stream& torch) {
    std::vector<float> x(97);
    torch.enqueue([&x, r = e.rank()] {
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 11) - 5 + r);
    });
    e.all_reduce(x, &torch, codec_kind::fp32, topology_spec{}, ls::reduce_op::sum);
    torch.synchronize();
    seen[static_cast<std::size_t>(e.rank())] = x;
  });
  for (const auto& x : seen)
    for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(x[i] == static_cast<float>(3 * (static_cast<int>(i % 11) - 5) + 3));
}

TEST_CASE("stream engine: error feedback per bucket index follows a bucket that moves", "[stream_engine]") {
  constexpr int n = 3, steps = 5;
  constexpr std::size_t count = 613;
  const topology_spec ts{true, 0, 0};
  // The reference: error_feedback<dyntree8> on one fixed buffer, on the host group.
  const auto ref = host_reference<ls::codec::error_feedback<ls::codec::dyntree8>>(n, count, ts, steps);
  const auto plain = host_reference<ls::codec::dyntree8>(n, count, ts, steps);
  std::vector<std::vector<std::vector<float>>> seen(n);
  std::vector<std::map<int, std::size_t>> kept(n), after_reset(n);
  std::vector<std::string> resized(n);
  run_engines(n, [&](engine& e, ls::host_stream& torch) {
    const int r = e.rank();
    std::vector<float> a(count), b(count);
    auto& mine = seen[static_cast<std::size_t>(r)];
    mine.assign(steps, std::vector<float>(count));
    // No host synchronisation between steps: the residuals move behind work still queued.
    for (int s = 0; s < steps; ++s) {
      std::vector<float>& bucket = s % 2 ? b : a;  // DDP may hand the same bucket at another address
      torch.enqueue([&bucket, r, s] {
        for (std::size_t i = 0; i < bucket.size(); ++i) bucket[i] = value(r, i, s);
      });
      e.reduce_bucket(bucket, &torch, codec_kind::dyntree8, ts, 0);
      torch.enqueue([&bucket, out = &mine[static_cast<std::size_t>(s)]] { *out = bucket; });
    }
    torch.synchronize();
    e.synchronize();
    kept[static_cast<std::size_t>(r)] = e.buckets();
    // A resized bucket: its residuals no longer line up.
    std::vector<float> bigger(count + 1);
    try {
      e.reduce_bucket(bigger, &torch, codec_kind::dyntree8, ts, 0);
      resized[static_cast<std::size_t>(r)] = "reduced";
    } catch (const ls::error& err) {
      resized[static_cast<std::size_t>(r)] = (err.code() == ls::errc::invalid_argument ? "invalid: " : "other: ") +
                                             std::string(err.what());
    }
    e.reset_buckets();
    after_reset[static_cast<std::size_t>(r)] = e.buckets();
  });
  for (int r = 0; r < n; ++r) {
    REQUIRE(kept[static_cast<std::size_t>(r)] == std::map<int, std::size_t>{{0, count}});
    REQUIRE_THAT(resized[static_cast<std::size_t>(r)],
                 Catch::StartsWith("invalid: ") && Catch::Contains("bucket 0 held 613 elements and now holds 614"));
    REQUIRE(after_reset[static_cast<std::size_t>(r)].empty());
  }
  for (int r = 0; r < n; ++r)
    for (int s = 0; s < steps; ++s) {
      INFO("rank " << r << " step " << s);
      const auto& got = seen[static_cast<std::size_t>(r)][static_cast<std::size_t>(s)];
      REQUIRE(std::memcmp(got.data(), ref[static_cast<std::size_t>(r)][static_cast<std::size_t>(s)].data(),
                          count * sizeof(float)) == 0);
      // ... and the residuals did act: from the second step on, the bits differ from plain dyntree8.
      if (s > 0)
        REQUIRE(std::memcmp(got.data(), plain[static_cast<std::size_t>(r)][static_cast<std::size_t>(s)].data(),
                            count * sizeof(float)) != 0);
    }
}

TEST_CASE("stream engine: ranks that disagree on the wire size fail, and the failure sticks", "[stream_engine]") {
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int> failed{0};
  try {
    run_engines(2, [&](engine& e, ls::host_stream& torch) {
      std::vector<float> x(1000, 1.0f);
      try {
        e.reduce_bucket(x, &torch, e.rank() == 0 ? codec_kind::fp32 : codec_kind::int8, topology_spec{}, -1);
        e.synchronize();
      } catch (const ls::error& err) {
        ++failed;
        throw;
      }
    }, quick(std::chrono::milliseconds(2000)));
    FAIL("a codec mismatch went through");
  } catch (const ls::error& err) {
    INFO(err.what());
    REQUIRE((err.code() == ls::errc::mismatch || err.code() == ls::errc::aborted));
  }
  REQUIRE(failed == 2);
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

TEST_CASE("stream engine: a peer that never calls is a timeout, then every call fails at once", "[stream_engine]") {
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<bool> done{false};
  std::string first, second;
  run_engines(2, [&](engine& e, ls::host_stream& torch) {
    if (e.rank() == 1) {  // alive, but never calls
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    std::vector<float> x(256, 1.0f);
    try {
      e.reduce_bucket(x, &torch, codec_kind::dyntree8, topology_spec{}, -1);
      e.synchronize();
    } catch (const ls::error& err) {
      first = err.what();
    }
    try {
      e.reduce_bucket(x, &torch, codec_kind::dyntree8, topology_spec{}, -1);
      e.synchronize();
    } catch (const ls::error& err) {
      second = err.what();
    }
    done = true;
  }, quick(std::chrono::milliseconds(300)));
  INFO(first << "\n" << second);
  REQUIRE_THAT(first, Catch::Contains("rank 0") && Catch::Contains("timeout"));
  REQUIRE(!second.empty());
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

TEST_CASE("stream engine: a stream that stalls past the timeout is aborted by the watcher", "[stream_engine]") {
  // Every rank posts its side at once, but the caller's stream holds the bucket back for longer
  // than the group's timeout (a stalled kernel, a peer's stream that never gets there): only the
  // watcher can see it.
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> first(2), second(2), failure(2);
  run_engines(2, [&](engine& e, ls::host_stream& torch) {
    const auto r = static_cast<std::size_t>(e.rank());
    std::vector<float> x(512, 1.0f);
    torch.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(900)); });
    try {
      e.reduce_bucket(x, &torch, codec_kind::int8, topology_spec{}, -1);  // enqueues: no error yet
      e.synchronize();
    } catch (const ls::error& err) {
      first[r] = err.what();
    }
    try {
      e.reduce_bucket(x, &torch, codec_kind::int8, topology_spec{}, -1);
    } catch (const ls::error& err) {
      second[r] = err.what();
    }
    failure[r] = e.failure();
    torch.synchronize();  // the sleep ends; what ran behind it failed on the aborted group
  }, quick(std::chrono::milliseconds(300)), std::chrono::seconds(20));
  for (std::size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << first[r] << "\n" << second[r]);
    REQUIRE_THAT(first[r], Catch::Contains("did not finish the call within 300 ms"));
    REQUIRE_THAT(second[r], Catch::Contains("an earlier reduction on this engine failed"));
    REQUIRE_THAT(failure[r], Catch::StartsWith("allreduce_hook: "));
  }
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

// The watcher's wait_for reports the transport's asynchronous error and leaves the abort to the
// engine, which takes its call lock for it (request.hpp): the engine fails with the cause, at
// once, and the group is aborted.
TEST_CASE("stream engine: the transport's asynchronous error fails the engine, whose watcher aborts the group", "[stream_engine]") {
  using async_group = ls::group<ls::testing::failing_async>;
  auto world = ls::transport::inproc_deferred::make_world(2);
  std::atomic<bool> failed{false}, never{false};
  std::string what;
  bool aborted = false;
  std::chrono::steady_clock::duration took{};
  ls::transport::detail::run_ranks(2, *world, [&](int r) {
    // The bucket outlives the streams: the engine fails before its stream has run the call (as
    // torch's caching allocator reuses a bucket only in the caller's stream order).
    std::vector<float> x(256, 1.0f);
    ls::host_stream group_stream(std::chrono::seconds(20)), torch_stream(std::chrono::seconds(20));
    {
      lockstep_torch::stream_engine<async_group> e(std::make_unique<async_group>(
          ls::testing::failing_async(ls::transport::inproc_deferred(world, r, &group_stream), r == 0 ? &failed : &never), quick()));
      // Rank 0's group stream is busy (a long kernel) when the bucket is queued behind it.
      if (r == 0) group_stream.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); });
      const auto t0 = std::chrono::steady_clock::now();
      try {
        e.reduce_bucket(x, &torch_stream, codec_kind::fp32, topology_spec{}, -1);
        if (r == 0) failed = true;
        e.synchronize();
      } catch (const ls::error& err) {
        if (r == 0) what = err.what();
      }
      if (r == 0) took = std::chrono::steady_clock::now() - t0, aborted = world->aborted();
    }
    try {
      torch_stream.synchronize();
    } catch (...) {  // the engine's failure, reported above
    }
    try {
      group_stream.synchronize();
    } catch (...) {
    }
  });
  CHECK_THAT(what, Catch::Contains("the connection to rank 1 was closed"));
  CHECK(aborted);
  CHECK(took < std::chrono::seconds(10));
}
