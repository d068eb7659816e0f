// transport::counting: the bytes and messages a rank sends, read off the executor's own calls, equal
// what the schedules say: a ring all-reduce of n fp32 values sends 2(N-1)/N * 4n bytes per rank in
// 2(N-1) messages and one header per call; an all_gather_v sends each rank's part N-1 times
// around the ring; int8 sends its wire bytes; split groups count into the same totals.
#include <lockstep/lockstep.hpp>
#include <lockstep/transport/counting.hpp>

#include "thread_safe_catch.hpp"

#include <mutex>
#include <vector>

using namespace lockstep;
using counted = transport::counting<transport::inproc>;

namespace {

template <class F>
std::vector<transport::traffic> run_counted(int n, F&& body) {
  auto world = transport::inproc::make_world(n);
  std::vector<transport::traffic> out(static_cast<std::size_t>(n));
  transport::detail::run_ranks(n, *world, [&](int r) {
    group<counted> g(counted(transport::inproc(world, r)));
    body(g);
    out[static_cast<std::size_t>(r)] = g.transport().sent();
  });
  return out;
}

}  // namespace

TEST_CASE("counting: a ring all-reduce sends what its schedule says", "[counting]") {
  for (int n = 1; n <= 6; ++n) {
    const std::size_t count = 60 * 1024;  // divisible by 1..6: every chunk 4 * count / n bytes
    const auto t = run_counted(n, [&](group<counted>& g) {
      std::vector<float> v(count, 1.0f);
      codec::fp32 c;
      all_reduce(g, std::span<float>(v), topology::ring{}, c);
    });
    for (const auto& r : t) {
      CHECK(r.bytes == (n == 1 ? 0u : 2u * (n - 1) * 4u * count / n));
      CHECK(r.messages == (n == 1 ? 0u : 2u * (n - 1)));  // chunks below the 1 MiB segment
      CHECK(r.header_messages == (n == 1 ? 0u : 1u));
      CHECK(r.header_bytes == r.header_messages * sizeof(detail::wire_header));
    }
  }
}

TEST_CASE("counting: all_gather_v and int8 wire bytes; split groups add to the same totals", "[counting]") {
  const std::vector<std::size_t> counts = {100, 0, 37, 512};
  const auto t = run_counted(4, [&](group<counted>& g) {
    std::vector<float> in(counts[static_cast<std::size_t>(g.rank())], 1.0f), out(649);
    codec::fp32 c;
    all_gather_v(g, std::span<const float>(in), std::span<float>(out), std::span<const std::size_t>(counts), topology::ring{}, c);
  });
  // On a ring every part but the receiver's own reaches each rank from its left neighbour, so
  // rank r forwards every part except the one of its right neighbour.
  for (int r = 0; r < 4; ++r) {
    std::size_t expect = 0;
    for (int k = 0; k < 4; ++k)
      if (k != (r + 1) % 4) expect += 4 * counts[static_cast<std::size_t>(k)];
    CHECK(t[static_cast<std::size_t>(r)].bytes == expect);
  }
  const auto q = run_counted(2, [&](group<counted>& g) {
    std::vector<float> v(4096, 1.0f);
    codec::int8 c;
    all_reduce(g, std::span<float>(v), topology::ring{}, c);
    auto sub = g.split(0, g.rank());
    all_reduce(sub, std::span<float>(v), topology::ring{}, c);
  });
  const codec::int8 c;
  for (const auto& r : q) CHECK(r.bytes == 2 * 2 * c.wire_bytes(2048));
}
