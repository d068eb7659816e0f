// lockstep/codec/bf16.hpp: bfloat16 on the wire, round to nearest even.
//
// bf16 keeps fp32's 8-bit exponent and cuts the mantissa to 7 bits, so the range is fp32's and
// the relative error of one value is at most 2^-8 (half an ulp of an 8-bit significand). NaN stays NaN (quiet), +-Inf
// stays +-Inf; finite values too large round to Inf exactly as the hardware converters do.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "../core/config.hpp"
#include "concept.hpp"
#include "elementwise.hpp"

#include "simd.hpp"

namespace lockstep::codec {

// The element math shared by host loops and CUDA kernels.
LOCKSTEP_HD constexpr std::uint16_t bf16_from_bits(std::uint32_t u) noexcept {
  // NaN: keep the sign and the top mantissa bits, force the quiet bit so it cannot round to Inf.
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
}
LOCKSTEP_HD constexpr std::uint32_t bf16_to_bits(std::uint16_t h) noexcept {
  return static_cast<std::uint32_t>(h) << 16;
}

struct bf16 {
  static constexpr bool identity = false;
  static constexpr std::string_view name() noexcept { return "bf16"; }
  constexpr std::uint32_t id() const noexcept { return fingerprint(name(), 0); }
  constexpr std::size_t block() const noexcept { return 1; }
  constexpr std::size_t wire_bytes(std::size_t n) const noexcept { return pad8(n * 2); }
  // Encode outputs from this size on are streamed past the cache (AVX-512 path). Above a
  // collective's segments (1 MiB on the host), whose wire bytes are sent at once and are best
  // left in cache; a 64 MiB buffer encoded whole is not read again soon.
  static constexpr std::size_t nontemporal_bytes = std::size_t{8} << 20;

  // One value on the wire and back: the scalar loops below and the CUDA kernels (device/codec.hpp).
  using element = std::uint16_t;
  LOCKSTEP_HD static constexpr std::uint16_t to_wire(float v) noexcept { return bf16_from_bits(std::bit_cast<std::uint32_t>(v)); }
  LOCKSTEP_HD static constexpr float from_wire(std::uint16_t h) noexcept { return std::bit_cast<float>(bf16_to_bits(h)); }

  void encode(const float* LOCKSTEP_RESTRICT in, std::size_t n, std::byte* out) const noexcept {
    std::uint16_t* LOCKSTEP_RESTRICT h = reinterpret_cast<std::uint16_t*>(out);
    std::size_t i = 0;
#if LOCKSTEP_HOST_AVX512
    // 32 values per turn, the tail (under 32) by masked loads and stores
    const __m512i even = even_words();
    auto turn = [&](std::size_t j) {
      return _mm512_permutex2var_epi16(from_bits16(_mm512_loadu_si512(in + j)), even, from_bits16(_mm512_loadu_si512(in + j + 16)));
    };
    const auto addr = reinterpret_cast<std::uintptr_t>(h);
    if (n * 2 >= nontemporal_bytes && addr % 2 == 0) {
      // A large output goes around the cache: non-temporal stores skip reading every line before
      // it is overwritten (a third of encode's memory traffic), and the output would not stay in
      // cache anyway. Masked stores up to the first 64-byte boundary, then whole lines.
      const std::size_t head = ((64 - addr % 64) % 64) / 2;
      if (head) {
        const __mmask32 m = __mmask32((1u << head) - 1);
        _mm512_mask_storeu_epi16(h, m, _mm512_permutex2var_epi16(from_bits16(_mm512_maskz_loadu_epi32(__mmask16(m), in)), even,
                                                                  from_bits16(_mm512_maskz_loadu_epi32(__mmask16(m >> 16), in + 16))));
        i = head;
      }
      for (; i + 32 <= n; i += 32) _mm512_stream_si512(reinterpret_cast<__m512i*>(h + i), turn(i));
      _mm_sfence();  // the streamed lines are visible before whoever reads the wire is told
    }
    for (; i + 32 <= n; i += 32) _mm512_storeu_si512(h + i, turn(i));
    if (i < n) {
      const __mmask32 m = __mmask32((1u << (n - i)) - 1);
      const __m512i r = _mm512_permutex2var_epi16(from_bits16(_mm512_maskz_loadu_epi32(__mmask16(m), in + i)), even,
                                                  from_bits16(_mm512_maskz_loadu_epi32(__mmask16(m >> 16), in + i + 16)));
      _mm512_mask_storeu_epi16(h + i, m, r);
      i = n;
    }
#endif
    for (; i < n; ++i) h[i] = to_wire(in[i]);
  }
  void decode(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT out) const noexcept { walk<false>(in, n, out); }
  void decode_add(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT acc) const noexcept { walk<true>(in, n, acc); }

 private:
  template <bool Add>
  static void walk(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT out) noexcept {
    const std::uint16_t* LOCKSTEP_RESTRICT h = reinterpret_cast<const std::uint16_t*>(in);
    std::size_t i = 0;
#if LOCKSTEP_HOST_AVX512
    // 16 values per turn, the tail (under 16) by masked loads and stores
    for (; i + 16 <= n; i += 16) {
      __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))), 16));
      if constexpr (Add) v = _mm512_add_ps(_mm512_loadu_ps(out + i), v);
      _mm512_storeu_ps(out + i, v);
    }
    if (i < n) {
      const __mmask16 m = __mmask16((1u << (n - i)) - 1);
      __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, h + i)), 16));
      if constexpr (Add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + i), v);
      _mm512_mask_storeu_ps(out + i, m, v);
      i = n;
    }
#endif
    const decode_elements<bf16> d{h, out, Add};
    for (; i < n; ++i) d(i);
  }

#if LOCKSTEP_HOST_AVX512
  // bf16_from_bits on 16 lanes, in the low 16 bits of each. Not vcvtneps2bf16 (AVX512_BF16): it
  // rounds subnormal inputs to zero (0x00018000 gives 0x0000, bf16_from_bits 0x0002).
  static __m512i from_bits16(__m512i u) noexcept {
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x0040));
  }
  // Word indices 0, 2, 4, ... of two registers: the low halves of 32 lanes, in order.
  static __m512i even_words() noexcept {
    alignas(64) static constexpr auto idx = [] {
      std::array<std::uint16_t, 32> v{};
      for (int i = 0; i < 32; ++i) v[i] = static_cast<std::uint16_t>(2 * i);
      return v;
    }();
    return _mm512_load_si512(idx.data());
  }
#endif

 public:
};

}  // namespace lockstep::codec
