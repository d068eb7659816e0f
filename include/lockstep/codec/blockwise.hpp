// lockstep/codec/blockwise.hpp: 8-bit codes with one fp32 absmax scale per block of elements.
//
// The wire layout of n values with block size B (nb = ceil(n / B) blocks):
//
//   [ scale[0] ... scale[nb-1] : nb x fp32 little-endian ][ code[0] ... code[n-1] : n x uint8 ][pad to 8]
//
// scale[b] is max |x| over block b. A code is a Format's 8-bit image of x / scale[b] in [-1, 1];
// decoding multiplies Format::value(code) by the scale, in fp32. A block holding a NaN or an Inf
// gets a NaN scale, so every value of that block decodes to NaN: overflow stays visible to the
// loss scaler instead of being clipped into plausible numbers.
//
// A Format provides (as __host__ __device__ element math, shared with the CUDA kernels):
//   Format::name, Format::code(float unit) -> uint32_t (the code in the low 8 bits),
//   Format::quantize(float unit) -> uint8_t, Format::value(uint8_t) -> float, and optionally
//   (host, AVX2) Format::codes32(const float* x, __m256 inv) -> 32 codes of x[i] * inv in order,
//   (host, AVX-512) Format::codes64(const float* x, __m512 inv) -> 64 codes likewise, and
//   Format::values64(const uint8_t* c, __m512* v) -> v[0..4) = value(c[0..64)) in order,
// with value(quantize(+-1)) == +-1 and value(quantize(0)) == 0 so that 0 and +-absmax round-trip
// exactly.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "concept.hpp"
#include "residual.hpp"

#include "simd.hpp"

// How far ahead (bytes) the 8-bit loops ask for the fp32 values they read; 0: they do not ask.
// Whether asking helps is a property of the machine, measured (docs/codecs.md, "Software prefetch"):
// on the AVX2-only EPYC (Zen 3) the hardware prefetcher fell behind the codec loops and 8 KiB
// ahead took int8's roundtrip from 49% to 60% of memcpy at 64 MiB; on the 2-core Intel Xeon
// VM with AVX-512 (GCC: rocketlake) it took dyntree8's from 47..49% to 58..60% (encode 4.9 to 7.6
// GB/s); on the EPYC with AVX-512 (Zen 4) the same requests cost the encoders a third of their
// speed (dyntree8 encode 13.8 against 9.6 GB/s) and decode-add a quarter, on the AVX2 loops as
// much as on the AVX-512 ones. So the default goes by the machine the build targets: none for
// AMD Zen 4 and later (GCC 12 calls a Zen 4 znver3 with AVX-512, which no Zen 3 has; GCC 13
// znver4), 8 KiB ahead elsewhere, with -march=native (the default of the Meson build) the
// machine it runs on. Define it to tune a build for another machine.
#ifndef LOCKSTEP_CODEC_PREFETCH_BYTES
#if defined(__znver4__) || defined(__znver5__) || (defined(__znver3__) && defined(__AVX512F__))
#define LOCKSTEP_CODEC_PREFETCH_BYTES 0
#else
#define LOCKSTEP_CODEC_PREFETCH_BYTES 8192
#endif
#endif

