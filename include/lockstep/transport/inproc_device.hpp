// lockstep/transport/inproc_device.hpp: N ranks on one GPU, each a host thread with its own CUDA
// stream, so multi-rank device tests and benchmarks run on a single GPU.
//
// A send posts (pointer, size, event) into the receiver's mailbox, the event recorded on the
// sender's stream where the bytes are ready. The receiver's stream waits on that event and reads
// the sender's device memory directly (borrow: decode-add straight from the neighbour's wire
// slot, no copy), then records a second event where its reads end; the sender's stream waits on
// that one before it may overwrite the bytes. So ranks order each other's streams with events and
// the host never waits for the GPU: a host thread blocks only until the peer thread has posted its
// side, bounded by the deadline, and a failing rank aborts the world as on the host transport.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/error.hpp"
#include "../device/group.hpp"
#include "../device/runtime.hpp"
#include "../device/transport.hpp"
#include "concept.hpp"
#include "mailbox.hpp"

namespace lockstep::transport {

namespace detail {

struct device_message {
  int src = -1;
  std::uint32_t tag = 0;
  const void* data = nullptr;
  std::size_t bytes = 0;
  device::event ready;     // on the sender's stream: the bytes are in place
  device::event consumed;  // on the receiver's stream: the last read of the bytes
  bool released = false;   // `consumed` has been recorded (guarded by the sender's box mutex)
};

// N ranks on one GPU share mailboxes of device messages (transport/mailbox.hpp).
using inproc_device_world = mailbox_world<device_message>;

}  // namespace detail

class inproc_device {
 public:
  struct request {
    std::shared_ptr<detail::device_message> msg;  // send: our posted message
    void* dst = nullptr;                          // recv: where to copy
    std::size_t bytes = 0;
    int peer = -1;
    std::uint32_t tag = 0;
    bool recv = false;
    bool done = false;
  };
  struct view {
    std::shared_ptr<detail::device_message> msg;
    const std::byte* data = nullptr;
    std::size_t bytes = 0;
  };

  inproc_device() = default;
  // Rank `rank` of `world`, enqueueing on `stream` (which must outlive the endpoint's groups).
  inproc_device(std::shared_ptr<detail::inproc_device_world> world, int rank, cudaStream_t stream)
      : world_(std::move(world)), rank_(rank), stream_(stream) {}

  static std::shared_ptr<detail::inproc_device_world> make_world(int n) {
    if (n < 1) throw error(errc::invalid_argument, "inproc_device", -1, -1, "world of " + std::to_string(n) + " ranks");
    return std::make_shared<detail::inproc_device_world>(n);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return world_ ? world_->size() : 0; }
  std::string name() const { return "inproc_device"; }
  cudaStream_t stream() const noexcept { return stream_; }
  void group_begin() noexcept {}
  void group_end() noexcept {}

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    check_peer(peer, "send");
    auto m = std::make_shared<detail::device_message>();
    m->src = rank_;
    m->tag = tag;
    m->data = data;
    m->bytes = bytes;
    m->ready.record(stream_);
    auto& b = world_->at(peer);
    {
      std::lock_guard lk(b.m);
      b.q.push_back(m);
    }
    b.cv.notify_all();
    return request{std::move(m), nullptr, bytes, peer, tag, false, false};
  }

  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    check_peer(peer, "recv");
    return request{nullptr, data, bytes, peer, tag, true, false};
  }

  // A receive copies from the sender's memory on this stream; a send orders this stream after the
  // receiver's last read. Either way the host waits only for the peer thread to get there.
  bool wait(request& r, clock::time_point deadline) {
    if (r.done) return true;
    if (r.recv) {
      view v = borrow(r.peer, r.tag, r.bytes, deadline);
      if (!v.data) return false;
      if (r.bytes) device::check(cudaMemcpyAsync(r.dst, v.data, r.bytes, cudaMemcpyDeviceToDevice, stream_), "inproc_device recv", rank_, r.peer);
      release(v);
      r.done = true;
      return true;
    }
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
    device::check(cudaStreamWaitEvent(stream_, r.msg->consumed.get(), 0), "inproc_device send", rank_, r.peer);
    r.done = true;
    return true;
  }

  // The next message from `peer` with `tag`; this stream is ordered after the sender's bytes.
  view borrow(int peer, std::uint32_t tag, std::size_t bytes, clock::time_point deadline) {
    check_peer(peer, "recv");
    auto& b = world_->at(rank_);
    std::shared_ptr<detail::device_message> m;
    auto take = [&] {
      m = detail::inproc_device_world::take(b, peer, tag);
      return m || world_->aborted();
    };
    {
      std::unique_lock lk(b.m);
      b.cv.wait_until(lk, deadline, take);
    }
    if (!m) {
      if (world_->aborted()) world_->throw_aborted("recv", rank_);
      return view{};
    }
    if (m->bytes != bytes) {
      const std::size_t got = m->bytes;
      view v{m, nullptr, 0};
      release(v);
      throw error(errc::mismatch, "recv", rank_, peer,
                  "expected a message of " + std::to_string(bytes) + " bytes, the peer sent " + std::to_string(got) +
                      " (tag " + std::to_string(tag) + ")");
    }
    device::check(cudaStreamWaitEvent(stream_, m->ready.get(), 0), "inproc_device borrow", rank_, peer);
    return view{m, static_cast<const std::byte*>(m->data), m->bytes};
  }

  void release(view& v) {
    if (v.msg) {
      v.msg->consumed.record(stream_);
      auto& sb = world_->at(v.msg->src);
      {
        std::lock_guard lk(sb.m);
        v.msg->released = true;
      }
      sb.cv.notify_all();
    }
    v = view{};
  }

  void abort(const std::string& reason) {
    if (world_) world_->abort(rank_, reason);
  }

 private:
  void check_peer(int peer, const char* op) const {
    if (!world_) throw error(errc::invalid_argument, op, rank_, peer, "endpoint not connected to a world");
    if (peer < 0 || peer >= size())
      throw error(errc::invalid_argument, op, rank_, peer, "peer out of range for a world of " + std::to_string(size()));
  }

  std::shared_ptr<detail::inproc_device_world> world_;
  int rank_ = 0;
  cudaStream_t stream_ = nullptr;
};

static_assert(device::borrowing_stream_transport<inproc_device>);

}  // namespace lockstep::transport

namespace lockstep {

// Runs n ranks on the current GPU, one host thread and one stream each: f(device::group<inproc_device>&)
// on each. Each rank's stream is synchronised before its thread ends (so asynchronous failures
// surface here); the first failure is rethrown after all threads end, a failing rank aborting
// the others' waits.
template <class F>
void run_inproc_device(int n, F&& f, group_options opt = {}) {
  auto world = transport::inproc_device::make_world(n);
  int dev = 0;
  device::check(cudaGetDevice(&dev), "cudaGetDevice");
  transport::detail::run_ranks(n, *world, [&](int r) {
    device::check(cudaSetDevice(dev), "cudaSetDevice", r);
    device::stream s;  // declared before the group: the group frees its scratch on it
    {
      device::group<transport::inproc_device> g(transport::inproc_device(world, r, s.get()), opt);
      f(g);
    }
    s.synchronize();
  });
}

}  // namespace lockstep
