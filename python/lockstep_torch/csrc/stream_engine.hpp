// python/lockstep_torch/csrc/stream_engine.hpp: lockstep_torch's engine for buffers that live on
// a stream — CUDA buckets over NCCL (cuda_engine.cu), and the same code over inproc_deferred on the
// CPU, where tests/test_stream_engine.cpp runs it.
//
//   stream_engine<lockstep::group<transport::nccl>> e(std::move(group));
//   e.reduce_bucket(bucket, torch_stream, codec_kind::dyntree8, topology, bucket_index);
//
// A call enqueues and returns, as a CUDA collective of torch does: the engine's stream (the group's)
// waits for what the caller's stream has queued so far (the backward pass that wrote the bucket),
// the all-reduce is enqueued there, and the caller's stream waits for it, so whatever torch queues
// next on its stream (DDP's copy of the bucket into the gradients) reads the reduced values. The
// host never waits for the GPU in a call: the DDP hook's future can be complete at once.
//
// Timeouts. NCCL cannot time out a peer that never posts: the stream just stops. So every call's
// request goes to the engine's watcher thread, which waits for it within the group's timeout; past
// it the watcher aborts the group (which unblocks the stream), taking the call lock first so that
// no call is enqueueing on the communicator it frees. ProcessGroupNCCL's watchdog does the same. A
// failure that leaves the group unusable (a timeout, an abort, a transport error; not a local
// argument error) is sticky, as a CUDA error or an aborted communicator is: later calls throw at
// once with its message, and synchronize() rethrows it. The watcher starts by calling the
// engine's `on_thread` (the CUDA engine makes its GPU current there, so the thread's event queries
// and the abort touch no other device).
//
// Error feedback, per DDP bucket index, is bucket_table's (policies.hpp), the host engine's own: its
// residuals live in the group's space (device memory on a GPU) and move with a bucket that moved.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "policies.hpp"

namespace lockstep_torch {

template <class Group>
class stream_engine {
  static_assert(Group::ordered, "stream_engine needs a stream-ordered group (nccl, inproc_deferred, inproc_device)");

 public:
  using space_type = typename Group::space_type;
  using stream_handle = typename space_type::handle_type;

  explicit stream_engine(std::unique_ptr<Group> g, std::function<void()> on_thread = {}) : g_(std::move(g)) {
    if (!g_) throw ls::error(ls::errc::invalid_argument, "lockstep_torch", -1, -1, "stream_engine without a group");
    watcher_ = std::thread([this, on_thread = std::move(on_thread)] {
      if (on_thread) on_thread();
      watch();
    });
  }
  stream_engine(const stream_engine&) = delete;
  stream_engine& operator=(const stream_engine&) = delete;
  // Waits for what is pending (each within the group's timeout), then stops the watcher.
  ~stream_engine() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    watcher_.join();
  }

  int rank() const { return g_->rank(); }
  int size() const { return g_->size(); }
  std::string name() const { return g_->name(); }

  // Reduces `buf` in place (sum or average), in the caller's stream order.
  void all_reduce(std::span<float> buf, stream_handle caller, codec_kind ck, const topology_spec& ts, ls::reduce_op op) {
    enqueue(caller, "all_reduce", [&] {
      ls::request r;
      with_topology(ts, [&](const auto& topo) {
        codecs_.with(ck, [&](auto& c) { r = ls::all_reduce_async(*g_, buf, topo, c, op); });
      });
      return r;
    });
  }

  // Averages DDP bucket `buf` in the caller's stream order. bucket_index < 0: no error feedback
  // (DDP's first iteration, whose buckets it rebuilds after).
  void reduce_bucket(std::span<float> buf, stream_handle caller, codec_kind ck, const topology_spec& ts, int bucket_index) {
    enqueue(caller, "allreduce_hook", [&] {
      // Under the call lock: reset_buckets() cannot drop this state while the call uses it.
      bucket_state* bs =
          bucket_index >= 0 && ck != codec_kind::fp32 ? buckets_.bucket(bucket_index, ck, buf.size(), rank()) : nullptr;
      ls::request r;
      with_topology(ts, [&](const auto& topo) {
        auto run = [&](auto& c) { r = ls::all_reduce_async(*g_, buf, topo, c, ls::reduce_op::average); };
        if (bs) bucket_table::with_feedback(*g_, *bs, buf, run);
        else codecs_.with(ck, run);
      });
      return r;
    });
  }

