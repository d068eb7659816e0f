// Collectives over inproc_device (N ranks on one GPU, one stream each) against the host executor
// over inproc threads, bit for bit, for every topology x codec: both walk the same schedule, add
// in the same order and quantise at the same places, so any difference is a device bug. Also:
// the asynchronous form returns while the GPU is still busy (no host synchronisation inside a
// collective), epilogues cover every element once, and a size mismatch between ranks is an error.
// Catch2 v2 assertions are not thread-safe: rank threads only record, the main thread asserts.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <string>

#include <lockstep/lockstep.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/transport/inproc_device.hpp>

#include "common.hpp"

using namespace lockstep;
using dev_group = group<transport::inproc_device>;

namespace {

std::vector<std::vector<float>> rank_inputs(int ranks, std::size_t n, std::uint32_t seed) {
  std::vector<std::vector<float>> in;
  for (int r = 0; r < ranks; ++r) in.push_back(test::inputs(n, seed + 17 * r, false));
  return in;
}

// kind: 0 all_reduce, 1 reduce_scatter_inplace, 2 all_gather_inplace, 3 broadcast from rank 1.
// `calls` repeats the collective on the same buffers (error feedback carries residuals across).
template <class Topo, class Codec>
void compare(int ranks, const Topo& topo, const Codec& proto, std::size_t n, reduce_op op, int kind = 0, int calls = 1) {
  CAPTURE(ranks, topo.name(), std::string(proto.name()), n, static_cast<int>(op), kind);
  const auto in = rank_inputs(ranks, n, 11);
  std::vector<std::vector<float>> host(ranks), dev(ranks);
  const int root = ranks > 1 ? 1 : 0;

  run_inproc(ranks, [&](group<transport::inproc>& g) {
    Codec c = proto;
    std::vector<float> v;
    for (int k = 0; k < calls; ++k) {
      v = in[g.rank()];
      if (kind == 0) all_reduce(g, std::span<float>(v), topo, c, op);
      if (kind == 1) reduce_scatter_inplace(g, std::span<float>(v), topo, c, op);
      if (kind == 2) all_gather_inplace(g, std::span<float>(v), topo, c);
      if (kind == 3) broadcast(g, std::span<float>(v), root, topo, c);
    }
    host[g.rank()] = v;
  });
  run_inproc_device(ranks, [&](dev_group& g) {
    Codec c = proto;
    device::buffer<float> d(n, g.stream());
    const std::span<float> v(d.data(), n);
    for (int k = 0; k < calls; ++k) {
      if (n) LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(d.data(), in[g.rank()].data(), n * sizeof(float), cudaMemcpyHostToDevice, g.stream()));
      if (kind == 0) all_reduce(g, v, topo, c, op);
      if (kind == 1) reduce_scatter_inplace_async(g, v, topo, c, op).wait();
      if (kind == 2) all_gather_inplace_async(g, v, topo, c).wait();
      if (kind == 3) broadcast(g, v, root, topo, c);
    }
    dev[g.rank()] = test::to_host(d.data(), n, g.stream());
  });

  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    if (kind == 1) {  // only the owned chunk is defined after a reduce-scatter
      const auto [lo, hi] = chunk_range(n, static_cast<std::size_t>(ranks), static_cast<std::size_t>(r));
      CHECK(test::same_bits(std::vector<float>(host[r].begin() + lo, host[r].begin() + hi),
                            std::vector<float>(dev[r].begin() + lo, dev[r].begin() + hi)));
    } else {
      std::size_t at = 0;
      CHECK(test::same_bits(host[r], dev[r], &at));
      CAPTURE(at);
    }
  }
}

