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

TEST_CASE("space::copy_final: the same bytes by streaming stores, at every alignment and length", "[space][copy]") {
  // Around the streaming threshold, with the head before the first aligned line and the tail
  // after the last full block at every offset; guard bytes either side must stay as they were.
  // space::deferred queues the same copy: its bytes too, once its stream has run.
  const std::size_t t = space::detail::streaming_copy_bytes;
  std::mt19937 rng(7);
  host_stream stream;
  const space::host host;
  const space::deferred def(&stream);
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{63}, t - 1, t, t + 1, t + 63, t + 127,
                                  t + 129, 3 * t + 77}) {
    for (const std::size_t src_off : {std::size_t{0}, std::size_t{1}, std::size_t{17}}) {
      for (const std::size_t dst_off : {std::size_t{0}, std::size_t{3}, std::size_t{32}, std::size_t{63}}) {
        std::vector<std::uint8_t> src(bytes + 128), dst(bytes + 256, 0xA5), dst_def(dst);
        for (auto& b : src) b = static_cast<std::uint8_t>(rng());
        space::copy_final(host, dst.data() + 64 + dst_off, src.data() + src_off, bytes);
        space::copy_final(def, dst_def.data() + 64 + dst_off, src.data() + src_off, bytes);
        stream.synchronize(std::chrono::steady_clock::now() + std::chrono::seconds(60));
        INFO("bytes " << bytes << ", src offset " << src_off << ", dst offset " << dst_off);
        CHECK(std::memcmp(dst.data() + 64 + dst_off, src.data() + src_off, bytes) == 0);
        CHECK(dst_def == dst);
        bool guards = true;
        for (std::size_t i = 0; i < 64 + dst_off; ++i) guards &= dst[i] == 0xA5;
        for (std::size_t i = 64 + dst_off + bytes; i < dst.size(); ++i) guards &= dst[i] == 0xA5;
        CHECK(guards);
      }
    }
  }
}
