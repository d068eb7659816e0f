// lockstep/codec/bf16.hpp: bfloat16 on the wire, round to nearest even.
//
// bf16 keeps fp32's 8-bit exponent and cuts the mantissa to 7 bits, so the range is fp32's and
// the relative error of one value is at most 2^-8 (half an ulp of an 8-bit significand). NaN stays NaN (quiet), +-Inf
// stays +-Inf; finite values too large round to Inf exactly as the hardware converters do.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "../core/config.hpp"
#include "concept.hpp"

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

  void encode(const float* LOCKSTEP_RESTRICT in, std::size_t n, std::byte* out) const noexcept {
    std::uint16_t* LOCKSTEP_RESTRICT h = reinterpret_cast<std::uint16_t*>(out);
    for (std::size_t i = 0; i < n; ++i) h[i] = bf16_from_bits(std::bit_cast<std::uint32_t>(in[i]));
  }
  void decode(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT out) const noexcept {
    const std::uint16_t* LOCKSTEP_RESTRICT h = reinterpret_cast<const std::uint16_t*>(in);
    for (std::size_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(bf16_to_bits(h[i]));
  }
  void decode_add(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT acc) const noexcept {
    const std::uint16_t* LOCKSTEP_RESTRICT h = reinterpret_cast<const std::uint16_t*>(in);
    for (std::size_t i = 0; i < n; ++i) acc[i] += std::bit_cast<float>(bf16_to_bits(h[i]));
  }
};

}  // namespace lockstep::codec
