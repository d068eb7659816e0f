// lockstep/codec/dyntree8.hpp: Dettmers' dynamic tree 8-bit type, one absmax scale per block.
//
// One byte per value, applied to u = x / absmax in [-1, 1]:
//
//   bit 7      sign
//   bits 6..0  k leading zeros (k = 0..6) = the decade: |u| in [10^-(k+1), 10^-k)
//              then an indicator 1
//              then 6-k bits: the index of a linear bin of [0.1, 1)
//
// For decade k the 2^(6-k) bins are the intervals of linspace(0.1, 1, 2^(6-k)+1), and a code
// decodes to its bin's midpoint times 10^-k: 64 values in [0.1, 1), 32 in [0.01, 0.1), ... one in
// [1e-7, 1e-6). The all-zero magnitude is 0 (|u| below about 1e-7 encodes to it); its sign bit is
// kept, and 0x80 decodes to 0 as well. Exactness at the ends: the top magnitude 0x7f (bin [1 - 0.9/64, 1]) decodes to 1
// instead of its midpoint, so 0 and +-absmax round-trip exactly; see docs/codecs.md for the errors.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "../core/config.hpp"
#include "blockwise.hpp"

#if LOCKSTEP_HOST_AVX2
#include <immintrin.h>
#endif

namespace lockstep::codec {

struct dyntree8_format {
  static constexpr std::string_view name = "dyntree8";
  static constexpr float inv_09 = 1.0f / 0.9f;
  static constexpr float eight_ninths = 8.0f / 9.0f;
  static constexpr std::int32_t below_two = 0x3fffffff;  // the largest float below 2

