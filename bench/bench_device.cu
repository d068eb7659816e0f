// lockstep-bench-device: the GPU figures of docs/benchmarks.md, all measured against the
// device-to-device copy bandwidth of the same run (the ceiling every memory-bound kernel shares).
//
//   copy       cudaMemcpyAsync device to device; GB/s counts bytes read + bytes written
//   codec      encode and decode-add of every codec over 64 Mi values (GB/s: fp32 in + wire out,
//              wire in + fp32 read + fp32 written)
//   optim      SGD (momentum 0.9, decay 1e-4, bf16 copy) over ResNet-50's 161 tensors
//              (GB/s: 20 B per parameter + 2 B for the bf16 copy)
//   allreduce  inproc_device, 4 ranks on this GPU, every topology x codec, 64 Mi values per rank;
//              busbw = 2(N-1)/N x 4 B x count / time, NCCL's definition
//   nccl       one rank: a grouped send to itself, and every codec's all_reduce
// A table by default; --json prints one object per line. --quick shrinks the sizes 16x.
// Without a GPU it prints why and exits 77 (skipped).
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/device/codec.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/device/optim.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/transport/inproc_device.hpp>
#if defined(LOCKSTEP_BENCH_NCCL)
#include <lockstep/transport/nccl.hpp>
#endif

#include "resnet50_shapes.hpp"

using namespace lockstep;

namespace {

bool json = false;
double copy_gbs = 0.0;

void emit(const std::string& bench, const std::string& what, const std::string& detail, double bytes, double us) {
  const double gbs = bytes / us / 1e3;
  if (json)
    std::printf("{\"bench\":\"%s\",\"what\":\"%s\",\"detail\":\"%s\",\"bytes\":%.0f,\"time_us\":%.2f,\"gbs\":%.1f,\"copy_gbs\":%.1f,\"of_copy\":%.3f}\n",
                bench.c_str(), what.c_str(), detail.c_str(), bytes, us, gbs, copy_gbs, copy_gbs > 0 ? gbs / copy_gbs : 0.0);
  else
    std::printf("%-10s %-28s %-22s %10.1f us %8.1f GB/s %6.1f%% of copy\n", bench.c_str(), what.c_str(), detail.c_str(), us, gbs,
                copy_gbs > 0 ? 100 * gbs / copy_gbs : 0.0);
  std::fflush(stdout);
}

// Median-free but warm: one untimed call, then `reps` timed back to back between two events.
double time_us(cudaStream_t s, int reps, const std::function<void()>& body) {
  body();
  device::event a(cudaEventDefault), b(cudaEventDefault);
  a.record(s);
  for (int i = 0; i < reps; ++i) body();
  b.record(s);
  LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(b.get()));
  float ms = 0;
  LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return 1e3 * ms / reps;
}

void fill(float* d, std::size_t n, cudaStream_t s) {
  std::vector<float> h(std::min<std::size_t>(n, 1 << 20));
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = std::sin(0.001f * i) * std::ldexp(1.0f, -int(i % 13));
  for (std::size_t at = 0; at < n; at += h.size())
    LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(d + at, h.data(), std::min(h.size(), n - at) * sizeof(float), cudaMemcpyHostToDevice, s));
  LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(s));
}

void bench_copy(std::size_t n) {
  device::stream s;
  device::buffer<float> a(n, s.get()), b(n, s.get());
  fill(a.data(), n, s.get());
  const double us = time_us(s.get(), 20, [&] { LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), n * 4, cudaMemcpyDeviceToDevice, s.get())); });
  copy_gbs = 0;
  emit("copy", "device_to_device", std::to_string(n * 4 >> 20) + " MiB", 2.0 * n * 4, us);
  copy_gbs = 2.0 * n * 4 / us / 1e3;
}

template <class C>
void bench_codec(const C& c, std::size_t n) {
  device::stream s;
  device::buffer<float> x(n, s.get()), acc(n, s.get());
  device::buffer<std::byte> wire(c.wire_bytes(n), s.get());
  fill(x.data(), n, s.get());
  fill(acc.data(), n, s.get());
  const double wb = double(c.wire_bytes(n));
  const std::string name = std::string(c.name()) + (c.block() > 1 ? "/" + std::to_string(c.block()) : "");
  emit("codec", name, "encode", 4.0 * n + wb, time_us(s.get(), 20, [&] { device::cuda_space(s.get()).encode(c, x.data(), n, wire.data(), nullptr); }));
  emit("codec", name, "decode_add", wb + 8.0 * n, time_us(s.get(), 20, [&] { device::cuda_space(s.get()).decode_add(c, wire.data(), n, acc.data()); }));
}

