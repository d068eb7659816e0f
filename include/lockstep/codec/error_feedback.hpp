// lockstep/codec/error_feedback.hpp: error_feedback<C> keeps the quantisation residual of every
// value it encodes and adds it back before that value's next encode.
//
// A collective calls encode at fixed places: the same rank encodes the same element positions of
// the same buffer in the same phase on every call (the schedule is deterministic). The residual is
// therefore kept per (buffer address, element count, phase) and indexed by element position:
//   v = x + r;  wire = C(v);  r = v - decode(wire)
// Over many steps the rounding errors cancel instead of accumulating (Seide et al. 2014; Dettmers
// 2016 section 4). The object is stateful and belongs to one rank: pass the same object to every
// call on the same buffer, and keep that buffer where it is. A program that hands every step a
// freshly allocated gradient buffer would start each step from zero residuals (error feedback
// silently off) while the table grew without end; past max_buffers keys (default 16384; an
// all_reduce takes two per buffer, one per phase) that is what is happening, and residual()
// throws instead. forget(buffer) drops a buffer about to be freed, reset() drops all.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/error.hpp"
#include "concept.hpp"

namespace lockstep::codec {

namespace detail {
// A codec whose name() is a constant of its type (every codec lockstep ships).
template <class C>
concept constant_name = requires { typename std::integral_constant<std::size_t, C::name().size()>; };

// C::name() + "+ef", kept in static storage so that name() can hand out a string_view as the
// plain codecs do.
template <constant_name C>
struct feedback_name {
  static constexpr std::string_view inner = C::name(), suffix = "+ef";
  static constexpr std::array<char, inner.size() + suffix.size()> chars = [] {
    std::array<char, inner.size() + suffix.size()> a{};
    for (std::size_t i = 0; i < inner.size(); ++i) a[i] = inner[i];
    for (std::size_t i = 0; i < suffix.size(); ++i) a[inner.size() + i] = suffix[i];
    return a;
  }();
  static constexpr std::string_view value{chars.data(), chars.size()};
};
}  // namespace detail

// How many (buffer, count, phase) keys an error_feedback keeps residuals for by default; the device
// group applies the same object's bound to the residuals it keeps for it.
inline constexpr std::size_t error_feedback_max_buffers = 16384;

template <codec C>
class error_feedback {
 public:
  static constexpr bool identity = false;

  error_feedback() = default;
  explicit error_feedback(C inner, std::size_t max_buffers = error_feedback_max_buffers)
      : inner_(std::move(inner)), max_buffers_(max_buffers) {}

  // "dyntree8+ef": labels and error messages say that error feedback is on.
  constexpr auto name() const noexcept(detail::constant_name<C>) {
    if constexpr (detail::constant_name<C>) return detail::feedback_name<C>::value;
    else return std::string(inner_.name()) + "+ef";
  }
  // The inner codec's: the wire format is the same with and without error feedback (the residual
  // stays on the rank that encodes), so a rank with it and a rank without exchange valid data.
  // Whether to use it is each rank's choice, not an agreement the ranks must check.
  constexpr std::uint32_t id() const noexcept { return inner_.id(); }
  constexpr std::size_t block() const noexcept { return inner_.block(); }
  constexpr std::size_t wire_bytes(std::size_t n) const noexcept { return inner_.wire_bytes(n); }
  void encode(const float* in, std::size_t n, std::byte* out) const { inner_.encode(in, n, out); }
  void decode(const std::byte* in, std::size_t n, float* out) const { inner_.decode(in, n, out); }
  void decode_add(const std::byte* in, std::size_t n, float* acc) const { inner_.decode_add(in, n, acc); }
  const C& inner() const noexcept { return inner_; }

  // The residual of a buffer of n elements in a phase, zero on first use.
  float* residual(const void* key, std::size_t n, int phase) {
    const auto k = std::make_tuple(key, n, phase);
    auto it = residuals_.find(k);
    if (it == residuals_.end()) {
      if (residuals_.size() >= max_buffers_)
        throw error(errc::invalid_argument, "error_feedback", -1, -1,
                    "residuals kept for " + std::to_string(residuals_.size()) +
                        " (buffer, count, phase) keys already (an all_reduce takes two per buffer): residuals "
                        "are kept per buffer address, so reduce the same gradient buffers every step (or "
                        "forget() a buffer before freeing it), or allow more in the constructor");
      it = residuals_.emplace(k, std::vector<float>(n, 0.0f)).first;
    }
    return it->second.data();
  }
  // Drops the residuals of every call on `key` (a buffer about to be freed or moved).
  void forget(const void* key) {
    for (auto it = residuals_.begin(); it != residuals_.end();)
      it = std::get<0>(it->first) == key ? residuals_.erase(it) : std::next(it);
  }
  void reset() { residuals_.clear(); }
  std::size_t buffers() const noexcept { return residuals_.size(); }
  std::size_t max_buffers() const noexcept { return max_buffers_; }

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
  std::size_t max_buffers_ = error_feedback_max_buffers;
  std::map<std::tuple<const void*, std::size_t, int>, std::vector<float>> residuals_;
};

}  // namespace lockstep::codec
