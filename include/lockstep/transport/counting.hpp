// lockstep/transport/counting.hpp: a transport that counts what another one sends — bytes and
// messages, data and headers apart — and otherwise is that transport. For "bytes on the wire per
// step" (bench/bench_hybrid.cpp): what the schedules and codecs actually put on the links, read
// off the same calls the executor makes, instead of a formula beside them.
//
//   group<transport::counting<transport::inproc>> g(transport::counting<transport::inproc>(inner));
//   ... collectives ...;  g.transport().sent().bytes
//
// Counts are this endpoint's sends to other ranks; a split endpoint counts into the same totals
// (they are shared), so a layer's sub-groups add up. Headers are the executor's 56-byte ones
// (tag bit 24) and the parallel layers' descriptors travel as data. Host transports only: a
// stream-ordered transport's sends are enqueued, not made, when they are called.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "concept.hpp"

namespace lockstep::transport {

struct traffic {
  std::uint64_t bytes = 0, messages = 0;                // data
  std::uint64_t header_bytes = 0, header_messages = 0;  // the collectives' headers
  std::uint64_t filled = 0;  // data messages written straight into the transport's buffer (try_isend_fill)
};

template <transport T>
class counting {
  struct totals {
    std::atomic<std::uint64_t> bytes{0}, messages{0}, header_bytes{0}, header_messages{0}, filled{0};
  };

 public:
  using request = typename T::request;
  static constexpr std::size_t segment_bytes = T::segment_bytes;
  static constexpr bool send_completion_means_taken = [] {
    if constexpr (requires { requires T::send_completion_means_taken; }) return true;
    return false;
  }();

  counting() = default;
  explicit counting(T inner) : t_(std::move(inner)), n_(std::make_shared<totals>()) {}

  int rank() const { return t_.rank(); }
  int size() const { return t_.size(); }
  std::string name() const { return "counting(" + t_.name() + ")"; }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    count(peer, tag, bytes);
    return t_.isend(peer, tag, data, bytes);
  }
  request isend_in_place(int peer, std::uint32_t tag, const void* data, std::size_t bytes)
    requires requires(T& t, int p, std::uint32_t g, const void* d, std::size_t b) { t.isend_in_place(p, g, d, b); }
  {
    count(peer, tag, bytes);
    return t_.isend_in_place(peer, tag, data, bytes);
  }
  // Counted only where the inner transport took it (else the caller sends the usual way).
  template <class Fill>
  std::optional<request> try_isend_fill(int peer, std::uint32_t tag, std::size_t bytes, Fill&& fill)
    requires requires(T& t) { t.try_isend_fill(peer, tag, bytes, fill); }
  {
    auto r = t_.try_isend_fill(peer, tag, bytes, fill);
    if (r) {
      count(peer, tag, bytes);
      if (n_) ++n_->filled;
    }
    return r;
  }
  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) { return t_.irecv(peer, tag, data, bytes); }
  bool wait(request& r, clock::time_point deadline) { return t_.wait(r, deadline); }
  template <class F>
  bool consume(request& r, clock::time_point deadline, F&& fn) {
    return t_.consume(r, deadline, std::forward<F>(fn));
  }
  void abort(const std::string& reason) { t_.abort(reason); }
  counting split(int color, int key, clock::time_point deadline)
    requires splittable<T>
  {
    counting c(t_.split(color, key, deadline));
    c.n_ = n_;
    return c;
  }

  traffic sent() const {
    if (!n_) return {};
    return {n_->bytes.load(), n_->messages.load(), n_->header_bytes.load(), n_->header_messages.load(), n_->filled.load()};
  }
  void reset() {
    if (!n_) return;
    n_->bytes = 0, n_->messages = 0, n_->header_bytes = 0, n_->header_messages = 0, n_->filled = 0;
  }
  T& inner() noexcept { return t_; }

 private:
  void count(int peer, std::uint32_t tag, std::size_t bytes) {
    if (!n_ || peer == t_.rank()) return;
    if (tag & (1u << 24)) n_->header_bytes += bytes, ++n_->header_messages;
    else n_->bytes += bytes, ++n_->messages;
  }

  T t_;
  std::shared_ptr<totals> n_;
};

}  // namespace lockstep::transport