void bench_optim() {
  std::vector<std::size_t> sizes;
  std::vector<bool> exempt;
  for (const auto& t : bench::resnet50_shapes()) {
    sizes.push_back(t.size());
    exempt.push_back(t.exempt);
  }
  const auto ps = optim::param_set::packed(sizes, exempt);
  device::stream s;
  device::param_table table(ps, s.get());
  const std::size_t n = ps.size();
  device::buffer<float> w(n, s.get()), g(n, s.get()), v(n, s.get());
  device::buffer<std::uint16_t> bf(n, s.get());
  fill(w.data(), n, s.get());
  fill(g.data(), n, s.get());
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(v.data(), 0, n * 4, s.get()));
  const optim::sgd opt{0.9f, 1e-4f};
  const std::string detail = std::to_string(ps.tensor_count()) + " tensors " + std::to_string(ps.params()) + " params";
  emit("optim", "sgd_momentum", detail, 20.0 * ps.params(),
       time_us(s.get(), 20, [&] { device::update_async(opt, table, {0.1f, 1.0f}, w.data(), g.data(), v.data(), s.get()); }));
  emit("optim", "sgd_momentum+bf16", detail, 22.0 * ps.params(),
       time_us(s.get(), 20, [&] { device::update_async(opt, table, {0.1f, 1.0f}, w.data(), g.data(), v.data(), s.get(), bf.data()); }));
}

template <class Topo, class C>
void bench_allreduce(const Topo& topo, const C& proto, std::size_t n, int ranks) {
  std::barrier sync(ranks);
  double us = 0;
  const int reps = 5;
  run_inproc_device(ranks, [&](group<transport::inproc_device>& g) {
    C c = proto;
    device::buffer<float> x(n, g.stream());
    fill(x.data(), n, g.stream());
    const std::span<float> v(x.data(), n);
    all_reduce(g, v, topo, c);  // warm: scratch allocated, kernels loaded
    LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(g.stream()));
    sync.arrive_and_wait();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) all_reduce_async(g, v, topo, c);
    LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(g.stream()));
    sync.arrive_and_wait();
    if (g.rank() == 0) us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
  });
  const std::string name = topo.name() + " x " + std::string(proto.name());
  emit("allreduce", name, std::to_string(ranks) + " ranks " + std::to_string(n * 4 >> 20) + " MiB", 2.0 * (ranks - 1) / ranks * 4.0 * n, us);
}

template <class C>
void every_topology(const C& c, std::size_t n) {
  bench_allreduce(topology::ring{}, c, n, 4);
  bench_allreduce(topology::torus2d{}, c, n, 4);
  bench_allreduce(topology::torus2d{4, 1}, c, n, 4);
}

#if defined(LOCKSTEP_BENCH_NCCL)
template <class C>
void bench_nccl_codec(group<transport::nccl>& g, const C& proto, float* x, std::size_t n) {
  C c = proto;
  emit("nccl", "all_reduce 1 rank", std::string(c.name()), 4.0 * n,
       time_us(g.stream(), 10, [&] { all_reduce_async(g, std::span<float>(x, n), topology::ring{}, c); }));
}

void bench_nccl(std::size_t n) {
  int dev = 0;
  LOCKSTEP_CUDA_CHECK(cudaGetDevice(&dev));
  device::stream s;
  group<transport::nccl> g(transport::nccl(transport::nccl::communicator::init_all({dev})[0], s.get()));
  device::buffer<float> a(n, s.get()), b(n, s.get());
  fill(a.data(), n, s.get());
  auto& t = g.transport();
  emit("nccl", "send_to_self", std::to_string(n * 4 >> 20) + " MiB", 2.0 * n * 4, time_us(s.get(), 10, [&] {
         t.group_begin();
         t.isend(0, 0, a.data(), n * 4);
         t.irecv(0, 0, b.data(), n * 4);
         t.group_end();
       }));
  bench_nccl_codec(g, codec::fp32{}, a.data(), n);
  bench_nccl_codec(g, codec::bf16{}, a.data(), n);
  bench_nccl_codec(g, codec::dyntree8{}, a.data(), n);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--json] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (device::device_count() == 0) {
    std::printf("no CUDA device visible: skipped\n");
    return 77;
  }
  try {
    const std::size_t n = (std::size_t{64} << 20) / (quick ? 16 : 1);
    bench_copy(n);
    bench_codec(codec::fp32{}, n);
    bench_codec(codec::bf16{}, n);
    bench_codec(codec::int8{}, n);
    bench_codec(codec::dyntree8{}, n);
    bench_codec(codec::dyntree8{64}, n);
    bench_optim();
    every_topology(codec::fp32{}, n);
    every_topology(codec::bf16{}, n);
    every_topology(codec::int8{}, n);
    every_topology(codec::dyntree8{}, n);
    every_topology(codec::error_feedback<codec::dyntree8>{}, n);
#if defined(LOCKSTEP_BENCH_NCCL)
    bench_nccl(n);
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-bench-device: %s\n", e.what());
    return 1;
  }
  return 0;
}
