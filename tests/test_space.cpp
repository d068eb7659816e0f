// core/space.hpp: the host spaces. space::deferred must compute exactly what space::host computes
// (it queues the same functions), and nothing before its stream runs; memory is 64-byte aligned
// and freed behind queued work.
#include <lockstep/codec.hpp>
#include <lockstep/core/space.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <cstring>
#include <random>
#include <vector>

using namespace lockstep;

namespace {
template <class C>
void same_bits(C c) {
  const std::size_t n = 10007;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n), r_host(n, 0.0f), r_def(n, 0.0f);
  for (auto& v : x) v = d(rng);
  std::vector<std::byte> w_host(c.wire_bytes(n)), w_def(c.wire_bytes(n));
  std::vector<float> out_host(n, 1.0f), out_def(n, 1.0f), acc_host(x), acc_def(x);
  space::host h;
  h.encode(c, x.data(), n, w_host.data(), codec::feedback_codec<C> ? r_host.data() : nullptr);
  h.decode(c, w_host.data(), n, out_host.data());
  h.decode_add(c, w_host.data(), n, acc_host.data());
  h.divide(acc_host.data(), n, 3.0f);

  host_stream s;
  space::deferred q(&s);
  q.encode(c, x.data(), n, w_def.data(), codec::feedback_codec<C> ? r_def.data() : nullptr);
  q.decode(c, w_def.data(), n, out_def.data());
  q.decode_add(c, w_def.data(), n, acc_def.data());
  q.divide(acc_def.data(), n, 3.0f);
  REQUIRE(s.synchronize(std::chrono::steady_clock::now() + std::chrono::seconds(30)));
  CHECK(w_host == w_def);
  CHECK(std::memcmp(out_host.data(), out_def.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(acc_host.data(), acc_def.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(r_host.data(), r_def.data(), n * sizeof(float)) == 0);
}
}  // namespace

TEMPLATE_TEST_CASE("space::deferred computes space::host's bits", "[space]", codec::fp32, codec::bf16, codec::int8,
                   codec::dyntree8, codec::error_feedback<codec::dyntree8>) {
  same_bits(TestType{});
}

TEST_CASE("space::deferred does nothing at call time; copies and memory follow the stream", "[space]") {
  host_stream s;
  space::deferred q(&s);
  std::atomic<bool> go{false};
  s.enqueue([&] {
    while (!go.load()) std::this_thread::yield();
  });
  std::vector<float> a(1000, 1.0f), b(1000, 0.0f);
  q.copy(b.data(), a.data(), a.size() * sizeof(float));
  q.divide(b.data(), b.size(), 4.0f);
  auto m = q.allocate(4096);
  CHECK(reinterpret_cast<std::uintptr_t>(m.data()) % 64 == 0);
  std::byte* p = m.data();
  s.enqueue([p] { std::memset(p, 7, 4096); });  // queued work uses the memory ...
  m = space::deferred::memory();                 // ... which is freed behind it, not now
  CHECK(b[0] == 0.0f);
  go = true;
  REQUIRE(s.synchronize(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
  CHECK(b[0] == 0.25f);
  CHECK(b[999] == 0.25f);
}
