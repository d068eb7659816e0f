// lockstep/codec/error_feedback.hpp: error_feedback<C> keeps the quantisation residual of every
// value it encodes and adds it back before that value's next encode.
//
// A collective calls encode at fixed places: the same rank encodes the same element positions of
// the same buffer in the same phase on every call (the schedule is deterministic). The residual is
// therefore kept per (buffer address, element count, phase) and indexed by element position:
//   v = x + r;  wire = C(v);  r = v - decode(wire)
// Over many steps the rounding errors cancel instead of accumulating (Seide et al. 2014; Dettmers
// 2016 section 4). The object is stateful and belongs to one rank: pass the same object to every
// call on the same buffer.
#pragma once

#include <cstddef>
#include <map>
#include <tuple>
#include <vector>

#include "concept.hpp"

namespace lockstep::codec {

template <codec C>
class error_feedback {
 public:
  static constexpr bool identity = false;

  error_feedback() = default;
  explicit error_feedback(C inner) : inner_(std::move(inner)) {}

  constexpr auto name() const noexcept { return inner_.name(); }
  constexpr std::uint32_t id() const noexcept { return inner_.id(); }
  constexpr std::size_t block() const noexcept { return inner_.block(); }
  constexpr std::size_t wire_bytes(std::size_t n) const noexcept { return inner_.wire_bytes(n); }
  void encode(const float* in, std::size_t n, std::byte* out) const { inner_.encode(in, n, out); }
  void decode(const std::byte* in, std::size_t n, float* out) const { inner_.decode(in, n, out); }
  void decode_add(const std::byte* in, std::size_t n, float* acc) const { inner_.decode_add(in, n, acc); }
  const C& inner() const noexcept { return inner_; }

  // The residual of a buffer of n elements in a phase, zero on first use.
  float* residual(const void* key, std::size_t n, int phase) {
    auto& r = residuals_[{key, n, phase}];
    if (r.size() != n) r.assign(n, 0.0f);
    return r.data();
  }
  void reset() { residuals_.clear(); }

  void encode_with_residual(const float* in, std::size_t n, std::byte* out, float* residual) {
    thread_local std::vector<float> v;
    if (v.size() < n) v.resize(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = in[i] + residual[i];
    inner_.encode(v.data(), n, out);
    // residual <- v - decode(wire): decoded into the residual's storage, then one subtracting pass
    // (the CUDA kernels compute the same v - decoded per element, so the bits agree).
    inner_.decode(out, n, residual);
    for (std::size_t i = 0; i < n; ++i) residual[i] = v[i] - residual[i];
  }

 private:
  C inner_{};
  std::map<std::tuple<const void*, std::size_t, int>, std::vector<float>> residuals_;
};

}  // namespace lockstep::codec
