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
// [1e-7, 1e-6). The all-zero magnitude is 0; its sign bit is kept, and 0x80 decodes to 0 as well.
// The top magnitude 0x7f (bin [1 - 0.9/64, 1]) decodes to 1 instead of its midpoint, so 0 and
// +-absmax round-trip exactly.
//
// The encoder picks the nearest code, as Dettmers' and bitsandbytes' quantisers do: the code whose
// value (Format::value, an fp32 number) is closest to u; on a tie (u exactly halfway between two
// adjacent values, which happens at 56 of the 127 midpoints) the one of smaller magnitude. Within a
// decade that is the bin u falls in; at a decade edge the top code of the decade below wins up to
// a fifth of a bin above the edge (0.1 .. 0.1028 takes 0.09859, not 0.10703), the top code 1 wins
// only from 1 - 0.75 * 0.9/64 up, and 0 wins below 0.275e-6. docs/codecs.md has the errors.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "../core/config.hpp"
#include "blockwise.hpp"

#include <array>
#include "simd.hpp"

namespace lockstep::codec {

struct dyntree8_format {
  static constexpr std::string_view name = "dyntree8";
  static constexpr float inv_09 = 1.0f / 0.9f;
  static constexpr float eight_ninths = 8.0f / 9.0f;

  // The smallest |u| (as fp32 bits) that takes the upper of two adjacent magnitudes, for the
  // boundaries that do not lie at a bin edge, in ascending order: 0x00|0x01 (0.275e-6), the decade
  // edges 0x01|0x02 (1.9e-6), 0x03|0x04, 0x07|0x08, 0x0f|0x10, 0x1f|0x20, 0x3f|0x40 (0.10281), and
  // the top 0x7e|0x7f (0.98945). Each is the first float above the midpoint of the two values (a
  // tie goes down); tests/test_codec.cpp recomputes them from value().
  static constexpr std::int32_t edge_bits[8] = {0x3493a3b7, 0x35ff0381, 0x37734507, 0x39007358,
                                                0x3a91d14f, 0x3c2d0e57, 0x3dd28f5d, 0x3f7d4cce};

  // |value| of the magnitude bits m (0..127): 0 for 0, 1 for 0x7f, else the midpoint of bin
  // m - 2^top of decade 6 - top, with top the position of the indicator bit. Computed in double
  // with one fma (not a*b+c: host and device compilers must not be free to contract differently)
  // and one product, rounded once to fp32.
  LOCKSTEP_HD static float magnitude_value(std::int32_t m) noexcept {
    // floor(log2(m)) from the exponent of float(m), exact for m < 2^24; m | 1 keeps m = 0 defined
    const std::int32_t top = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(static_cast<float>(m | 1)) >> 23) - 127;
    const std::int32_t k = 6 - top, bins = 1 << top, idx = m - bins;
    const double p10[7] = {1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6};
    const double mid = fma(0.9, (2.0 * idx + 1.0) / (2.0 * bins), 0.1);
    const float v = static_cast<float>(mid * p10[k]);
    return m == 0 ? 0.0f : (m == 0x7f ? 1.0f : v);
  }

  // The code of u = x / absmax in its low 8 bits: the nearest code, ties to the smaller magnitude.
  // estimate() finds it with fp32 arithmetic except within fp32 rounding of a bin edge, and says
  // when; exact() settles those few values (one in 8000), with value()'s own double arithmetic.
  LOCKSTEP_HD static std::uint32_t code(float unit) noexcept {
    const std::uint32_t e = estimate(unit);
    return (e & near_bit) ? exact(unit) : e;
  }

