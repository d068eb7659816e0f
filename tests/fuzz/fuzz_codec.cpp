// tests/fuzz/fuzz_codec.cpp: decode and decode_add of arbitrary wire bytes, for bf16, int8 and
// dyntree8 at any block size.
//
// Input: [codec selector u8][n u16][block u16][wire bytes ...][accumulator bytes ...]. n shrinks to
// the largest count whose wire_bytes(n) the input holds, and the codec reads exactly that many
// bytes from a buffer of exactly that size (AddressSanitizer sees a read past it). Checked for
// every value: decode equals the wire's value computed here from the layout in the codec's header
// (bf16: the top half of an fp32; blockwise: Format::value(code) * scale), is finite exactly where
// that layout says it must be (a finite scale bounds every value of its block, a NaN scale makes
// the whole block NaN), and decode_add(acc) equals acc + decode, NaN where that sum is NaN.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <lockstep/codec/bf16.hpp>
#include <lockstep/codec/dyntree8.hpp>
#include <lockstep/codec/int8.hpp>

namespace {

[[noreturn]] void fail(const char* codec, std::size_t n, std::size_t block, std::size_t i, const char* what) {
  std::fprintf(stderr, "fuzz_codec: %s n=%zu block=%zu value %zu: %s\n", codec, n, block, i, what);
  std::abort();
}

bool same(float a, float b) { return std::isnan(a) ? std::isnan(b) : std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

// The largest m <= n whose wire image fits `have` bytes (wire_bytes grows with n).
template <class C>
std::size_t fitting(const C& c, std::size_t n, std::size_t have) {
  std::size_t lo = 0, hi = n;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (c.wire_bytes(mid) <= have) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// expect(wire, i): the value the layout gives element i; bound(wire, i): what it must satisfy.
template <class C, class Expect>
void check(const C& c, const char* name, std::size_t n_asked, const std::uint8_t* p, std::size_t size, Expect expect) {
  const std::size_t n = fitting(c, n_asked, size);
  const std::size_t wb = c.wire_bytes(n);
  if (wb % 8 != 0) fail(name, n, c.block(), 0, "wire_bytes is not a multiple of 8");
  // Exactly wb bytes on the heap: new[] aligns them as the executor's scratch is aligned.
  std::unique_ptr<std::byte[]> wire(new std::byte[wb]);
  if (wb) std::memcpy(wire.get(), p, wb);
  p += wb, size -= wb;

  std::vector<float> acc(n);  // the rest of the input, then a fixed pattern with zeros, Inf, NaN
  for (std::size_t i = 0; i < n; ++i) {
    if (4 * i + 4 <= size) std::memcpy(&acc[i], p + 4 * i, 4);
    else acc[i] = static_cast<float>(i % 7) - 3.0f + (i % 11 == 0 ? INFINITY : 0.0f) + (i % 13 == 0 ? NAN : 0.0f);
  }
  std::vector<float> out(n, 12345.0f), sum = acc;
  c.decode(wire.get(), n, out.data());
  c.decode_add(wire.get(), n, sum.data());
  for (std::size_t i = 0; i < n; ++i) {
    expect(wire.get(), n, i, out[i]);
    volatile float want = acc[i] + out[i];  // one rounded fp32 add, as decode_add promises
    if (!same(sum[i], want)) fail(name, n, c.block(), i, "decode_add differs from acc + decode");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  const unsigned which = data[0] % 3;
  const std::size_t n = (std::size_t{data[1]} | std::size_t{data[2]} << 8) % 4097;
  const std::size_t block = std::size_t{data[3]} | std::size_t{data[4]} << 8;  // 0: the codec makes it 1
  data += 5, size -= 5;

  if (which == 0) {
    const lockstep::codec::bf16 c;
    check(c, "bf16", n, data, size, [](const std::byte* w, std::size_t nn, std::size_t i, float got) {
      std::uint16_t h;
      std::memcpy(&h, w + 2 * i, 2);
      const float want = std::bit_cast<float>(std::uint32_t{h} << 16);
      if (!same(got, want)) fail("bf16", nn, 1, i, "decode is not the wire's bf16 value");
      const bool nan_bits = (h & 0x7fffu) > 0x7f80u, inf_bits = (h & 0x7fffu) == 0x7f80u;
      if (std::isnan(got) != nan_bits || std::isinf(got) != inf_bits) fail("bf16", nn, 1, i, "NaN or Inf where the bits say otherwise");
    });
    return 0;
  }
  auto blockwise = [&](auto c, const char* name) {
    using format = typename std::remove_cvref_t<decltype(c)>;
    if (c.block() != (block ? block : 1)) fail(name, 0, block, 0, "block() is not the block asked for");
    check(c, name, n, data, size, [&](const std::byte* w, std::size_t nn, std::size_t i, float got) {
      const std::size_t b = i / c.block(), nb = c.blocks(nn);
      float scale;
      std::memcpy(&scale, w + 4 * b, 4);
      const std::uint8_t code = static_cast<std::uint8_t>(w[4 * nb + i]);
      const float unit = format::table()[code];
      volatile float want = unit * scale;
      if (!same(got, want)) fail(name, nn, c.block(), i, "decode is not value(code) * scale");
      if (std::isnan(scale) && !std::isnan(got)) fail(name, nn, c.block(), i, "a NaN scale gave a number");
      // (Fixed finding, tests/fuzz/crashes/codec-int8-0x80-inf: int8's never-written code 0x80 decoded
      // to -128/127 of the scale, -Inf near FLT_MAX; it now reads as -127.) No code lies outside [-1, 1].
      if (std::fabs(unit) > 1.0f) fail(name, nn, c.block(), i, "value(code) lies outside [-1, 1]");
      if (std::isfinite(scale) && !(std::isfinite(got) && std::fabs(got) <= std::fabs(scale)))
        fail(name, nn, c.block(), i, "a finite scale gave a value beyond it");
      if (std::isinf(scale) && !(std::isnan(got) == (unit == 0.0f))) fail(name, nn, c.block(), i, "an Inf scale: NaN not where value(code) is 0");
    });
  };
  if (which == 1) blockwise(lockstep::codec::int8(block), "int8");
  else blockwise(lockstep::codec::dyntree8(block), "dyntree8");
  return 0;
}