template <class Topo>
void every_codec(int ranks, const Topo& topo, std::size_t n, int kind) {
  for (reduce_op op : {reduce_op::sum, reduce_op::average}) {
    if (kind == 2 || kind == 3) {
      if (op == reduce_op::average) continue;
    }
    compare(ranks, topo, codec::fp32{}, n, op, kind);
    compare(ranks, topo, codec::bf16{}, n, op, kind);
    compare(ranks, topo, codec::int8{}, n, op, kind);
    compare(ranks, topo, codec::dyntree8{}, n, op, kind);
    compare(ranks, topo, codec::dyntree8{64}, n, op, kind);
    compare(ranks, topo, codec::error_feedback<codec::dyntree8>{}, n, op, kind, 3);
  }
}

}  // namespace

TEST_CASE("all_reduce on inproc_device equals the host executor, every topology x codec", "[device][collective]") {
  for (std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{10007}, std::size_t{1} << 18}) {
    every_codec(4, topology::ring{}, n, 0);
    every_codec(4, topology::torus2d{}, n, 0);
    every_codec(4, topology::torus2d{4, 1}, n, 0);
  }
  every_codec(1, topology::ring{}, 1000, 0);
  every_codec(3, topology::ring{}, 1000, 0);
  every_codec(6, topology::torus2d{2, 3}, 5000, 0);
}

TEST_CASE("reduce_scatter, all_gather and broadcast on inproc_device equal the host executor", "[device][collective]") {
  for (int kind : {1, 2, 3}) {
    every_codec(4, topology::ring{}, 10007, kind);
    every_codec(4, topology::torus2d{}, 10007, kind);
  }
}

TEST_CASE("an asynchronous all_reduce returns while the GPU is still busy", "[device][collective]") {
  const std::size_t n = 1 << 16;
  const auto in = rank_inputs(4, n, 3);
  std::atomic<int> returned_early{0}, ready_after_wait{0};  // the ranks count, the main thread asserts
  run_inproc_device(4, [&](dev_group& g) {
    auto d = test::to_device(in[g.rank()], g.stream());
    codec::dyntree8 c;
    test::kernels::spin<<<1, 1, 0, g.stream()>>>(200'000'000ull);  // 200 ms of GPU time first
    auto r = all_reduce_async(g, std::span<float>(d.data(), n), topology::ring{}, c);
    if (!r.ready()) ++returned_early;
    r.wait();
    if (r.ready()) ++ready_after_wait;
  });
  CHECK(returned_early == 4);
  CHECK(ready_after_wait == 4);
}

TEST_CASE("the epilogue sees every element of an all_reduce exactly once", "[device][collective]") {
  const std::size_t n = 10007;
  std::mutex m;
  std::vector<std::vector<int>> seen(4, std::vector<int>(n, 0));
  run_inproc_device(4, [&](dev_group& g) {
    device::buffer<float> d(n, g.stream());
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, n * sizeof(float), g.stream()));
    codec::bf16 c;
    all_reduce(g, std::span<float>(d.data(), n), topology::torus2d{}, c, reduce_op::sum,
               [&](std::size_t first, std::size_t count) {
                 std::lock_guard lk(m);
                 for (std::size_t i = first; i < first + count; ++i) ++seen[g.rank()][i];
               });
  });
  for (const auto& v : seen) CHECK(std::count(v.begin(), v.end(), 1) == static_cast<long>(n));
}

TEST_CASE("ranks that disagree about the count fail with a message, not a hang", "[device][collective]") {
  group_options opt;
  opt.timeout = std::chrono::seconds(5);
  try {
    run_inproc_device(4, [&](dev_group& g) {
      const std::size_t n = g.rank() == 2 ? 1001 : 1000;
      device::buffer<float> d(n, g.stream());
      LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, n * sizeof(float), g.stream()));
      codec::fp32 c;
      all_reduce(g, std::span<float>(d.data(), n), topology::ring{}, c);
    }, opt);
    FAIL("no error");
  } catch (const error& e) {
    INFO(e.what());
    CHECK((e.code() == errc::mismatch || e.code() == errc::aborted));
    CHECK(std::string(e.what()).find("all_reduce(ring, fp32)") != std::string::npos);
  }
}
