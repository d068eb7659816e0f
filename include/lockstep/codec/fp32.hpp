// lockstep/codec/fp32.hpp: the identity codec. The wire carries the fp32 values unchanged, so
// results are exact wherever the sums are, and in-process transports skip the copy entirely.
#pragma once

#include <cstring>
#include <string_view>

#include "../core/config.hpp"
#include "concept.hpp"

namespace lockstep::codec {

struct fp32 {
  static constexpr bool identity = true;
  static constexpr std::string_view name() noexcept { return "fp32"; }
  constexpr std::uint32_t id() const noexcept { return fingerprint(name(), 0); }
  constexpr std::size_t block() const noexcept { return 1; }
  constexpr std::size_t wire_bytes(std::size_t n) const noexcept { return pad8(n * sizeof(float)); }

  // One value on the wire and back: the element math of the CUDA kernels (device/codec.hpp) with
  // error feedback, and of decode_add here. Encode and decode themselves copy.
  using element = float;
  LOCKSTEP_HD static constexpr float to_wire(float v) noexcept { return v; }
  LOCKSTEP_HD static constexpr float from_wire(float c) noexcept { return c; }

  void encode(const float* in, std::size_t n, std::byte* out) const noexcept {
    if (n) std::memcpy(out, in, n * sizeof(float));
  }
  void decode(const std::byte* in, std::size_t n, float* out) const noexcept {
    if (n) std::memcpy(out, in, n * sizeof(float));
  }
  void decode_add(const std::byte* in, std::size_t n, float* LOCKSTEP_RESTRICT acc) const noexcept {
    const float* LOCKSTEP_RESTRICT x = reinterpret_cast<const float*>(in);
    for (std::size_t i = 0; i < n; ++i) acc[i] += from_wire(x[i]);
  }
};

}  // namespace lockstep::codec
