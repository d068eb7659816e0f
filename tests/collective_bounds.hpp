// The error bound of a collective, shared by the in-process and the MPI collective tests:
//   |y - exact| <= (H + 1) * delta * M        (docs/codecs.md, "Error of a collective")
// delta: a codec's error per quantisation relative to its block's absmax; H: reduce-scatter hops.
#pragma once

#include <lockstep/codec.hpp>
#include <lockstep/topology.hpp>

#include <type_traits>

namespace lockstep_test {

template <class C>
constexpr bool exact = std::is_same_v<C, lockstep::codec::fp32>;

template <class C>
double delta() {
  using namespace lockstep;
  if constexpr (std::is_same_v<C, codec::fp32>) return 0.0;
  else if constexpr (std::is_same_v<C, codec::bf16>) return 1.0 / 256;
  else if constexpr (std::is_same_v<C, codec::int8> || std::is_same_v<C, codec::error_feedback<codec::int8>>) return 1.0 / 254;
  else return 0.9 / 64;
}

inline int hops(const lockstep::topology::ring&, int n) { return n - 1; }
inline int hops(const lockstep::topology::torus2d& t, int n) {
  auto [r, c] = t.shape(n);
  return r + c - 2;
}

}  // namespace lockstep_test