namespace lockstep::codec {

// Whether a block with this absmax carries codes: a finite scale of at least 2^-126 (the smallest
// normal fp32). Below it 1 / scale overflows to Inf, and x * Inf is no unit value (host and device
// would even disagree on its code), so such a block, like an all-zero or non-finite one, is sent
// as zeros. Shared by the host encoder and the CUDA kernels.
LOCKSTEP_HD constexpr bool block_scale_carries(float scale) noexcept {
  return scale >= 1.17549435e-38f && scale <= 3.40282347e+38f;  // false for NaN as well
}

// Above 2^126, 1 / scale is subnormal: it would carry fewer than 24 bits, and where the FPU flushes
// subnormals to zero (FTZ/DAZ: -ffast-math's start-up code, torch.set_flush_denormal, CUDA's
// -ftz=true) it is 0 and the whole block would go out as code 0. Such a block's values and scale are
// first multiplied by scale_step (exact: a power of two in the normal range), so the encoder
// computes x * (1 / absmax) with 1 / absmax rounded to 24 bits, FTZ or not. Shared by the host
// encoder and the CUDA kernels.
inline constexpr float huge_scale = 0x1p126f;
inline constexpr float scale_step = 0x1p-64f;

// A block's scale from its values' magnitudes, shared by blockwise::absmax and the CUDA kernels'
// block reduction: magnitude_bits(x) is |x| as bits (for non-negative floats integer order is float
// order, which vectorises without fast-math and reduces as integers), block_scale(the largest) the
// absmax, NaN when the block holds a NaN or an Inf.
LOCKSTEP_HD constexpr std::uint32_t magnitude_bits(float x) noexcept { return std::bit_cast<std::uint32_t>(x) & 0x7fffffffu; }
LOCKSTEP_HD constexpr float block_scale(std::uint32_t max_bits) noexcept {
  return max_bits >= 0x7f800000u ? std::bit_cast<float>(0x7fc00000u) : std::bit_cast<float>(max_bits);
}

#if LOCKSTEP_HOST_AVX512
// Byte `which` (0..3) of each 32-bit lane of a, b, c, d, as 64 bytes in order: two byte permutes
// of two registers each (VBMI) and an insert.
template <int which>
inline __m512i dword_bytes(__m512i a, __m512i b, __m512i c, __m512i d) noexcept {
  alignas(64) static constexpr auto idx = [] {
    std::array<std::uint8_t, 64> v{};
    for (int i = 0; i < 64; ++i) v[i] = static_cast<std::uint8_t>((4 * i + which) & 127);
    return v;
  }();
  const __m512i pick = _mm512_load_si512(idx.data());
  const __m512i ab = _mm512_permutex2var_epi8(a, pick, b), cd = _mm512_permutex2var_epi8(c, pick, d);
  return _mm512_inserti64x4(ab, _mm512_castsi512_si256(cd), 1);
}
#endif

#if LOCKSTEP_HOST_AVX2
// Four vectors of 8 codes in 32-bit lanes (each 0..255) as 32 bytes in order: two saturating packs
// (lossless for 0..255) and a permute that undoes the packs' lane interleaving.
inline __m256i narrow_codes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) noexcept {
  const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

template <class Format>
class blockwise {
 public:
  // 512 values share a scale: the scale costs 4/512 = 0.78% of the payload (under 1%), and the
  // error is close to Dettmers' blocks of 64 (docs/codecs.md has the measured figures).
  static constexpr std::size_t default_block = 512;
  static constexpr bool identity = false;

  constexpr blockwise() noexcept = default;
  // A block of 0 values is taken as 1. The largest is 2^32 - 1 values (a block as large as a
  // whole tensor, one scale for all, fits): the block is part of id() as 32 bits, so two larger
  // ones could share a fingerprint and a mismatch between ranks would go unseen.
  static constexpr std::size_t max_block = 0xffffffffu;
  constexpr explicit blockwise(std::size_t block) : block_(block ? block : 1) {
    if (block > max_block)
      throw error(errc::invalid_argument, std::string(Format::name), -1, -1,
                  "block of " + std::to_string(block) + " values: at most " + std::to_string(max_block));
  }

  static constexpr std::string_view name() noexcept { return Format::name; }
  constexpr std::uint32_t id() const noexcept {
    return fingerprint(name(), static_cast<std::uint32_t>(block_));
  }
  LOCKSTEP_HD constexpr std::size_t block() const noexcept { return block_; }
  LOCKSTEP_HD constexpr std::size_t blocks(std::size_t n) const noexcept { return n / block_ + (n % block_ != 0); }
  constexpr std::size_t wire_bytes(std::size_t n) const noexcept {
    return pad8(blocks(n) * sizeof(float) + n);
  }

  // The layout, shared by the host loops and the CUDA kernels: block b of n values is the values
  // [lo, lo + len), and the codes of the n values start after the scales.
  struct extent {
    std::size_t lo, len;
  };
  LOCKSTEP_HD constexpr extent block_span(std::size_t b, std::size_t n) const noexcept {
    return {b * block_, n - b * block_ < block_ ? n - b * block_ : block_};
  }
  LOCKSTEP_HD std::uint8_t* codes(std::byte* wire, std::size_t n) const noexcept {
    return reinterpret_cast<std::uint8_t*>(wire + blocks(n) * sizeof(float));
  }
  LOCKSTEP_HD const std::uint8_t* codes(const std::byte* wire, std::size_t n) const noexcept {
    return reinterpret_cast<const std::uint8_t*>(wire + blocks(n) * sizeof(float));
  }

  void encode(const float* LOCKSTEP_RESTRICT in, std::size_t n, std::byte* out) const noexcept {
    const std::size_t nb = blocks(n);
    std::uint8_t* LOCKSTEP_RESTRICT codes = this->codes(out, n);
    for (std::size_t b = 0; b < nb; ++b) {
      const auto [lo, len] = block_span(b, n);
      prefetch_ahead(in + lo, len);
      const float scale = absmax(in + lo, len);
      std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
      quantize_block(in + lo, len, scale, codes + lo);
    }
  }

  // Error feedback's step (error_feedback.hpp) fused per block: out <- wire(in + residual), then
  // residual <- (in + residual) - decode(out). The sum and its decoded image stay in L1, one block
  // at a time, where the generic form makes four passes over the whole segment (sum, encode,
  // decode, subtract: about 36 bytes of memory traffic per value against 13 here). The same bits:
  // a block's scale and codes depend on its own values only, the decoded values are decode()'s
  // (decode_block), and the sum and the difference are the same fp32 operations.
  void encode_feedback(const float* LOCKSTEP_RESTRICT in, std::size_t n, std::byte* out,
                       float* LOCKSTEP_RESTRICT residual) const {
    const std::size_t nb = blocks(n);
    std::uint8_t* LOCKSTEP_RESTRICT codes = this->codes(out, n);
    thread_local std::vector<float> sum;  // one block of in + residual
    if (const std::size_t need = std::min(block_, n); sum.size() < need) sum.resize(need);  // a short buffer: not a whole block
    float* LOCKSTEP_RESTRICT v = sum.data();
    for (std::size_t b = 0; b < nb; ++b) {
      const auto [lo, len] = block_span(b, n);
      prefetch_ahead(in + lo, len);
      prefetch_ahead(residual + lo, len);
      for (std::size_t i = 0; i < len; ++i) v[i] = in[lo + i] + residual[lo + i];
      const float scale = absmax(v, len);
      std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
      quantize_block(v, len, scale, codes + lo);
      decode_block<false>(codes + lo, len, scale, residual + lo);
      for (std::size_t i = 0; i < len; ++i) residual[lo + i] = feedback_residual(v[i], residual[lo + i]);
    }
  }

  void decode(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT out) const noexcept {
    walk<false>(in, n, out);
  }
  void decode_add(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT acc) const noexcept {
    walk<true>(in, n, acc);
  }

  // The 256 decoded unit values, built once from Format::value (the same function kernels use).
  static const std::array<float, 256>& table() noexcept {
    static const std::array<float, 256> t = [] {
      std::array<float, 256> v{};
      for (int c = 0; c < 256; ++c) v[c] = Format::value(static_cast<std::uint8_t>(c));
      return v;
    }();
    return t;
  }

  // max |x| of a block; NaN when the block holds a NaN or an Inf (on the bit patterns, as above).
  static float absmax(const float* LOCKSTEP_RESTRICT x, std::size_t n) noexcept {
    std::uint32_t m = 0;
    for (std::size_t i = 0; i < n; ++i) m = std::max(m, magnitude_bits(x[i]));
    return block_scale(m);
  }

  static void quantize_block(const float* LOCKSTEP_RESTRICT x, std::size_t n, float scale,
                             std::uint8_t* LOCKSTEP_RESTRICT codes) noexcept {
    if (!block_scale_carries(scale)) {  // all zero, below 2^-126, or not finite: codes carry nothing
      std::memset(codes, 0, n);
      return;
    }
    if (scale > huge_scale) {  // 1 / scale subnormal: values and scale stepped down first (above)
      constexpr std::size_t tile = 256;
      alignas(64) float down[tile];
      const float inv = 1.0f / (scale * scale_step);
      for (std::size_t lo = 0; lo < n; lo += tile) {
        const std::size_t len = std::min(tile, n - lo);
        for (std::size_t i = 0; i < len; ++i) down[i] = x[lo + i] * scale_step;
        quantize_scaled(down, len, inv, codes + lo);
      }
      return;
    }
    quantize_scaled(x, n, 1.0f / scale, codes);
  }

  // The codes of x[i] * inv (quantize_block's loops, by path).
  static void quantize_scaled(const float* LOCKSTEP_RESTRICT x, std::size_t n, float inv,
                              std::uint8_t* LOCKSTEP_RESTRICT codes) noexcept {
#if LOCKSTEP_HOST_AVX512
    // A format with codes64() (64 codes in input order, the same bits as code()) takes 64 values
    // per turn, the tail through a zero-padded copy by the same code.
    if constexpr (requires(const float* p, __m512 v) { Format::codes64(p, v); }) {
      const __m512 vinv = _mm512_set1_ps(inv);
      std::size_t i = 0;
      for (; i + 64 <= n; i += 64) _mm512_storeu_si512(codes + i, Format::codes64(x + i, vinv));
      if (i < n) {
        alignas(64) float in[64] = {};
        alignas(64) std::uint8_t out[64];
        std::memcpy(in, x + i, (n - i) * sizeof(float));
        _mm512_store_si512(out, Format::codes64(in, vinv));
        std::memcpy(codes + i, out, n - i);
      }
      return;
    }
#endif
#if LOCKSTEP_HOST_AVX2
    // A format with codes32() (32 codes in input order, the same bits as code(); see its header)
    // takes 32 values per turn, the tail through a zero-padded copy by the same code.
    if constexpr (requires(const float* p, __m256 v) { Format::codes32(p, v); }) {
      const __m256 vinv = _mm256_set1_ps(inv);
      std::size_t i = 0;
      for (; i + 32 <= n; i += 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), Format::codes32(x + i, vinv));
      if (i < n) {
        alignas(32) float in[32] = {};
        alignas(32) std::uint8_t out[32];
        std::memcpy(in, x + i, (n - i) * sizeof(float));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out), Format::codes32(in, vinv));
        std::memcpy(codes + i, out, n - i);
      }
      return;
    }
