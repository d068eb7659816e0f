// The NCCL transport with one rank (all a single GPU allows: NCCL wants one GPU per rank): a
// grouped send to itself, every codec's all_reduce and broadcast against the host executor, and
// an asynchronous all_reduce that returns while the stream is still busy.
#include <catch2/catch.hpp>

#include <string>

#include <lockstep/lockstep.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/transport/nccl.hpp>

#include "common.hpp"

using namespace lockstep;

namespace {

struct one_rank {
  device::stream s;
  group<transport::nccl> g;
  one_rank() : g(transport::nccl(transport::nccl::communicator::init_all({current()})[0], s.get())) {}
  static int current() {
    int d = 0;
    LOCKSTEP_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
};

template <class Codec>
void compare(group<transport::nccl>& g, Codec proto, std::size_t n, reduce_op op) {
  CAPTURE(std::string(proto.name()), n);
  const auto in = test::inputs(n, 5, false);
  std::vector<float> host;
  run_inproc(1, [&](group<transport::inproc>& hg) {
    Codec c = proto;
    host = in;
    all_reduce(hg, std::span<float>(host), topology::ring{}, c, op);
  });
  Codec c = proto;
  auto d = test::to_device(in, g.stream());
  all_reduce(g, std::span<float>(d.data(), n), topology::ring{}, c, op);
  CHECK(test::same_bits(test::to_host(d.data(), n, g.stream()), host));
}

}  // namespace

TEST_CASE("nccl: a grouped send to itself arrives intact", "[device][nccl]") {
  one_rank r;
  CHECK(r.g.rank() == 0);
  CHECK(r.g.size() == 1);
  std::vector<std::uint8_t> src(1 << 20);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 3);
  auto a = test::to_device(src, r.g.stream());
  device::buffer<std::uint8_t> b(src.size(), r.g.stream());
  auto& t = r.g.transport();
  t.group_begin();
  auto s = t.isend(0, 0, a.data(), src.size());
  auto q = t.irecv(0, 0, b.data(), src.size());
  t.group_end();
  CHECK(t.wait(s, transport::clock::now()));
  CHECK(t.wait(q, transport::clock::now()));
  CHECK(test::to_host(b.data(), src.size(), r.g.stream()) == src);
}

TEST_CASE("nccl: all_reduce of one rank equals the host executor for every codec", "[device][nccl]") {
  one_rank r;
  for (std::size_t n : {std::size_t{0}, std::size_t{1000}, std::size_t{1} << 20})
    for (reduce_op op : {reduce_op::sum, reduce_op::average}) {
      compare(r.g, codec::fp32{}, n, op);
      compare(r.g, codec::bf16{}, n, op);
      compare(r.g, codec::int8{}, n, op);
      compare(r.g, codec::dyntree8{}, n, op);
    }
}

TEST_CASE("nccl: an asynchronous all_reduce returns before the work is done", "[device][nccl]") {
  one_rank r;
  const std::size_t n = 1 << 20;
  auto d = test::to_device(test::inputs(n, 9, false), r.g.stream());
  codec::dyntree8 c;
  test::kernels::spin<<<1, 1, 0, r.g.stream()>>>(200'000'000ull);
  auto q = all_reduce_async(r.g, std::span<float>(d.data(), n), topology::ring{}, c);
  CHECK_FALSE(q.ready());
  q.wait();
  CHECK(q.ready());
}
