// lockstep/core/space.hpp: execution spaces — where a collective's element work runs, and when it
// is done. The executor (collective/executor.hpp) is written once against this interface; the
// space decides whether "decode-add this segment" happens now or is queued behind what came before.
//
//   S::ordered                       false: every call has finished when it returns (space::host);
//                                    true: calls are queued on a stream and finish in order
//                                    later (space::deferred on the CPU, device::cuda_space on a GPU)
//   s.encode(c, x, n, wire, r)       wire <- c(x[0..n)); with r (error feedback, else null):
//                                    v = x + r, wire <- c(v), r <- v - decode(wire)
//   s.decode(c, wire, n, out)        out[0..n) <- values(wire)
//   s.decode_add(c, wire, n, acc)    acc[0..n) += values(wire)
//   s.copy(dst, src, bytes)          memcpy in the space's order
//   s.copy_final(dst, src, bytes)    optional: a copy whose destination this rank does not read
//                                    again in the call (space::copy_final falls back to copy)
//   s.sum_into(dst, wire, n, acc)    optional, fp32 wire only: dst[0..n) <- acc[i] + values(wire),
//                                    the bits of decode_add, written elsewhere (the executor's
//                                    add-and-forward into a transport's buffer)
//   s.zero(dst, bytes)               memset to 0 in the space's order (ordered spaces; parallel/'s
//                                    empty products)
//   s.divide(x, n, by)               x[i] /= by, rounded as one fp32 division
//   s.allocate(bytes) -> memory      owning, 64-byte aligned, freed in the space's order
// An ordered space also supplies the stream machinery the stream-ordered transports and the
// request of an asynchronous call use:
//   S::event, s.record(e), s.wait(e), S::ready(e)   cudaEventRecord / cudaStreamWaitEvent / Query
//   s.handle()                                       the stream itself
//   s.drain(deadline)                                wait (bounded) for the queued work, errors
//                                                    swallowed: a failed call drains its stream
//                                                    before the caller's buffers can go
//
// Pointers handed to an ordered space must stay valid until the work is done: the executor only
// hands it the caller's buffers (which the caller keeps for the request's lifetime) and memory
// from allocate(), which is freed behind the work that uses it.
//
// The codec element math is the codec's own (codec/*.hpp) on the host spaces and the same LOCKSTEP_HD
// functions inside device/codec.hpp's kernels on the GPU.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "../codec/concept.hpp"
#include "../codec/fp32.hpp"
#include "config.hpp"
#include "host_stream.hpp"

#if LOCKSTEP_HOST_AVX2 || (defined(__SSE2__) && !defined(__CUDACC__) && !defined(LOCKSTEP_NO_SIMD))
#define LOCKSTEP_HOST_STREAMING_STORES 1
#include <immintrin.h>  // detail::stream_copy
#else
#define LOCKSTEP_HOST_STREAMING_STORES 0
#endif

namespace lockstep::space {

template <class S>
concept execution_space = requires(S& s, const codec::fp32& c, const float* in, float* out, std::byte* wire,
                                   const std::byte* cwire, void* dst, const void* src, std::size_t n) {
  { S::ordered } -> std::convertible_to<bool>;
  s.encode(c, in, n, wire, out);
  s.decode(c, cwire, n, out);
  s.decode_add(c, cwire, n, out);
  s.copy(dst, src, n);
  s.divide(out, n, 2.0f);
  { s.allocate(n).data() } -> std::same_as<std::byte*>;
};

template <class S>
concept ordered_space = execution_space<S> && S::ordered &&
                        requires(S& s, typename S::event& e, const typename S::event& ce) {
                          s.record(e);
                          s.wait(ce);
                          { S::ready(ce) } -> std::same_as<bool>;
                          s.handle();
                          s.drain(std::chrono::steady_clock::now());
                        };

namespace detail {

// Host bytes aligned to 64 (a cache line; the AVX-512 codecs' loads), freed by `free_` when set.
class host_memory {
 public:
  host_memory() = default;
  explicit host_memory(std::size_t bytes)
      : p_(bytes ? static_cast<std::byte*>(::operator new(bytes, std::align_val_t{64})) : nullptr), n_(bytes) {}
  host_memory(host_memory&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), stream_(std::move(o.stream_)) {}
  host_memory& operator=(host_memory&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(stream_, o.stream_);
    return *this;
  }
  ~host_memory() {
    if (!p_) return;
    stream_.enqueue_or_run([p = p_] { ::operator delete(p, std::align_val_t{64}); });
  }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  void free_on(const host_stream& s) { stream_ = s.weak(); }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
  host_stream::weak_ref stream_;  // freed behind the work queued on it (none: at once)
};

// x[i] /= by, one fp32 division: the average's element, space::host's loop and device::cuda_space's
// kernel alike.
struct divide_by {
  float* x;
  float by;
  LOCKSTEP_HD void operator()(std::size_t i) const noexcept { x[i] /= by; }
};

// A copy by non-temporal stores: the destination's lines go to memory without the read for
// ownership a plain store makes of each (a third stream of memory traffic), and without evicting
// what the cache holds. Worth it only where nothing reads the destination soon: the executor asks
// for it (copy_final) only for final values this rank does not send on, and only from
// streaming_copy_bytes, since smaller copies stay in cache. glibc's memcpy makes the same trade
// only past a threshold that follows the last-level cache's size, which on a VM is whatever the
// hypervisor reports (machine C, docs/benchmarks.md: 480 MiB, so never; there a 1 MiB copy ran at
// 10.1 GB/s this way against memcpy's 7.3). The bytes are the same either way.
//
// Not in space::host::copy itself: a ring forwards the chunk it has just received, and read back
// from memory, the mpi transport's 4 and 16 MiB all-reduces ran 7-12% slower (tried in f714458).
inline constexpr std::size_t streaming_copy_bytes = std::size_t{1} << 20;

inline void stream_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if LOCKSTEP_HOST_STREAMING_STORES
  if (bytes >= streaming_copy_bytes) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    // Stores must be aligned: plain-copy the head up to the destination's next 64-byte line.
    const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(d) & 63)) & 63;
    std::memcpy(d, s, head);
    d += head, s += head, bytes -= head;
    std::size_t i = 0;
