// The error bound of a collective, shared by the in-process and the MPI collective tests and by
// tests/test_bounds.cpp (docs/codecs.md, "Error of a collective", has the derivation):
//   |y - exact| <= q * delta * M         (proven: ((1 + delta)^q - 1) * M, see error_factor)
// delta: a codec's error per quantisation relative to its scale (the value itself for bf16, the
// block's absmax for the blockwise codecs); q: the quantisations whose errors reach one value.
// A blockwise codec scales every quantisation by a block absmax that another element may set, so
// every quantisation on a value's path counts: q = N on a ring and on a torus alike (every column
// reduce-scatter quantises its own partial sums). bf16 scales by the value itself, and the columns
// of a torus share the value's magnitude out among them, so only the longest chain counts:
// q = N on a ring, R + C - 1 on an R x C torus. M bounds the partial sums: max_i sum_r |x_r[i]|
// over the buffer, or over the value's block (the same grid in every phase: blocks start at chunk
// starts), or for bf16 over the value alone.
#pragma once

#include <lockstep/codec.hpp>
#include <lockstep/topology.hpp>

#include <cmath>
#include <type_traits>

namespace lockstep_test {

template <class C>
constexpr bool exact = std::is_same_v<C, lockstep::codec::fp32>;

// Whether the codec's error is relative to each value (bf16) rather than to a block's absmax.
template <class C>
constexpr bool value_relative = std::is_same_v<C, lockstep::codec::bf16>;

template <class C>
double delta() {
  using namespace lockstep;
  if constexpr (std::is_same_v<C, codec::fp32>) return 0.0;
  else if constexpr (std::is_same_v<C, codec::bf16>) return 1.0 / 256;  // half an ulp of 8 significant bits
  else if constexpr (std::is_same_v<C, codec::int8> || std::is_same_v<C, codec::error_feedback<codec::int8>>) return 1.0 / 254;
  else return 0.9 / 64;  // dyntree8: the top bin [1 - 0.9/64, 1] decodes to 1
}

// Reduce-scatter hops on the longest chain: N-1 on a ring, R+C-2 on an R x C torus.
inline int hops(const lockstep::topology::ring&, int n) { return n - 1; }
inline int hops(const lockstep::topology::torus2d& t, int n) {
  auto [r, c] = t.shape(n);
  return r + c - 2;
}

// Quantisations whose errors reach one all_reduce value, from the longest chain's hops h and the
// group size n: h + 1 for a value-relative codec, n for a blockwise one (ring: h + 1 = n).
template <class C>
int quantisations(int h, int n) {
  return value_relative<C> ? h + 1 : n;
}
template <class C, class T>
int quantisations(const T& topo, int n) {
  return quantisations<C>(hops(topo, n), n);
}

// The factor of M the tests check: q * delta. The derivation proves ((1 + delta)^q - 1), which
// also counts the errors already in a partial sum enlarging its scale; no input found reaches past
// q * delta (the quantisation that sets a block's scale round-trips exactly), so the tests hold the
// collectives to the first-order bound and tests/test_bounds.cpp prints how close it comes.
template <class C>
double error_factor(int q) {
  return q * delta<C>();
}
template <class C>
double proven_error_factor(int q) {
  return std::expm1(q * std::log1p(delta<C>()));
}

}  // namespace lockstep_test
