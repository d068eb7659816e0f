// lockstep/transport/inproc_stream.hpp: N ranks as threads of one process, each with a stream of
// its own, the ranks ordering each other's streams with events — over any ordered execution space:
// inproc_stream<device::cuda_space> is inproc_device (N ranks on one GPU), and
// inproc_stream<space::deferred> is the same transport on the CPU, where the suite runs it.
//
// A send posts (pointer, size, event) into the receiver's mailbox, the event recorded on the
// sender's stream where the bytes are ready. The receiver's stream waits on that event and reads
// the sender's memory directly (consume: decode-add straight from the neighbour's wire slot, no
// copy), then records a second event where its reads end; the sender's stream waits on that one
// before it may overwrite the bytes. So the host never waits for the stream: a host thread blocks
// only until the peer thread has posted its side, bounded by the deadline, and a failing rank
// aborts the world as the host transport does.
//
// What a stream-ordered transport does not do (stated once, here): it carries no collective
// headers, because reading a peer's header on the host needs the peer's stream to have run (on
// NCCL, a host synchronisation per call); it checks every message's size instead (errc::mismatch).
// And a chunk travels as one message: the stream's kernels cover a chunk, and the streams overlap
// ranks, not segments (segment_bytes = whole_chunk).
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <utility>

#include "../collective/pipeline.hpp"
#include "../core/error.hpp"
#include "../core/space.hpp"
#include "concept.hpp"
#include "mailbox.hpp"

namespace lockstep::transport {

namespace detail {

template <class Space>
struct stream_message {
  int src = -1;
  std::uint32_t tag = 0;
  const void* data = nullptr;
  std::size_t bytes = 0;
  typename Space::event ready;     // on the sender's stream: the bytes are in place
  typename Space::event consumed;  // on the receiver's stream: the last read of the bytes
  bool released = false;           // `consumed` has been recorded (guarded by the sender's box mutex)

  // The receiver has posted its reads and its stream has run them.
  template <class Box>
  static void await_reader(Box& sender_box, stream_message& m, std::chrono::steady_clock::time_point until) {
    {
      std::unique_lock lk(sender_box.m);
      if (!sender_box.cv.wait_until(lk, until, [&] { return m.released; })) return;
    }
    try {
      while (!Space::ready(m.consumed) && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    } catch (...) {  // the peer's stream failed: it reads nothing more
    }
  }
};

}  // namespace detail

template <space::ordered_space Space>
class inproc_stream {
 public:
  using space_type = Space;
  using world_type = detail::mailbox_world<detail::stream_message<Space>>;
  static constexpr std::size_t segment_bytes = pipeline::whole_chunk;
  static constexpr bool stream_ordered = true;

  // One posted send or receive (transport/mailbox.hpp: a failed send is withdrawn or waited for,
  // here until the peer's stream has run its reads).
  using request = detail::posted<detail::stream_message<Space>, world_type>;

  inproc_stream() = default;
  // Rank `rank` of `world`, enqueueing on `stream` (which must outlive the endpoint's groups).
  inproc_stream(std::shared_ptr<world_type> world, int rank, typename Space::handle_type stream)
      : world_(std::move(world)), rank_(rank), space_(stream) {}

  static std::shared_ptr<world_type> make_world(int n) {
    if (n < 1) throw error(errc::invalid_argument, "inproc_stream", -1, -1, "world of " + std::to_string(n) + " ranks");
    return std::make_shared<world_type>(n);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return world_ ? world_->size() : 0; }
  std::string name() const { return std::string("inproc_") + Space::name(); }
  typename Space::handle_type stream() const noexcept { return space_.handle(); }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    return detail::post_send<detail::stream_message<Space>>(world_, rank_, peer, tag, data, bytes, [&](detail::stream_message<Space>& m) { space_.record(m.ready); });
  }

  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    return detail::post_recv<detail::stream_message<Space>>(world_, rank_, peer, tag, data, bytes);
  }

  // A receive copies from the sender's memory on this stream; a send orders this stream after the
  // receiver's last read. Either way the host waits only for the peer thread to get there.
  bool wait(request& r, clock::time_point deadline) {
    if (r.done) return true;
    if (r.recv) return consume(r, deadline, [&](const std::byte* data) { space_.copy(r.dst, data, r.bytes); });
    auto& b = world_->at(rank_);
    {
      std::unique_lock lk(b.m);
      b.cv.wait_until(lk, deadline, [&] { return r.msg->released || world_->aborted(); });
      if (!r.msg->released) {
        lk.unlock();
        if (world_->aborted()) world_->throw_aborted("send", rank_);
        return false;
      }
    }
    space_.wait(r.msg->consumed);
    r.done = true;
    return true;
  }

  // The next message from (peer, tag): this stream waits for the sender's bytes, fn enqueues its
  // reads of them, and the sender may reuse them once this stream has run those reads.
  template <class F>
  bool consume(request& r, clock::time_point deadline, F&& fn) {
    auto& b = world_->at(rank_);
    std::shared_ptr<detail::stream_message<Space>> m;
    auto take = [&] {
      m = world_type::take(b, r.peer, r.tag);
      return m || world_->aborted();
    };
    {
      std::unique_lock lk(b.m);
      b.cv.wait_until(lk, deadline, take);
    }
    if (!m) {
      if (world_->aborted()) world_->throw_aborted("recv", rank_);
      return false;
    }
    struct release_on_exit {
      inproc_stream* t;
      detail::stream_message<Space>& m;
      ~release_on_exit() { t->release(m); }
    } guard{this, *m};
    if (m->bytes != r.bytes)
      throw error(errc::mismatch, "recv", rank_, r.peer,
                  "expected a message of " + std::to_string(r.bytes) + " bytes, the peer sent " +
                      std::to_string(m->bytes) + " (tag " + std::to_string(r.tag) + ")");
    space_.wait(m->ready);
    r.done = true;
    fn(static_cast<const std::byte*>(m->data));
    return true;
  }

  void abort(const std::string& reason) {
    if (world_) world_->abort(rank_, reason);
  }

 private:
  void release(detail::stream_message<Space>& m) {
    space_.record(m.consumed);
    auto& sb = world_->at(m.src);
    {
      std::lock_guard lk(sb.m);
      m.released = true;
    }
    sb.cv.notify_all();
  }

  std::shared_ptr<world_type> world_;
  int rank_ = 0;
  Space space_{typename Space::handle_type{}};
};

// The CPU twin of inproc_device: every rank's work runs on a host_stream of its own.
using inproc_deferred = inproc_stream<space::deferred>;

}  // namespace lockstep::transport