  // The code of unit in the low 8 bits, plus near_bit when unit may lie within fp32 rounding of a
  // bin edge (the low 8 bits are then not to be trusted). Branch-free and free of float
  // comparisons so that host loops vectorise (compilers keep a possibly trapping operation
  // conditional unless told -fno-trapping-math): the decade is a sum of comparisons on the bit
  // patterns with the edges between decades (edge_bits; for non-negative floats integer order is
  // float order), so that the lowest bin of a decade starts a fifth of a bin above 10^-(k+1) and
  // its top bin runs past 10^-k; its power of ten is a product of three selects on the bits of k,
  // the bin count 2^(6-k) an exponent. Then the position
  //   p = 2^(6-k) * (|u| 10^k / 0.9 + 8/9)
  // puts the edge between bins i-1 and i of the decade at p = 2^(6-k) + i, the magnitude of bin i;
  // floor(p) is the magnitude, capped at the decade's top bin (126 for decade 0, whose top
  // boundary is an edge of its own), wherever p is not within eps of an integer. In [128, 256) the
  // low 16 mantissa bits of 128 + p + eps are its fraction shifted by eps = 2^-14, so p is near an
  // integer when they are below 8, 2^-13: the fp32 error of p and the offset of a boundary (the
  // midpoint of two fp32 values) from its bin edge are each under 2^-16 of p.
  static constexpr std::uint32_t near_bit = 0x100;
  LOCKSTEP_HD static std::uint32_t estimate(float unit) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(unit);
    const std::int32_t a = static_cast<std::int32_t>(u & 0x7fffffffu);
    // constants, not the array: device code may not read a host array at run time
    constexpr std::int32_t e0 = edge_bits[0], e1 = edge_bits[1], e2 = edge_bits[2], e3 = edge_bits[3],
                           e4 = edge_bits[4], e5 = edge_bits[5], e6 = edge_bits[6], e7 = edge_bits[7];
    const std::int32_t k = (a < e6) + (a < e5) + (a < e4) + (a < e3) + (a < e2) + (a < e1);
    // 10^k = 5^k * 2^k, both exact: 5^k from the bits of k, 2^k as an exponent.
    const std::int32_t p5i = (1 + 4 * (k & 1)) * (1 + 12 * (k & 2)) * (1 + 156 * (k & 4));
    const float p10 = static_cast<float>(p5i) * std::bit_cast<float>(static_cast<std::uint32_t>(127 + k) << 23);
    const float bins = std::bit_cast<float>(static_cast<std::uint32_t>(133 - k) << 23);  // 2^(6-k)
    const float q = (std::bit_cast<float>(a) * (p10 * inv_09) + eight_ninths) * bins + (128.0f + 0x1p-14f);
    // q < 255.25 below the top edge; the min keeps |u| >= 1 (and Inf, NaN) from the conversion's overflow
    std::int32_t qb = std::bit_cast<std::int32_t>(q);
    qb = qb < 0x437f8000 ? qb : 0x437f8000;  // 255.5
    const std::int32_t cap = (128 >> k) - 1 - (k == 0);
    std::int32_t mag = static_cast<std::int32_t>(std::bit_cast<float>(qb)) - 128;
    mag = mag < cap ? mag : cap;
    const std::int32_t top = a >= e7, some = a >= e0;
    mag = top ? 0x7f : mag;
    mag = some ? mag : 0;
    const std::uint32_t near = ((qb & 0xffff) < 8) & !top & some;
    return static_cast<std::uint32_t>(mag) | ((u >> 31) << 7) | (near << 8);
  }

  // code() the slow way, for any unit: an fp32 estimate finds the one boundary (midpoint of two
  // adjacent values) that can matter, and an exact comparison with it decides. The estimate is
  // estimate()'s p in the decade by the thresholds 10^-1 .. 10^-6: every boundary the decade holds
  // or touches is within half a unit of the integer j = round(p), clamped to 2^(7-k) (the next
  // decade's first magnitude) and to 127: the bin edges at their integers, the lower decade edge
  // at 2^(6-k) + 0.2, the top boundary at 127.25, the zero boundary at p = 1.19 for k = 6. So |u|
  // takes magnitude j - 1 or j, and 2|u| > value(j - 1) + value(j) says which (exact in double:
  // two floats of similar size add without rounding).
  LOCKSTEP_HD static std::uint32_t exact(float unit) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(unit);
    const std::int32_t a = static_cast<std::int32_t>(u & 0x7fffffffu);
    constexpr std::int32_t e1 = 0x3dcccccd, e2 = 0x3c23d70a, e3 = 0x3a83126f,  // 1e-1f .. 1e-3f
        e4 = 0x38d1b717, e5 = 0x3727c5ac, e6 = 0x358637bd;                      // 1e-4f .. 1e-6f
    const std::int32_t k = (a < e1) + (a < e2) + (a < e3) + (a < e4) + (a < e5) + (a < e6);
    const std::int32_t p5i = (1 + 4 * (k & 1)) * (1 + 12 * (k & 2)) * (1 + 156 * (k & 4));
    const float p10 = static_cast<float>(p5i) * std::bit_cast<float>(static_cast<std::uint32_t>(127 + k) << 23);
    const float bins = std::bit_cast<float>(static_cast<std::uint32_t>(133 - k) << 23);  // 2^(6-k)
    const float p = (std::bit_cast<float>(a) * (p10 * inv_09) + eight_ninths) * bins;
    // min on the bits: p >= 0, and |u| > 1 (or Inf, NaN) must not overflow the conversion
    std::int32_t pb = std::bit_cast<std::int32_t>(p);
    pb = pb < 0x42ff0000 ? pb : 0x42ff0000;  // 127.5
    std::int32_t j = static_cast<std::int32_t>(std::bit_cast<float>(pb) + 0.5f);
    const std::int32_t last = (128 >> k) < 127 ? (128 >> k) : 127;
    j = j < last ? j : last;
    const double twice = 2.0 * static_cast<double>(std::bit_cast<float>(a));
    const double sum = static_cast<double>(magnitude_value(j - 1)) + static_cast<double>(magnitude_value(j));
    const std::int32_t mag = j - 1 + (twice > sum);
    return static_cast<std::uint32_t>(mag) | ((u >> 31) << 7);
  }
  LOCKSTEP_HD static std::uint8_t quantize(float unit) noexcept { return static_cast<std::uint8_t>(code(unit)); }