#endif
    quantize_portable(x, n, inv, codes);
  }

  // quantize_block's loop without hand-written SIMD (the one CUDA translation units and
  // LOCKSTEP_NO_SIMD builds take; public so that tests compare it with the others). Codes are
  // computed 32 bits wide, then narrowed: a loop that goes from fp32 straight to bytes does not
  // vectorise with GCC 12, one with equal-width lanes does. A format whose code() settles a few
  // values the slow way (Format::estimate, which flags them with Format::near_bit) gets the
  // vectorisable estimate for all, then code() for the flagged ones.
  static void quantize_portable(const float* LOCKSTEP_RESTRICT x, std::size_t n, float inv,
                                std::uint8_t* LOCKSTEP_RESTRICT codes) noexcept {
    constexpr std::size_t tile = 256;
    std::uint32_t wide[tile];
    for (std::size_t lo = 0; lo < n; lo += tile) {
      const std::size_t len = std::min(tile, n - lo);
      if constexpr (requires(float v) { Format::estimate(v); }) {
        std::uint32_t flagged = 0;
        for (std::size_t i = 0; i < len; ++i) wide[i] = Format::estimate(x[lo + i] * inv);
        for (std::size_t i = 0; i < len; ++i) codes[lo + i] = static_cast<std::uint8_t>(wide[i]), flagged |= wide[i];
        if (flagged & Format::near_bit)
          for (std::size_t i = 0; i < len; ++i)
            if (wide[i] & Format::near_bit) codes[lo + i] = Format::quantize(x[lo + i] * inv);
      } else {
        for (std::size_t i = 0; i < len; ++i) wide[i] = Format::code(x[lo + i] * inv);
        for (std::size_t i = 0; i < len; ++i) codes[lo + i] = static_cast<std::uint8_t>(wide[i]);
      }
    }
  }

 private:
  // Asks for the fp32 values LOCKSTEP_CODEC_PREFETCH_BYTES past [p, p + n), one request per cache
  // line, where that is not 0: on machines whose hardware prefetcher falls behind the 8-bit loops
  // (see the macro). A prefetch past the end of a buffer is harmless (it never faults); without
  // AVX2 this does nothing.
  static void prefetch_ahead([[maybe_unused]] const float* p, [[maybe_unused]] std::size_t n) noexcept {
#if LOCKSTEP_HOST_AVX2
    if constexpr (LOCKSTEP_CODEC_PREFETCH_BYTES > 0) {
      const auto ahead = reinterpret_cast<std::uintptr_t>(p) + LOCKSTEP_CODEC_PREFETCH_BYTES;
      for (std::size_t i = 0; i < n * sizeof(float); i += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + i), _MM_HINT_T0);
    }