#if LOCKSTEP_HOST_AVX512
    for (; i + 128 <= bytes; i += 128) {
      const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    }
#elif LOCKSTEP_HOST_AVX2
    for (; i + 128 <= bytes; i += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)),
                    b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32)),
                    c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64)),
                    e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    }
#else
    for (; i + 64 <= bytes; i += 64)
      for (std::size_t j = 0; j < 64; j += 16)
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + j), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + j)));
#endif
    std::memcpy(d + i, s + i, bytes - i);
    // Streaming stores are weakly ordered: fence them before anything tells a peer "done".
    _mm_sfence();
    return;
  }
#endif
  if (bytes) std::memcpy(dst, src, bytes);
}

template <class C>
void encode_now(C& c, const float* x, std::size_t n, std::byte* wire, float* residual) {
  if constexpr (codec::feedback_codec<C>) {
    if (residual) return c.encode_with_residual(x, n, wire, residual);
  }
  c.encode(x, n, wire);
}

}  // namespace detail

// The caller's thread does the work, now.
struct host {
  static constexpr bool ordered = false;
  using memory = detail::host_memory;

  template <codec::codec C>
  void encode(C& c, const float* x, std::size_t n, std::byte* wire, float* residual) const {
    detail::encode_now(c, x, n, wire, residual);
  }
  template <codec::codec C>
  void decode(const C& c, const std::byte* wire, std::size_t n, float* out) const {
    c.decode(wire, n, out);
  }
  template <codec::codec C>
  void decode_add(const C& c, const std::byte* wire, std::size_t n, float* acc) const {
    c.decode_add(wire, n, acc);
  }
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy_final(void* dst, const void* src, std::size_t bytes) const { detail::stream_copy(dst, src, bytes); }
  // acc + wire in that order, as codec::fp32::decode_add adds: the same bits, NaN payloads included.
  void sum_into(float* LOCKSTEP_RESTRICT dst, const std::byte* wire, std::size_t n, const float* LOCKSTEP_RESTRICT acc) const noexcept {
    const float* LOCKSTEP_RESTRICT x = reinterpret_cast<const float*>(wire);
    for (std::size_t i = 0; i < n; ++i) dst[i] = acc[i] + x[i];
  }
  void divide(float* x, std::size_t n, float by) const {
    for (std::size_t i = 0; i < n; ++i) detail::divide_by{x, by}(i);
  }
  memory allocate(std::size_t bytes) const { return memory(bytes); }
};

// The host's work queued on a host_stream: what the GPU path does, run by a CPU thread, so that the
// executor's stream-ordered path (no work done at call time, completion by events) is tested on
// every machine. The element math is space::host's.
class deferred {
 public:
  static constexpr bool ordered = true;
  using memory = detail::host_memory;
  using event = host_event;
  using handle_type = host_stream*;

  explicit deferred(host_stream* s) : s_(s) {}
  host_stream* handle() const noexcept { return s_; }
  static constexpr const char* name() noexcept { return "deferred"; }

  template <codec::codec C>
  void encode(C& c, const float* x, std::size_t n, std::byte* wire, float* residual) const {
    s_->enqueue([&c, x, n, wire, residual] { detail::encode_now(c, x, n, wire, residual); });
  }
  template <codec::codec C>
  void decode(const C& c, const std::byte* wire, std::size_t n, float* out) const {
    s_->enqueue([&c, wire, n, out] { c.decode(wire, n, out); });
  }
  template <codec::codec C>
  void decode_add(const C& c, const std::byte* wire, std::size_t n, float* acc) const {
    s_->enqueue([&c, wire, n, acc] { c.decode_add(wire, n, acc); });
  }
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) s_->enqueue([=] { std::memcpy(dst, src, bytes); });
  }
  void copy_final(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) s_->enqueue([=] { detail::stream_copy(dst, src, bytes); });
  }
  void zero(void* dst, std::size_t bytes) const {
    if (bytes) s_->enqueue([=] { std::memset(dst, 0, bytes); });
  }
  void divide(float* x, std::size_t n, float by) const {
    s_->enqueue([=] { host{}.divide(x, n, by); });
  }
  memory allocate(std::size_t bytes) const {
    memory m(bytes);
    m.free_on(*s_);
    return m;
  }

  void record(event& e) const { e.record(*s_); }
  void wait(const event& e) const { e.wait_on(*s_); }
  static bool ready(const event& e) { return e.ready(); }
  void drain(std::chrono::steady_clock::time_point deadline) const noexcept {
    try {
      s_->synchronize(deadline);
    } catch (...) {  // the error is the caller's to report; the queue is empty either way
    }
  }

 private:
  host_stream* s_;
};

// A copy whose destination this rank does not read again before the call returns: the space's
// copy_final where it has one (space::host: streaming stores for large copies), else its copy.
template <class S>
void copy_final(S& s, void* dst, const void* src, std::size_t bytes) {
  if constexpr (requires { s.copy_final(dst, src, bytes); }) s.copy_final(dst, src, bytes);
  else s.copy(dst, src, bytes);
}

static_assert(execution_space<host>);
static_assert(ordered_space<deferred>);

}  // namespace lockstep::space