#if LOCKSTEP_HOST_AVX2
  // code() for 32 values x[0..32) * inv at once, in order, the same bits. Per value an fp32
  // position p'' = 128 + p + eps, p from the one linear map of |u| that its table index t selects,
  // whose integer part is 128 + the magnitude (after a cap per t) wherever p is not within eps of
  // an integer, and then exact; the few values that are (8 in 65536, so one call in 250) are
  // recomputed by code(). The table index:
  //   c = (max(|u| >> 16, 13232) - 13232) * 162 >> 16, 0..7: a step function of the top 16 bits of
  //       |u| (exponent and 7 mantissa bits) that steps up between each two of edge_bits (constants
  //       found by search; the sweep of every unit value in tests/test_codec.cpp checks them), so
  //       that edge_bits[c] is the one edge that can lie between |u| and its neighbours in the
  //       list; then
  //   t = c - (|u| < edge_bits[c]): 0 = decade 6 (one code, magnitude 1), 1..6 = decades 5..0,
  //       7 = the top code (from 0.98945 up) or zero (below 0.275e-6, as -1 = 7 mod 8).
  // For decade k, p = 2^(6-k) (|u| 10^k / 0.9 + 8/9) as in code(); the cap (applied to the bytes,
  // 32 at a time) keeps |u| from 10^-k up to the next decade's edge, p in [2^(7-k), 2^(7-k) + 1),
  // in the decade's top bin, and decade 0 below the top edge at magnitude 126. In [128, 256) the
  // low 16 mantissa bits of p'' are its fraction, so "near an integer" is one 16-bit compare;
  // eps = 2^-14 moves the interval to [0, 2^-13): 8 units of 2^-16 (the fp32 error of p and the
  // offset of a boundary from its bin edge are each under 2^-16; tests/test_codec.cpp, which
  // compares every unit value, passes with 4 and fails with 2). Signs: the saturating packs that
  // narrow 32-bit lanes to bytes turn a float's raw bits into 0x80 when negative (and 0..0x7f
  // otherwise), and 128 + magnitude is 0x80 | magnitude. About 67 operations per 32 values, 8 of
  // them table permutes; the bin-midpoint encoder it replaces took 69.
  static constexpr int near_units = 8;  // p'' flagged when its low 16 bits are below this
  static __m256i codes32(const float* x, __m256 inv) noexcept {
    const __m256i edge = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(edge_bits));
    const __m256 slope = table(0), offset = table(1);
    __m256i u[4], t[4], c[4];
    __m256 p[4];
    for (int j = 0; j < 4; ++j) {
      u[j] = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv));
      const __m256i a = _mm256_and_si256(u[j], _mm256_set1_epi32(0x7fffffff));
      const __m256i step = _mm256_mulhi_epu16(_mm256_subs_epu16(_mm256_srli_epi32(a, 16), _mm256_set1_epi32(13232)),
                                              _mm256_set1_epi32(162));
      t[j] = _mm256_add_epi32(step, _mm256_cmpgt_epi32(_mm256_permutevar8x32_epi32(edge, step), a));
      p[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_permutevar8x32_ps(slope, t[j])),
                           _mm256_permutevar8x32_ps(offset, t[j]));
      c[j] = _mm256_cvttps_epi32(p[j]);  // 128 + magnitude, before the cap
    }
    // Bytes in the packs' interleaved order, put in order by one permute at the end. The t of
    // zero (-1) packs to 0 (decade 6, cap 129), harmless for its 128.
    const __m256i m = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    const __m256i tb = _mm256_packus_epi16(_mm256_packus_epi32(t[0], t[1]), _mm256_packus_epi32(t[2], t[3]));
    const __m256i cap = _mm256_shuffle_epi8(
        _mm256_setr_epi8(static_cast<char>(129), static_cast<char>(131), static_cast<char>(135), static_cast<char>(143),
                         static_cast<char>(159), static_cast<char>(191), static_cast<char>(254), static_cast<char>(255),
                         0, 0, 0, 0, 0, 0, 0, 0,
                         static_cast<char>(129), static_cast<char>(131), static_cast<char>(135), static_cast<char>(143),
                         static_cast<char>(159), static_cast<char>(191), static_cast<char>(254), static_cast<char>(255),
                         0, 0, 0, 0, 0, 0, 0, 0),
        tb);
    const __m256i s = _mm256_packs_epi16(_mm256_packs_epi32(u[0], u[1]), _mm256_packs_epi32(u[2], u[3]));
    const __m256i mixed = _mm256_xor_si256(_mm256_min_epu8(m, cap), _mm256_andnot_si256(s, _mm256_set1_epi8(static_cast<char>(0x80))));
    __m256i codes = _mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // the high 16 bits of p'' (0x43xx) never pass; a lane's low 16 bits below near_units do
    const __m256i low = _mm256_min_epu16(_mm256_min_epu16(_mm256_castps_si256(p[0]), _mm256_castps_si256(p[1])),
                                         _mm256_min_epu16(_mm256_castps_si256(p[2]), _mm256_castps_si256(p[3])));
    if (!_mm256_testz_si256(_mm256_subs_epu16(_mm256_set1_epi16(near_units), low), _mm256_set1_epi16(-1))) [[unlikely]]
      codes = near_fixup(x, inv, p, codes);
    return codes;
  }

  // Per table index t: the slope (which = 0) and the offset (which = 1) of p'' in |u|.
  static __m256 table(int which) noexcept {
    constexpr auto slope = [](int k) {
      double p10 = 1;
      for (int i = 0; i < k; ++i) p10 *= 10;
      return static_cast<float>((64 >> k) * p10 / 0.9);
    };
    constexpr auto offset = [](int k) { return static_cast<float>(128.0 + 1.0 / (1 << 14) + (64 >> k) * 8.0 / 9.0); };
    if (which == 0) return _mm256_setr_ps(0.0f, slope(5), slope(4), slope(3), slope(2), slope(1), slope(0), 128.0f);
    return _mm256_setr_ps(129.5f, offset(5), offset(4), offset(3), offset(2), offset(1), offset(0), 128.5f);
  }

  // The rare turn of codes32 with a value near a boundary: those values through code().
  [[gnu::noinline, gnu::cold]] static __m256i near_fixup(const float* x, __m256 inv, const __m256* p, __m256i codes) noexcept {
    alignas(32) std::uint32_t bits[32];
    alignas(32) std::uint8_t out[32];
    for (int j = 0; j < 4; ++j) _mm256_store_ps(reinterpret_cast<float*>(bits + 8 * j), p[j]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), codes);
    const float s = _mm256_cvtss_f32(inv);
    for (int i = 0; i < 32; ++i)
      if ((bits[i] & 0xffffu) < near_units) out[i] = static_cast<std::uint8_t>(code(x[i] * s));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(out));
  }