#endif
  }

  // out[i] = value, or out[i] += value when Add.
  template <bool Add>
  void walk(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT out) const noexcept {
    const std::size_t nb = blocks(n);
    const std::uint8_t* LOCKSTEP_RESTRICT codes = this->codes(in, n);
    for (std::size_t b = 0; b < nb; ++b) {
      float scale;
      std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
      const auto [lo, len] = block_span(b, n);
      const std::size_t hi = lo + len;
      if constexpr (Add) prefetch_ahead(out + lo, hi - lo);  // the accumulator is read too
      decode_block<Add>(codes + lo, hi - lo, scale, out + lo);
    }
  }

  // One block's values: out[i] = value(codes[i]) * scale, or out[i] += that when Add.
  template <bool Add>
  static void decode_block(const std::uint8_t* LOCKSTEP_RESTRICT codes, std::size_t n, float scale,
                           float* LOCKSTEP_RESTRICT out) noexcept {
#if LOCKSTEP_HOST_AVX512
    // A format with values64() (the unit values of 64 codes, table()'s bits) takes 64 per turn,
    // the tail through a padded copy and masked stores; then value * scale (+ acc), as below.
    if constexpr (requires(const std::uint8_t* c, __m512* v) { Format::values64(c, v); }) {
      const __m512 vs = _mm512_set1_ps(scale);
      for (std::size_t i = 0; i < n; i += 64) {
        const std::size_t len = std::min<std::size_t>(64, n - i);
        alignas(64) std::uint8_t pad[64] = {};
        const std::uint8_t* c = codes + i;
        if (len < 64) c = static_cast<const std::uint8_t*>(std::memcpy(pad, codes + i, len));
        __m512 v[4];
        Format::values64(c, v);
        for (std::size_t j = 0; j < 4 && 16 * j < len; ++j) {
          float* o = out + i + 16 * j;
          __m512 r = _mm512_mul_ps(v[j], vs);
          LOCKSTEP_ROUNDED(r);  // rounded before the sum, whatever -ffp-contract says (core/config.hpp)
          if (len - 16 * j >= 16) {
            if constexpr (Add) r = _mm512_add_ps(_mm512_loadu_ps(o), r);
            _mm512_storeu_ps(o, r);
          } else {
            const __mmask16 m = __mmask16((1u << (len - 16 * j)) - 1);
            if constexpr (Add) r = _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), r);
            _mm512_mask_storeu_ps(o, m, r);
          }
        }
      }
      return;
    }
