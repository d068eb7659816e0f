// lockstep/codec/elementwise.hpp: the per-value loops of a codec with one wire element per value
// (fp32, bf16: C::element, C::to_wire, C::from_wire), written once for the host loops and the CUDA
// kernels (device/codec.hpp runs them one index per thread).
//
//   encode_elements<C>{x, r, out}(i)      out[i] <- to_wire(v), v = x[i]; with a residual r (error
//                                         feedback; else null) v = x[i] + r[i], r[i] <- v - from_wire(out[i])
//                                         (0 where not finite: residual.hpp)
//   decode_elements<C>{in, out, add}(i)   out[i] <- from_wire(in[i]), or out[i] += it when `add`
//
// Sums and differences only, each rounded on its own on either side (there is no product to
// contract into an fma), so host and device compute the same bits. error_feedback<C> encodes
// through encode_elements (one pass instead of add, encode, decode, subtract); bf16's scalar loops
// decode through decode_elements.
#pragma once

#include <concepts>
#include <cstddef>

#include "../core/config.hpp"
#include "residual.hpp"

namespace lockstep::codec {

template <class C>
concept elementwise = requires(float v, typename C::element e) {
  { C::to_wire(v) } -> std::same_as<typename C::element>;
  { C::from_wire(e) } -> std::same_as<float>;
};

template <class C>
struct encode_elements {
  const float* LOCKSTEP_RESTRICT x;
  float* LOCKSTEP_RESTRICT residual;
  typename C::element* LOCKSTEP_RESTRICT out;
  LOCKSTEP_HD void operator()(std::size_t i) const noexcept {
    const float v = residual ? x[i] + residual[i] : x[i];
    const typename C::element c = C::to_wire(v);
    out[i] = c;
    if (residual) residual[i] = feedback_residual(v, C::from_wire(c));
  }
};

template <class C>
struct decode_elements {
  const typename C::element* LOCKSTEP_RESTRICT in;
  float* LOCKSTEP_RESTRICT out;
  bool add;
  LOCKSTEP_HD void operator()(std::size_t i) const noexcept {
    const float v = C::from_wire(in[i]);
    out[i] = add ? out[i] + v : v;
  }
};

}  // namespace lockstep::codec
