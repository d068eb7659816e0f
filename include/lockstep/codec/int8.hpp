// lockstep/codec/int8.hpp: linear 8-bit quantisation with one absmax scale per block.
//
// code = round_to_nearest_even(127 * x / absmax) as a two's-complement int8 in [-127, 127]; the
// value of a code is code / 127 * absmax (0x80, never written, reads as -127). The step is absmax / 127, so the absolute error of a
// value is at most absmax / 254; small values in a block with a large absmax lose most of their
// digits, which is what the dynamic tree type (dyntree8.hpp) is for.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "../core/config.hpp"
#include "blockwise.hpp"

#include "simd.hpp"

namespace lockstep::codec {

struct linear8_format {
  static constexpr std::string_view name = "int8";

  // The code in the low 8 bits; the clamp is on integers so that host loops vectorise (see
  // dyntree8_format::code). unit is in [-1, 1] up to one rounding of x * (1 / absmax).
  LOCKSTEP_HD static std::uint32_t code(float unit) noexcept {
    std::int32_t q = static_cast<std::int32_t>(rintf(unit * 127.0f));
    q = q > 127 ? 127 : q;
    q = q < -127 ? -127 : q;
    return static_cast<std::uint32_t>(q) & 0xffu;
  }
  LOCKSTEP_HD static std::uint8_t quantize(float unit) noexcept { return static_cast<std::uint8_t>(code(unit)); }

#if LOCKSTEP_HOST_AVX2
  // code() for 8 values: vcvtps2dq rounds as MXCSR says, to nearest even by default, as rintf does.
  static __m256i code8(__m256 unit) noexcept {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(unit, _mm256_set1_ps(127.0f)));
    q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    return _mm256_and_si256(q, _mm256_set1_epi32(0xff));
  }
  // code() of x[i] * inv for 32 values, in order (blockwise's hook).
  static __m256i codes32(const float* x, __m256 inv) noexcept {
    auto c = [&](int j) { return code8(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv)); };
    return narrow_codes(c(0), c(1), c(2), c(3));
  }
#endif
#if LOCKSTEP_HOST_AVX512
  // code() for 64 values x[0..64) * inv in 16-lane registers; the low bytes of the clamped
  // integers, in order, by byte permutes.
  static __m512i codes64(const float* x, __m512 inv) noexcept {
    __m512i q[4];
    for (int j = 0; j < 4; ++j) {
      q[j] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * j), inv), _mm512_set1_ps(127.0f)));
      q[j] = _mm512_min_epi32(_mm512_max_epi32(q[j], _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    }
    return dword_bytes<0>(q[0], q[1], q[2], q[3]);
  }
  // value() of 64 codes, without a table: sign-extend, convert, divide by 127 (the same correctly
  // rounded division as value()).
  static void values64(const std::uint8_t* c, __m512* v) noexcept {
    for (int j = 0; j < 4; ++j) {
      const __m512i i32 = _mm512_max_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j))),
                                           _mm512_set1_epi32(-127));  // 0x80 as -127, as value() does
      v[j] = _mm512_div_ps(_mm512_cvtepi32_ps(i32), _mm512_set1_ps(127.0f));
    }
  }
#endif
  // The encoder never writes 0x80 (-128); a wire that holds it (a faulty peer) decodes it as -127,
  // so that every code stays within the block's absmax and a finite scale gives a finite value.
  LOCKSTEP_HD static float value(std::uint8_t code) noexcept {
    const std::int32_t q = static_cast<std::int8_t>(code);
    return static_cast<float>(q < -127 ? -127 : q) / 127.0f;
  }
};

using int8 = blockwise<linear8_format>;

}  // namespace lockstep::codec