#endif
#if LOCKSTEP_HOST_AVX2
    // 8 table values per turn by scalar loads (vgatherdps ran at about half the speed on machine
    // D: docs/codecs.md), the product rounded where it stands (LOCKSTEP_ROUNDED): the portable
    // loop's fp-contract attribute or pragma is not enough under clang's -ffp-contract=fast,
    // which ignores the pragma and fuses the loop's a*b + c into one fma.
    {
      const float* t = table().data();
      const __m256 vs = _mm256_set1_ps(scale);
      std::size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const std::uint8_t* c = codes + i;
        __m256 r = _mm256_mul_ps(_mm256_setr_ps(t[c[0]], t[c[1]], t[c[2]], t[c[3]], t[c[4]], t[c[5]], t[c[6]], t[c[7]]), vs);
        LOCKSTEP_ROUNDED(r);
        if constexpr (Add) r = _mm256_add_ps(_mm256_loadu_ps(out + i), r);
        _mm256_storeu_ps(out + i, r);
      }
      decode_portable<Add>(t, codes + i, n - i, scale, out + i);
      return;
    }
#endif
    decode_portable<Add>(table().data(), codes, n, scale, out);
  }

  // decode_block's loop without hand-written SIMD: acc + value * scale rounded twice, whatever
  // the build's -ffp-contract (core/config.hpp).
  template <bool Add>
  LOCKSTEP_NO_FP_CONTRACT static void decode_portable(const float* LOCKSTEP_RESTRICT t,
                                                      const std::uint8_t* LOCKSTEP_RESTRICT codes, std::size_t n,
                                                      float scale, float* LOCKSTEP_RESTRICT out) noexcept {
    LOCKSTEP_FP_CONTRACT_OFF
    for (std::size_t i = 0; i < n; ++i) {
      float v = t[codes[i]] * scale;
#if !LOCKSTEP_HAS_NO_FP_CONTRACT || defined(__clang__)
      // clang's -ffp-contract=fast ignores LOCKSTEP_FP_CONTRACT_OFF's pragma, and no macro says
      // that a build has it: the barrier, at the cost of clang vectorising this loop (on AVX2 and
      // AVX-512 only the tails of decode_block come here).
      LOCKSTEP_ROUNDED(v);
#endif
      if constexpr (Add) out[i] += v;
      else out[i] = v;
    }
  }

  std::size_t block_ = default_block;
};

}  // namespace lockstep::codec