#endif

#if LOCKSTEP_HOST_AVX512
  // codes32 for 64 values in 16-lane registers: the same index c and t (t from a masked
  // subtract), tables of 16 entries with zero (t = -1 = 15 mod 16) and the top code (t = 7) apart
  // and so capped in fp32 like the decades; the magnitude is then byte 2 of p'' itself (p'' in
  // [128, 256): bits 16..22 are its integer part less 128, bit 23 the exponent's lowest, 0), and
  // the sign byte 3 of u, picked by byte permutes. About 19 operations per 16 values.
  static __m512i codes64(const float* x, __m512 inv) noexcept {
    const __m512i edge = _mm512_broadcast_i32x8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(edge_bits)));
    const __m512 slope = table16(0), offset = table16(1), cap = table16(2);
    __m512i u[4], p[4];
    __mmask32 near = 0;
    for (int j = 0; j < 4; ++j) {
      u[j] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * j), inv));
      const __m512i a = _mm512_and_si512(u[j], _mm512_set1_epi32(0x7fffffff));
      const __m512i step = _mm512_mulhi_epu16(_mm512_subs_epu16(_mm512_srli_epi32(a, 16), _mm512_set1_epi32(13232)),
                                              _mm512_set1_epi32(162));
      const __mmask16 below = _mm512_cmpgt_epi32_mask(_mm512_permutexvar_epi32(step, edge), a);
      const __m512i t = _mm512_mask_sub_epi32(step, below, step, _mm512_set1_epi32(1));
      const __m512 q = _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_permutexvar_ps(t, slope)),
                                     _mm512_permutexvar_ps(t, offset));
      p[j] = _mm512_castps_si512(_mm512_min_ps(q, _mm512_permutexvar_ps(t, cap)));
      near |= _mm512_cmplt_epu16_mask(p[j], _mm512_set1_epi16(near_units));
    }
    const __m512i mag = dword_bytes<2>(p[0], p[1], p[2], p[3]), sign = dword_bytes<3>(u[0], u[1], u[2], u[3]);
    __m512i codes = _mm512_ternarylogic_epi32(mag, sign, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // mag | (sign & 0x80)
    if (near) [[unlikely]] {
      alignas(64) std::uint32_t bits[64];
      alignas(64) std::uint8_t out[64];
      for (int j = 0; j < 4; ++j) _mm512_store_si512(bits + 16 * j, p[j]);
      _mm512_store_si512(out, codes);
      const float s = _mm512_cvtss_f32(inv);
      for (int i = 0; i < 64; ++i)
        if ((bits[i] & 0xffffu) < near_units) out[i] = static_cast<std::uint8_t>(code(x[i] * s));
      codes = _mm512_load_si512(out);
    }
    return codes;
  }

  // table(which) with t = 7 the top code alone, t = 15 (-1) zero, and the caps: the middle of a
  // decade's top bin (126.5 for decade 0, whose top boundary is an edge of its own).
  static __m512 table16(int which) noexcept {
    const __m256 lo = table(which);  // entries 0..6 as codes32's; 7 replaced below
    const __m512 caps = _mm512_setr_ps(129.5f, 131.5f, 135.5f, 143.5f, 159.5f, 191.5f, 254.5f, 255.5f,
                                       0, 0, 0, 0, 0, 0, 0, 128.5f);
    if (which == 2) return caps;
    const __m512 both = _mm512_insertf32x8(_mm512_castps256_ps512(lo), lo, 1);
    // top: p'' = 255.5 for every |u|; zero: 128.5
    return which == 0 ? _mm512_mask_mov_ps(both, 0x8080, _mm512_setzero_ps())
                      : _mm512_mask_mov_ps(both, 0x8080, _mm512_setr_ps(0, 0, 0, 0, 0, 0, 0, 255.5f, 0, 0, 0, 0, 0, 0, 0, 128.5f));
  }

  // The unit values of 64 codes, table()'s bits: the four bytes of |value| looked up by byte
  // permutes of two registers (128 entries, the magnitude), the sign put into the top byte (not
  // for magnitude 0: 0x80 decodes to +0), the bytes interleaved into floats by unpacks, which stay
  // within 128-bit lanes, so the codes are first permuted into the order that makes them come out
  // in order.
  static void values64(const std::uint8_t* c, __m512* v) noexcept {
    struct planes_t {
      alignas(64) std::uint8_t b[4][128];
    };
    static const planes_t planes = [] {
      planes_t t{};
      for (int m = 0; m < 128; ++m) {
        const std::uint32_t bits = std::bit_cast<std::uint32_t>(magnitude_value(m));
        for (int j = 0; j < 4; ++j) t.b[j][m] = static_cast<std::uint8_t>(bits >> (8 * j));
      }
      return t;
    }();
    alignas(64) static constexpr auto order = [] {
      std::array<std::uint8_t, 64> o{};  // byte 16L + 4j + r of a lane-local unpack holds code 16j + 4L + r
      for (int l = 0; l < 4; ++l)
        for (int j = 0; j < 4; ++j)
          for (int r = 0; r < 4; ++r) o[16 * l + 4 * j + r] = static_cast<std::uint8_t>(16 * j + 4 * l + r);
      return o;
    }();
    const __m512i codes = _mm512_permutexvar_epi8(_mm512_load_si512(order.data()), _mm512_loadu_si512(c));
    __m512i b[4];
    for (int j = 0; j < 4; ++j)
      b[j] = _mm512_permutex2var_epi8(_mm512_load_si512(planes.b[j]), codes, _mm512_load_si512(planes.b[j] + 64));
    const __m512i sign = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(codes, _mm512_set1_epi8(0x7f)), codes);
    b[3] = _mm512_ternarylogic_epi32(b[3], sign, _mm512_set1_epi8(static_cast<char>(0x80)), 0x78);  // b3 ^ (sign & 0x80)
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    v[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    v[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    v[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    v[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
  }
#endif

  LOCKSTEP_HD static float value(std::uint8_t code) noexcept {
    const int mag = code & 0x7f;
    if (mag == 0) return 0.0f;
    const float sign = (code & 0x80) ? -1.0f : 1.0f;
    return sign * magnitude_value(mag);
  }
};

using dyntree8 = blockwise<dyntree8_format>;

}  // namespace lockstep::codec
