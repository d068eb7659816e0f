// lockstep/codec/residual.hpp: error feedback's new residual, one value at a time, for every path
// (elementwise, blockwise, the four passes, the CUDA kernels).
//
//   feedback_residual(v, decoded)   v - decoded, or 0 where that is not finite
//
// A value that was Inf or NaN (an overflowed step, the one a loss scaler skips) has no
// quantisation error to carry. Kept, it would make v = x + residual non-finite in every later step
// of that element, and with a blockwise codec of its whole block (the block's scale is then
// non-finite): one bad step would poison training for good. So the residual restarts at 0 there.
// This step still reports the overflow: its wire holds the Inf or NaN.
#pragma once

#include "../core/config.hpp"

namespace lockstep::codec {

LOCKSTEP_HD inline float feedback_residual(float v, float decoded) noexcept {
  const float r = v - decoded;
  // r - r is 0 for every finite r and NaN for Inf and NaN; no <cmath>, the same on the device.
  return r - r == 0.0f ? r : 0.0f;
}

}  // namespace lockstep::codec
