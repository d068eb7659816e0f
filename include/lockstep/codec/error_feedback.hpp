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
//
// The residuals live in the memory of the space the calls run in (device memory for a GPU group:
// the executor passes its group's space), and belong to this object, as momentum belongs to an
// optim::state. save(buffer, out, space) and load(buffer, in, space) move one buffer's residuals to
// and from a checkpoint without the caller knowing how they are kept.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <algorithm>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/error.hpp"
#include "../core/space.hpp"
#include "concept.hpp"
#include "elementwise.hpp"

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

// How many (buffer, count, phase) keys an error_feedback keeps residuals for by default.
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

  // The residual of a buffer of n elements in a phase, zero on first use, in `space`'s memory.
  template <class Space>
  float* residual(const void* key, std::size_t n, int phase, Space& space) {
    const auto k = std::make_tuple(key, n, phase);
    auto it = residuals_.find(k);
    if (it == residuals_.end()) {
      if (residuals_.size() >= max_buffers_)
        throw error(errc::invalid_argument, "error_feedback", -1, -1,
                    "residuals kept for " + std::to_string(residuals_.size()) +
                        " (buffer, count, phase) keys already (an all_reduce takes two per buffer): residuals "
                        "are kept per buffer address, so reduce the same gradient buffers every step (or "
                        "forget() a buffer before freeing it), or allow more in the constructor");
      auto mem = std::make_shared<typename Space::memory>(space.allocate(n * sizeof(float)));
      auto* p = reinterpret_cast<float*>(mem->data());
      if constexpr (requires { space.zero(p, n * sizeof(float)); }) space.zero(p, n * sizeof(float));
      else std::fill_n(p, n, 0.0f);  // host memory, fresh: nothing queued can touch it yet
      it = residuals_.emplace(k, slot{std::move(mem), p}).first;
    }
    return it->second.data;
  }
  float* residual(const void* key, std::size_t n, int phase) {
    space::host h;
    return residual(key, n, phase, h);
  }

  // A checkpoint's share: the residuals an all_reduce of `buffer` keeps — phase 0 (its
  // reduce-scatter partial sums), then phase 1 (the final values its owner sends) — as
  // state_floats(buffer.size()) floats at host memory `out`, copied through `space` (the group's:
  // on a stream the copies are queued, and done once the caller synchronises it). load() is the
  // reverse, creating the residuals if this object has none yet (a resumed run before its first
  // step).
  static constexpr std::size_t state_floats(std::size_t n) noexcept { return 2 * n; }
  template <class Space>
  void save(std::span<const float> buffer, float* out, Space& space) {
    for (int phase = 0; phase < 2; ++phase, out += buffer.size())
      space.copy(out, residual(buffer.data(), buffer.size(), phase, space), buffer.size() * sizeof(float));
  }
  template <class Space>
  void load(std::span<const float> buffer, const float* in, Space& space) {
    for (int phase = 0; phase < 2; ++phase, in += buffer.size())
      space.copy(residual(buffer.data(), buffer.size(), phase, space), in, buffer.size() * sizeof(float));
  }

  // Drops the residuals of every call on `key` (a buffer about to be freed or moved).
  void forget(const void* key) {
    for (auto it = residuals_.begin(); it != residuals_.end();)
      it = std::get<0>(it->first) == key ? residuals_.erase(it) : std::next(it);
  }
  void reset() { residuals_.clear(); }
  std::size_t buffers() const noexcept { return residuals_.size(); }
  std::size_t max_buffers() const noexcept { return max_buffers_; }

  // v = in + residual; out <- wire(v); residual <- v - decode(out). An inner codec that fuses the
  // step does it, with the same bits: an elementwise one through encode_elements (the CUDA
  // kernel's loop), blockwise through its encode_feedback (block by block in cache); any other
  // takes the passes below.
  void encode_with_residual(const float* in, std::size_t n, std::byte* out, float* residual) {
    if constexpr (elementwise<C>) {  // one pass: each value, its code and its new residual
      const encode_elements<C> e{in, residual, reinterpret_cast<typename C::element*>(out)};
      for (std::size_t i = 0; i < n; ++i) e(i);
    } else if constexpr (requires { inner_.encode_feedback(in, n, out, residual); }) {
      inner_.encode_feedback(in, n, out, residual);
    } else {
      encode_in_passes(inner_, in, n, out, residual);
    }
  }

  // The step as four passes over the n values, for any codec (public: tests compare a fused
  // codec's bits with it).
  static void encode_in_passes(const C& inner, const float* in, std::size_t n, std::byte* out, float* residual) {
    thread_local std::vector<float> v;
    if (v.size() < n) v.resize(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = in[i] + residual[i];
    inner.encode(v.data(), n, out);
    // residual <- v - decode(wire): decoded into the residual's storage, then one subtracting pass
    // (the CUDA kernels compute the same v - decoded per element, so the bits agree).
    inner.decode(out, n, residual);
    for (std::size_t i = 0; i < n; ++i) residual[i] = feedback_residual(v[i], residual[i]);
  }

 private:
  C inner_{};
  std::size_t max_buffers_ = error_feedback_max_buffers;
  struct slot {
    std::shared_ptr<void> memory;  // the space's memory object, freed as that space frees
    float* data;
  };
  std::map<std::tuple<const void*, std::size_t, int>, slot> residuals_;
};

}  // namespace lockstep::codec
