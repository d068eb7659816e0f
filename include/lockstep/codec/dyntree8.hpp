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
// [1e-7, 1e-6). The all-zero magnitude is 0 (|u| < 1e-7 encodes to it) and the sign of a zero is
// dropped. Exactness at the ends: the top magnitude 0x7f (bin [1 - 0.9/64, 1]) decodes to 1
// instead of its midpoint, so 0 and +-absmax round-trip exactly; see docs/codecs.md for the errors.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "../core/config.hpp"
#include "blockwise.hpp"

namespace lockstep::codec {

struct dyntree8_format {
  static constexpr std::string_view name = "dyntree8";

  // Branch-free so that the host loop vectorises: the decade is a sum of comparisons and the
  // decade's power of ten a chain of selects.
  LOCKSTEP_HD static std::uint8_t quantize(float unit) noexcept {
    const float a = fabsf(unit);
    const int k = (a < 1e-1f) + (a < 1e-2f) + (a < 1e-3f) + (a < 1e-4f) + (a < 1e-5f) + (a < 1e-6f);
    float s = a < 1e-1f ? 1e1f : 1.0f;
    s = a < 1e-2f ? 1e2f : s;
    s = a < 1e-3f ? 1e3f : s;
    s = a < 1e-4f ? 1e4f : s;
    s = a < 1e-5f ? 1e5f : s;
    s = a < 1e-6f ? 1e6f : s;
    const int bins = 64 >> k;
    int idx = static_cast<int>((a * s - 0.1f) * (static_cast<float>(bins) * (1.0f / 0.9f)));
    idx = idx < 0 ? 0 : (idx > bins - 1 ? bins - 1 : idx);
    const int mag = a < 1e-7f ? 0 : (bins | idx);
    const int sign = unit < 0.0f ? 0x80 : 0;
    return static_cast<std::uint8_t>(mag == 0 ? 0 : (mag | sign));
  }

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
