// lockstep/collective/request.hpp: the handle of an asynchronous collective.
//
// wait() blocks until the collective finished on this rank and rethrows its error, if any. The
// collective itself enforces the group's timeout on every message, so wait() cannot hang longer
// than that; wait_for() adds a caller-side bound on top.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

namespace lockstep {

namespace detail {
struct request_state {
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
};
}  // namespace detail

class request {
 public:
  request() = default;
  explicit request(std::shared_ptr<detail::request_state> s) : s_(std::move(s)) {}

  bool valid() const noexcept { return static_cast<bool>(s_); }
  bool ready() const {
    if (!s_) return true;
    std::lock_guard lk(s_->m);
    return s_->done;
  }
  void wait() {
    if (!s_) return;
    std::unique_lock lk(s_->m);
    s_->cv.wait(lk, [&] { return s_->done; });
    rethrow_once(lk);
  }
  // false if the collective is still running after `d`.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) {
    if (!s_) return true;
    std::unique_lock lk(s_->m);
    if (!s_->cv.wait_for(lk, d, [&] { return s_->done; })) return false;
    rethrow_once(lk);
    return true;
  }

 private:
  void rethrow_once(std::unique_lock<std::mutex>& lk) {
    if (s_->error) {
      auto e = std::exchange(s_->error, nullptr);
      lk.unlock();
      std::rethrow_exception(e);
    }
  }
  std::shared_ptr<detail::request_state> s_;
};

}  // namespace lockstep