  // Waits until everything enqueued so far has finished (each call within the group's timeout);
  // rethrows the first failure.
  void synchronize() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return pending_.empty(); });
    throw_if_failed_locked();
  }

  // The sticky failure, empty while the engine is healthy.
  std::string failure() {
    std::lock_guard lk(m_);
    return failure_;
  }

  std::map<int, std::size_t> buckets() { return buckets_.counts(); }
  void reset_buckets() {
    synchronize();
    std::lock_guard call(call_m_);
    buckets_.clear();  // residual memory is freed in stream order, behind the work that used it
  }

 private:
  struct pending_call {
    ls::request r;
    std::string label;
  };

  // Orders the group's stream after the caller's, runs `body` (it enqueues, returning the call's
  // request), orders the caller's stream after it, and hands the request to the watcher. A call
  // that fails while enqueueing throws here; the group drained what it had queued first.
  template <class F>
  void enqueue(stream_handle caller, const char* label, F&& body) {
    std::lock_guard call(call_m_);  // callers on several threads: one call's events at a time
    {
      std::lock_guard lk(m_);
      throw_if_failed_locked();
    }
    space_type caller_space(caller);
    typename space_type::event ready, done;
    caller_space.record(ready);
    g_->space().wait(ready);
    ls::request r;
    try {
      r = body();
      if (r.ready()) r.wait();  // failed while enqueueing (or already done): throws what it threw
    } catch (const ls::error& e) {
      // A local mistake (a resized bucket, a bad name) leaves the group as it was; anything else
      // (a timeout, an abort, a transport error) does not, and every later call says so.
      if (e.code() != ls::errc::invalid_argument) {
        std::lock_guard lk(m_);
        if (failure_.empty()) failure_ = std::string(label) + ": " + e.what();
      }
      throw;
    }
    g_->space().record(done);
    caller_space.wait(done);
    {
      std::lock_guard lk(m_);
      pending_.push_back({std::move(r), label});
    }
    cv_.notify_all();
  }

  void watch() {
    std::unique_lock lk(m_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, with nothing left to watch
      pending_call& p = pending_.front();  // (push_back leaves it where it is)
      const bool failed = !failure_.empty();
      lk.unlock();
      std::string why;
      try {
        // After a failure the group is aborted: what is still pending ends soon or never, and is
        // not waited for a whole timeout each.
        if (failed) {
          p.r.wait_for(std::chrono::milliseconds(100));
        } else if (!p.r.wait_for(g_->options().timeout)) {
          why = ls::error(ls::errc::timeout, p.label, g_->rank(), -1,
                          "the stream did not finish the call within " + std::to_string(g_->options().timeout.count()) +
                              " ms (a peer that never posted its side stalls it); the group was aborted")
                    .what();
          std::lock_guard call(call_m_);  // no call is enqueueing on what the abort frees
          g_->abort(why);
        }
      } catch (const std::exception& e) {
        // The call's own error, or the transport's asynchronous one (request.hpp: wait_for
        // reports it and leaves the abort to us): the group is aborted as for a timeout.
        why = e.what();
        std::lock_guard call(call_m_);
        g_->abort(why);
      }
      lk.lock();
      if (!why.empty() && failure_.empty()) failure_ = p.label + ": " + why;
      pending_.pop_front();
      cv_.notify_all();
    }
  }

  void throw_if_failed_locked() const {
    if (!failure_.empty())
      throw ls::error(ls::errc::aborted, "lockstep_torch", g_->rank(), -1,
                      "an earlier reduction on this engine failed, and its group cannot be used again: " + failure_);
  }

  std::unique_ptr<Group> g_;
  codecs codecs_;
  bucket_table buckets_;
  std::mutex call_m_;  // one enqueue at a time
  std::mutex m_;       // pending_, failure_, stop_
  std::condition_variable cv_;
  std::deque<pending_call> pending_;
  std::string failure_;
  bool stop_ = false;
  std::thread watcher_;
};

}  // namespace lockstep_torch
