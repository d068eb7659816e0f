// lockstep/collective/request.hpp: the handle of an asynchronous collective.
//
// wait() blocks until the collective finished on this rank and rethrows its error, if any;
// wait_for(d) gives up after d (false), ready() never blocks. Two kinds of call stand behind it:
//   - on a host group the collective runs on the group's worker thread, which enforces the group's
//     timeout on every message, so wait() cannot hang longer than that;
//   - on a stream-ordered group (a GPU stream, or space::deferred's host stream) the call only
//     enqueued the work: the request is an event recorded behind it, and wait() polls the event
//     for at most the group's timeout, then aborts the transport (so the peers stop waiting too)
//     and throws errc::timeout naming the collective. An error found while enqueueing (a peer
//     that never posted its side, a size mismatch) is kept and rethrown by wait(). While it
//     waits it polls the transport's asynchronous error (transport/concept.hpp, async_error:
//     NCCL's), which ends the wait at once as errc::transport: wait() then aborts the transport
//     and lets the stream finish what it holds (up to the timeout) before it throws; wait_for(d)
//     only throws it, and leaves the abort to its caller (which may hold a lock that an abort
//     must not run without: lockstep_torch's stream engine).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "../core/deadline.hpp"
#include "../core/error.hpp"

namespace lockstep {

namespace detail {

struct pending {
  virtual ~pending() = default;
  virtual bool ready() = 0;
  // true once done (the error, if any, is then rethrown); false when `deadline` came first.
  virtual bool wait_until(std::chrono::steady_clock::time_point deadline) = 0;
  virtual void wait() = 0;
};

// Finished by the host group's worker thread.
struct request_state final : pending {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lk(m);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
  bool ready() override {
    std::lock_guard lk(m);
    return done;
  }
  bool wait_until(std::chrono::steady_clock::time_point deadline) override {
    std::unique_lock lk(m);
    if (!cv.wait_until(lk, deadline, [&] { return done; })) return false;
    rethrow_once(lk);
    return true;
  }
  void wait() override {
    std::unique_lock lk(m);
    cv.wait(lk, [&] { return done; });
    rethrow_once(lk);
  }

 private:
  void rethrow_once(std::unique_lock<std::mutex>& lk) {
    if (error) {
      auto e = std::exchange(error, nullptr);
      lk.unlock();
      std::rethrow_exception(e);
    }
  }
};

// Done when the space's event recorded behind the call is reached.
template <class Space>
struct stream_request final : pending {
  typename Space::event done;
  std::exception_ptr error;  // thrown while enqueueing
  std::string label;
  int rank = -1;
  std::chrono::milliseconds timeout{0};
  std::function<void(const std::string&)> abort;
  // The transport's asynchronous error, or empty (transport/concept.hpp, async_error); may be null.
  std::function<std::string()> async_error;
  // Waits, up to a deadline, for what the stream still holds of this call and of earlier ones.
  std::function<void()> drain;
  bool async_failed = false;  // wait_until threw the transport's asynchronous error

  bool ready() override { return error || Space::ready(done); }
  bool wait_until(std::chrono::steady_clock::time_point deadline) override {
    // Back off from polling to sleeps of up to 1 ms: the stream's worker (space::deferred) or the
    // driver needs the core more than this thread does.
    auto sleep = std::chrono::microseconds(5);
    for (int polls = 0; !ready(); ++polls) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      if (polls < 64) {
        std::this_thread::yield();
        continue;
      }
      if (async_error) {
        if (std::string why = async_error(); !why.empty()) {
          async_failed = true;
          throw lockstep::error(errc::transport, label, rank, -1, why);
        }
      }
      std::this_thread::sleep_for(sleep = std::min(sleep * 2, std::chrono::microseconds(1000)));
    }
    if (error) std::rethrow_exception(std::exchange(error, nullptr));
    return true;
  }
  void wait() override {
    bool finished = false;
    try {
      finished = wait_until(deadline_after(timeout));
    } catch (const lockstep::error& e) {
      if (!async_failed) throw;
      // The transport failed under the stream: the abort tells the peers and ends the work stuck
      // on it (ncclCommAbort ends NCCL's kernels); then the stream finishes what it holds before
      // the error reaches code that may free the buffers that work writes (as group::submit does
      // when enqueueing fails).
      if (abort) abort(e.what());
      if (drain) drain();
      throw;
    }
    if (finished) return;
    const std::string why = "the stream did not finish within " + std::to_string(timeout.count()) +
                            " ms (a peer that never posted its side stalls the stream)";
    if (abort) abort(why);
    throw lockstep::error(errc::timeout, label, rank, -1, why);
  }
};

}  // namespace detail

class request {
 public:
  request() = default;
  explicit request(std::shared_ptr<detail::pending> s) : s_(std::move(s)) {}

  bool valid() const noexcept { return static_cast<bool>(s_); }
  bool ready() const { return !s_ || s_->ready(); }
  void wait() {
    if (s_) s_->wait();
  }
  // false if the collective is still running after `d`.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) {
    return !s_ || s_->wait_until(deadline_after(d));
  }

 private:
  std::shared_ptr<detail::pending> s_;
};

}  // namespace lockstep
