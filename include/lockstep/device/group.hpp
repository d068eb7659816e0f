// lockstep/device/group.hpp: a group of ranks over a stream-ordered transport, the device memory
// its collectives encode into, and the request an asynchronous collective returns.
//
// The host group (collective/group.hpp) needs a worker thread to make a collective asynchronous;
// here the stream is the queue: a collective is enqueued on the transport's stream and the call
// returns. Collectives on one group therefore run in call order, like the host's. Scratch memory
// and error-feedback residuals are device buffers owned by the group and grown in stream order.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>

#include "../codec/error_feedback.hpp"  // error_feedback_max_buffers
#include "../collective/group.hpp"  // group_options
#include "runtime.hpp"
#include "transport.hpp"

namespace lockstep::device {

// The handle of an enqueued collective: an event recorded after its last operation.
class request {
 public:
  request() = default;
  request(std::shared_ptr<event> done, std::string label, int rank, std::chrono::milliseconds timeout,
          std::function<void(const std::string&)> abort)
      : done_(std::move(done)), label_(std::move(label)), rank_(rank), timeout_(timeout), abort_(std::move(abort)) {}

  bool valid() const noexcept { return static_cast<bool>(done_); }
  bool ready() const { return !done_ || done_->ready(); }
  // Blocks until the GPU finished the collective, at most the group's timeout; then aborts the
  // transport (so peers stop waiting) and throws errc::timeout naming the collective.
  void wait() {
    if (!done_) return;
    const auto deadline = transport::clock::now() + timeout_;
    while (!done_->ready()) {
      if (transport::clock::now() > deadline) {
        const std::string why = "the GPU did not finish within " + std::to_string(timeout_.count()) +
                                " ms (a peer that never posted its side hangs the stream)";
        if (abort_) abort_(why);
        throw error(errc::timeout, label_, rank_, -1, why);
      }
      std::this_thread::yield();
    }
  }

 private:
  std::shared_ptr<event> done_;
  std::string label_;
  int rank_ = -1;
  std::chrono::milliseconds timeout_{0};
  std::function<void(const std::string&)> abort_;
};

template <stream_transport T>
class group {
 public:
  using transport_type = T;

  explicit group(T t, group_options opt = {}) : t_(std::move(t)), opt_(opt) {}
  group(const group&) = delete;
  group& operator=(const group&) = delete;

  int rank() const noexcept { return t_.rank(); }
  int size() const noexcept { return t_.size(); }
  std::string name() const { return t_.name(); }
  const group_options& options() const noexcept { return opt_; }
  T& transport() noexcept { return t_; }
  cudaStream_t stream() const noexcept { return t_.stream(); }
  transport::clock::time_point deadline() const { return transport::clock::now() + opt_.timeout; }
  std::uint64_t next_sequence() noexcept { return seq_++; }

  // Device scratch of at least `bytes`, 256-byte aligned (cudaMallocAsync's), one per nesting
  // depth: an epilogue may run a collective of its own (LARS all-reducing its norms).
  std::byte* scratch(std::size_t bytes) {
    auto& b = scratch_[std::min<std::size_t>(depth_, scratch_.size() - 1)];
    if (b.size() < bytes) b = buffer<std::byte>(bytes + bytes / 4, stream());  // old one freed in stream order
    return b.data();
  }
  struct nest {
    group* g;
    explicit nest(group* gg) : g(gg) { ++g->depth_; }
    ~nest() { --g->depth_; }
  };

  // Error-feedback residual of (codec object, buffer, count, phase), zero on first use. Kept here,
  // on the device, rather than in the codec, whose residuals are host vectors.
  // Past the codec's max_buffers() keys (buffers that move every step: residuals would restart
  // from zero each time and device memory grow without end) this throws, as on the host.
  template <class Codec>
  float* residual(const Codec& ef, const void* buf, std::size_t n, int phase) {
    const auto key = std::make_tuple(static_cast<const void*>(&ef), buf, n, phase);
    auto it = residuals_.find(key);
    if (it == residuals_.end()) {
      std::size_t bound = codec::error_feedback_max_buffers;
      if constexpr (requires { ef.max_buffers(); }) bound = ef.max_buffers();
      if (residuals_.size() >= bound)
        throw error(errc::invalid_argument, "error_feedback", rank(), -1,
                    "device residuals kept for " + std::to_string(residuals_.size()) +
                        " (codec, buffer, count, phase) keys already (an all_reduce takes two per buffer): they "
                        "are kept per buffer address, so reduce the same gradient buffers every step (or "
                        "forget_residuals() a buffer before freeing it), or allow more in the codec's constructor");
      it = residuals_.emplace(key, buffer<float>(n, stream())).first;
      check(cudaMemsetAsync(it->second.data(), 0, n * sizeof(float), stream()), "error_feedback residual");
    }
    return it->second.data();
  }
  // Drops the residuals of every call on `buf` (freed in stream order).
  void forget_residuals(const void* buf) {
    for (auto it = residuals_.begin(); it != residuals_.end();)
      it = std::get<1>(it->first) == buf ? residuals_.erase(it) : std::next(it);
  }

  // An event recorded now on the stream, wrapped as the request of collective `label`.
  request make_request(std::string label) {
    auto e = std::make_shared<event>();
    e->record(stream());
    return request(std::move(e), std::move(label), rank(), opt_.timeout,
                   [this](const std::string& why) { t_.abort(why); });
  }

 private:
  T t_;
  group_options opt_;
  std::uint64_t seq_ = 0;
  std::size_t depth_ = 0;
  std::array<buffer<std::byte>, 4> scratch_;
  std::map<std::tuple<const void*, const void*, std::size_t, int>, buffer<float>> residuals_;
};

}  // namespace lockstep::device
