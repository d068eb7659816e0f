// Device codecs against the host codecs, bit for bit: encode (wire bytes), decode, decode_add and
// error feedback's residual, for every codec, for sizes around the block edges and with zero,
// NaN and Inf blocks. The host codecs are tested on their own in tests/test_codec.cpp, so equality
// here carries those tests over to the GPU.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>

#include <lockstep/codec.hpp>
#include <lockstep/device/space.hpp>

#include "common.hpp"

using namespace lockstep;

namespace {

template <class C>
void check_codec(const C& c, std::size_t n, std::uint32_t seed) {
  CAPTURE(std::string(c.name()), c.block(), n);
  device::stream s;
  const std::vector<float> x = test::inputs(n, seed);
  const std::vector<float> acc0 = test::inputs(n, seed + 1, false);
  const std::size_t wb = c.wire_bytes(n);

  std::vector<std::byte> host_wire(wb, std::byte{0});
  c.encode(x.data(), n, host_wire.data());
  std::vector<float> host_dec(n), host_acc = acc0;
  c.decode(host_wire.data(), n, host_dec.data());
  c.decode_add(host_wire.data(), n, host_acc.data());

  auto dx = test::to_device(x, s.get());
  auto dacc = test::to_device(acc0, s.get());
  device::buffer<std::byte> dwire(wb, s.get());
  device::buffer<float> ddec(n, s.get());
  if (wb) LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dwire.data(), 0, wb, s.get()));
  const device::cuda_space on(s.get());
  on.encode(c, dx.data(), n, dwire.data(), nullptr);
  on.decode(c, dwire.data(), n, ddec.data());
  on.decode_add(c, dwire.data(), n, dacc.data());

  const auto wire = test::to_host(dwire.data(), wb, s.get());
  // fp32's message is the values themselves; the padding bytes beyond 4n are not written.
  const std::size_t meaningful = C::identity ? n * sizeof(float) : wb;
  CHECK(std::memcmp(wire.data(), host_wire.data(), meaningful) == 0);
  std::size_t at = 0;
  CHECK(test::same_bits(test::to_host(ddec.data(), n, s.get()), host_dec, &at));
  CHECK(test::same_bits(test::to_host(dacc.data(), n, s.get()), host_acc, &at));
  CAPTURE(at);
}

// Three rounds of encode-with-residual on the same values: wire and residual equal the host's.
template <class C>
void check_feedback(C c, std::size_t n, std::uint32_t seed) {
  CAPTURE(std::string(c.name()), n);
  device::stream s;
  const std::vector<float> x = test::inputs(n, seed, false);
  auto dx = test::to_device(x, s.get());
  device::buffer<float> dres(n, s.get());
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dres.data(), 0, n * sizeof(float), s.get()));
  device::buffer<std::byte> dwire(c.wire_bytes(n), s.get());
  std::vector<std::byte> host_wire(c.wire_bytes(n));
  for (int round = 0; round < 3; ++round) {
    c.encode_with_residual(x.data(), n, host_wire.data(), c.residual(x.data(), n, 0));
    device::cuda_space(s.get()).encode(c, dx.data(), n, dwire.data(), dres.data());
    const auto wire = test::to_host(dwire.data(), c.wire_bytes(n), s.get());
    CHECK(std::memcmp(wire.data(), host_wire.data(), c.wire_bytes(n)) == 0);
    const float* hr = c.residual(x.data(), n, 0);
    CHECK(test::same_bits(test::to_host(dres.data(), n, s.get()), std::vector<float>(hr, hr + n)));
  }
}

const std::size_t sizes[] = {0, 1, 511, 512, 513, 4099, 100003, 1 << 20};

}  // namespace

TEST_CASE("fp32 and bf16 kernels equal the host codecs", "[device][codec]") {
  for (std::size_t n : sizes) {
    check_codec(codec::fp32{}, n, 1);
    check_codec(codec::bf16{}, n, 2);
  }
}

TEST_CASE("int8 kernels equal the host codec for several block sizes", "[device][codec]") {
  for (std::size_t block : {1, 64, 100, 512, 4096})
    for (std::size_t n : sizes) check_codec(codec::int8{block}, n, 3);
}

TEST_CASE("dyntree8 kernels equal the host codec for several block sizes", "[device][codec]") {
  for (std::size_t block : {1, 64, 100, 512, 4096})
    for (std::size_t n : sizes) check_codec(codec::dyntree8{block}, n, 4);
}

TEST_CASE("error feedback on the device keeps the host's residual", "[device][codec]") {
  for (std::size_t n : {1000, 70000}) {
    check_feedback(codec::error_feedback<codec::dyntree8>{}, n, 5);
    check_feedback(codec::error_feedback<codec::int8>{codec::int8{64}}, n, 6);
    check_feedback(codec::error_feedback<codec::bf16>{}, n, 7);
    check_feedback(codec::error_feedback<codec::fp32>{}, n, 8);
  }
}
