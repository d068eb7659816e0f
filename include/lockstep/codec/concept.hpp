// lockstep/codec/concept.hpp: what a codec must provide.
//
// A codec decides what a chunk looks like on the wire. It turns fp32 values into bytes (encode)
// and bytes back into fp32, either overwriting (decode) or adding into an fp32 accumulator
// (decode_add). All arithmetic happens in fp32: a lossy codec never adds in its wire format.
//
//   c.name()                  short printable name ("bf16")
//   c.id()                    32-bit fingerprint of the format and its parameters; ranks compare
//                             it before exchanging data, so a codec mismatch is an error, not noise
//   c.block()                 elements that share one scale; segments are cut at multiples of it
//   c.wire_bytes(n)           bytes that n encoded values occupy (a multiple of 8)
//   c.encode(in, n, out)      out <- wire(in[0..n))
//   c.decode(in, n, out)      out[0..n) <- values(in)
//   c.decode_add(in, n, acc)  acc[0..n) += values(in)
//   C::identity               true when the wire bytes are the fp32 values themselves, so a
//                             transport may hand over the sender's memory without a copy
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lockstep::codec {

template <class C>
concept codec = requires(const C& c, const float* in, std::size_t n, std::byte* out,
                         const std::byte* wire, float* acc) {
  { c.name() } -> std::convertible_to<std::string_view>;
  { c.id() } -> std::same_as<std::uint32_t>;
  { c.block() } -> std::same_as<std::size_t>;
  { c.wire_bytes(n) } -> std::same_as<std::size_t>;
  c.encode(in, n, out);
  c.decode(wire, n, acc);
  c.decode_add(wire, n, acc);
  { C::identity } -> std::convertible_to<bool>;
};

// A codec that keeps a quantisation residual between calls (error_feedback<C>). The executor asks
// it for the residual of a buffer region and encodes through it.
template <class C>
concept feedback_codec = codec<C> && requires(C& c, const void* key, std::size_t n, int phase,
                                              const float* in, std::byte* out, float* residual) {
  { c.residual(key, n, phase) } -> std::same_as<float*>;
  c.encode_with_residual(in, n, out, residual);
};

// Wire sizes are padded to 8 bytes so that consecutive chunks keep their scales aligned.
constexpr std::size_t pad8(std::size_t bytes) noexcept { return (bytes + 7) & ~std::size_t{7}; }

// FNV-1a over the name, mixed with a parameter: enough to tell formats apart, stable across builds.
constexpr std::uint32_t fingerprint(std::string_view name, std::uint32_t param) noexcept {
  std::uint32_t h = 2166136261u;
  for (char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 16777619u;
  return (h ^ param) * 16777619u;
}

}  // namespace lockstep::codec