  // The code of u = x / absmax in its low 8 bits. Branch-free and free of float comparisons so
  // that host loops vectorise: the decade is a sum of comparisons on the bit patterns (for
  // non-negative floats integer order is float order), its power of ten a product of three
  // selects on the bits of k, the bin count 2^(6-k) an exponent. A float compare or a chain of
  // dependent selects would leave a branch in the loop (compilers keep a possibly trapping
  // operation conditional unless told -fno-trapping-math).
  //
  // The magnitude is the indicator bit plus the bin index in one number:
  //   2^(6-k) + floor((|u| 10^k - 0.1) 2^(6-k) / 0.9) = floor(2^(6-k) v), v = |u| 10^k / 0.9 + 8/9,
  // computed as one multiply by the per-decade constant 10^k/0.9 (a table of 7 floats for
  // codes32), one add, and an exact scaling by 2^(6-k). The roundings of those two operations
  // decide the code only within an ulp of a bin edge (a value there may take the neighbouring
  // code, whose midpoint is as close); host, device and codes32 perform the same two.
  // |u| 10^k reaches 1 (v reaches 2) only at the top of a decade, up to rounding: v is capped
  // just below 2 (on its bits, an integer min), which keeps such a value in the top bin of its own
  // decade, 0x7f for k = 0.
  LOCKSTEP_HD static std::uint32_t code(float unit) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(unit);
    // |unit| as bits; signed, since AVX2 compares signed integers in one instruction.
    const std::int32_t a = static_cast<std::int32_t>(u & 0x7fffffffu);
    constexpr std::int32_t e1 = 0x3dcccccd, e2 = 0x3c23d70a, e3 = 0x3a83126f,  // 1e-1f .. 1e-3f
        e4 = 0x38d1b717, e5 = 0x3727c5ac, e6 = 0x358637bd;                      // 1e-4f .. 1e-6f
    const std::int32_t k = (a < e1) + (a < e2) + (a < e3) + (a < e4) + (a < e5) + (a < e6);
    // 10^k = 5^k * 2^k, both exact: 5^k from the bits of k, 2^k as an exponent.
    const std::int32_t p5i = (1 + 4 * (k & 1)) * (1 + 12 * (k & 2)) * (1 + 156 * (k & 4));
    const float p10 = static_cast<float>(p5i) * std::bit_cast<float>(static_cast<std::uint32_t>(127 + k) << 23);
    const float per_decade = p10 * inv_09;  // rounded once, like code8's table entries
    const float v = std::bit_cast<float>(a) * per_decade + eight_ninths;
    std::int32_t vb = std::bit_cast<std::int32_t>(v);
    vb = vb < below_two ? vb : below_two;
    const float bins = std::bit_cast<float>(static_cast<std::uint32_t>(133 - k) << 23);  // 2^(6-k)
    // |u| below about 1e-7 (k = 6, v < 1) gives magnitude 0, with no test of its own.
    const std::int32_t mag = static_cast<std::int32_t>(std::bit_cast<float>(vb) * bins);  // exact product, truncated
    return static_cast<std::uint32_t>(mag) | ((u >> 31) << 7);
  }
  LOCKSTEP_HD static std::uint8_t quantize(float unit) noexcept { return static_cast<std::uint8_t>(code(unit)); }

#if LOCKSTEP_HOST_AVX2
  // code() for 32 values x[0..32) * inv at once, in order, with code()'s rounding operations in
  // code()'s order (so the same bits; tests/test_codec.cpp checks every unit value): the decade
  // from the exponent and one compare, 10^k/0.9 from an 8-entry table by a permute, the scaling by
  // 2^(6-k) as an integer subtract from the exponent (magnitude8). The sign bits need no
  // arithmetic: the saturating packs that narrow 32-bit lanes to bytes turn a float's raw bits into
  // 0x80 when negative (and 0..0x7f otherwise). About 17 operations and two permutes per 8 values
  // (a lane-crossing permute is one cheap operation on Zen 3, four cycles of throughput on Zen 1);
  // the decade from six compares took about 20, GCC's own vectorisation of code() 75.
  static __m256i codes32(const float* x, __m256 inv) noexcept {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving
    __m256i u[4], mag[4];
    for (int j = 0; j < 4; ++j) {
      u[j] = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv));
      mag[j] = magnitude8(u[j]);
    }
    const __m256i m = _mm256_packus_epi16(_mm256_packus_epi32(mag[0], mag[1]), _mm256_packus_epi32(mag[2], mag[3]));
    const __m256i s = _mm256_packs_epi16(_mm256_packs_epi32(u[0], u[1]), _mm256_packs_epi32(u[2], u[3]));
    return _mm256_permutevar8x32_epi32(_mm256_or_si256(m, _mm256_and_si256(s, _mm256_set1_epi8(static_cast<char>(0x80)))), order);
  }

  // The magnitude bits of code() for 8 unit values (given as bits), in 32-bit lanes. The decade
  // from the exponent instead of six compares: a binade [2^e, 2^(e+1)) holds at most one of the
  // thresholds 1e-1 .. 1e-6, so k = (thresholds at or above the binade's top) + (|u| below the
  // next threshold). The first count is floor((126 - E) * log10(2)) for the biased exponent E
  // (as (126 - E) * 77 >> 8, exact for every E the thresholds care about, 0 from E = 127 up by
  // a saturating subtract, capped at 6), the threshold is one permute away. Then as code(), with
  // the scaling by 64 folded into the per-decade constants (exact: powers of two), so that
  // 2^(6-k) becomes 2^-k, a subtract from the exponent field.
  static __m256i magnitude8(__m256i u) noexcept {
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i above = _mm256_mulhi_epu16(_mm256_subs_epu16(_mm256_set1_epi32(126), _mm256_srli_epi32(a, 23)),
                                             _mm256_set1_epi32(77 << 8));
    const __m256i base = _mm256_min_epu32(above, _mm256_set1_epi32(6));
    // threshold base+1 (1e-1 .. 1e-6), or 0 (none) for base 6; cmpgt is -1 where |u| is below it
    const __m256i next = _mm256_setr_epi32(0x3dcccccd, 0x3c23d70a, 0x3a83126f, 0x38d1b717, 0x3727c5ac, 0x358637bd, 0, 0);
    const __m256i k = _mm256_sub_epi32(base, _mm256_cmpgt_epi32(_mm256_permutevar8x32_epi32(next, base), a));
    // code()'s per_decade (10^k exact, times inv_09, rounded once), times 64
    const __m256 per_decade = _mm256_setr_ps(64.0f * (1.0f * inv_09), 64.0f * (10.0f * inv_09), 64.0f * (100.0f * inv_09),
                                             64.0f * (1000.0f * inv_09), 64.0f * (10000.0f * inv_09),
                                             64.0f * (100000.0f * inv_09), 64.0f * (1e6f * inv_09), 0.0f);
    const __m256 v64 = _mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_permutevar8x32_ps(per_decade, k)),
                                     _mm256_set1_ps(64.0f * eight_ninths));
    // min(v, below 2) * 64 * 2^-k, exact (v64 lies in about [57, 128], far from subnormals)
    const __m256i capped = _mm256_min_epi32(_mm256_castps_si256(v64), _mm256_set1_epi32(below_two + (6 << 23)));
    return _mm256_cvttps_epi32(_mm256_castsi256_ps(_mm256_sub_epi32(capped, _mm256_slli_epi32(k, 23))));
  }
#endif

  LOCKSTEP_HD static float value(std::uint8_t code) noexcept {
    const int mag = code & 0x7f;
    if (mag == 0) return 0.0f;
    const float sign = (code & 0x80) ? -1.0f : 1.0f;
    if (mag == 0x7f) return sign;
    int top = 6;  // position of the indicator bit = number of index bits
    while (!((mag >> top) & 1)) --top;
    const int k = 6 - top, bins = 1 << top, idx = mag - bins;
    const double p10[7] = {1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6};
    // fma, not a*b+c: the host and device compilers must not be free to contract differently.
    const double mid = fma(0.9, (2.0 * idx + 1.0) / (2.0 * bins), 0.1);
    return sign * static_cast<float>(mid * p10[k]);
  }
};

using dyntree8 = blockwise<dyntree8_format>;

}  // namespace lockstep::codec
