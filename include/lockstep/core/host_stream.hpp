// lockstep/core/host_stream.hpp: a CUDA stream's semantics on the CPU — a queue of work run in
// order by a thread of its own, events recorded into it, and waits of one stream on another's
// event — so the stream-ordered path the GPU takes runs, and is tested, on machines without one.
//
//   host_stream s;                 // a worker thread; work runs in enqueue order
//   s.enqueue([] { ... });         // returns at once (cudaLaunchKernel, cudaMemcpyAsync)
//   host_event e; e.record(s);     // completes when s reaches this point (cudaEventRecord)
//   e.ready();                     // cudaEventQuery: never blocks
//   e.wait_on(t);                  // t's later work waits for that point (cudaStreamWaitEvent)
//   s.synchronize(deadline);       // cudaStreamSynchronize, bounded
//
// As on a GPU, an error is sticky: work that throws (or a stream-side wait that runs past its
// bound) puts the stream in error, later work is skipped, and every query rethrows that error,
// the way cudaEventQuery reports an earlier kernel's fault. A stream-side wait is bounded by the
// stream's `wait_limit` so a peer that never records cannot park a worker thread for ever.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "deadline.hpp"
#include "error.hpp"

namespace lockstep {

class host_stream {
 public:
  explicit host_stream(std::chrono::milliseconds wait_limit = std::chrono::minutes(5))
      : s_(std::make_shared<state>()), limit_(wait_limit) {
    s_->worker = std::thread([s = s_.get()] { s->loop(); });
  }
  host_stream(const host_stream&) = delete;
  host_stream& operator=(const host_stream&) = delete;
  // Drains what is queued, as cudaStreamDestroy lets pending work finish.
  ~host_stream() {
    {
      std::lock_guard lk(s_->m);
      s_->stop = true;
    }
    s_->cv.notify_all();
    s_->worker.join();
  }

  // `always`: runs even once the stream is in error (event records: a failed stream still reaches
  // its events, so nothing waits on it for ever; the error travels with every query instead).
  void enqueue(std::function<void()> fn, bool always = false) {
    {
      std::lock_guard lk(s_->m);
      s_->q.push_back({std::move(fn), always});
      ++s_->enqueued;
    }
    s_->cv.notify_all();
  }

  // Waits until everything enqueued so far has run; false when the deadline passed first.
  // Rethrows the stream's sticky error.
  bool synchronize(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lk(s_->m);
    const std::uint64_t target = s_->enqueued;
    const bool done = s_->cv.wait_until(lk, deadline, [&] { return s_->completed >= target; });
    if (s_->failure) std::rethrow_exception(s_->failure);
    return done;
  }
  void synchronize() {
    if (!synchronize(deadline_after(limit_)))
      throw error(errc::timeout, "host_stream", -1, -1, "work did not finish within the stream's wait limit");
  }
  // The sticky error, if any (cudaStreamQuery / cudaGetLastError).
  void rethrow_if_failed() const {
    std::lock_guard lk(s_->m);
    if (s_->failure) std::rethrow_exception(s_->failure);
  }
  std::chrono::milliseconds wait_limit() const noexcept { return limit_; }

 private:
  struct state;

 public:
  // Runs `fn` behind the work queued so far while the stream exists, else at once: memory freed in
  // stream order (space::deferred) may outlive its stream this way.
  class weak_ref {
   public:
    weak_ref() = default;
    void enqueue_or_run(std::function<void()> fn) const {
      if (auto s = s_.lock()) {
        std::lock_guard lk(s->m);
        if (!s->stop) {
          s->q.push_back({std::move(fn), true});
          ++s->enqueued;
          s->cv.notify_all();
          return;
        }
      }
      fn();
    }

   private:
    friend class host_stream;
    std::weak_ptr<state> s_;
  };
  weak_ref weak() const {
    weak_ref w;
    w.s_ = s_;
    return w;
  }

 private:
  friend class host_event;
  struct state {
    std::mutex m;
    std::condition_variable cv;
    struct task {
      std::function<void()> fn;
      bool always;
    };
    std::deque<task> q;
    std::uint64_t enqueued = 0, completed = 0;
    bool stop = false;
    std::exception_ptr failure;
    std::thread worker;

    void loop() {
      std::unique_lock lk(m);
      for (;;) {
        cv.wait(lk, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        auto [fn, always] = std::move(q.front());
        q.pop_front();
        const bool skip = failure && !always;
        lk.unlock();
        std::exception_ptr e;
        if (!skip) {
          try {
            fn();
          } catch (...) {
            e = std::current_exception();
          }
        }
        fn = nullptr;  // captured buffers are freed here, in stream order
        lk.lock();
        if (e && !failure) failure = e;
        ++completed;
        cv.notify_all();
      }
    }
  };
  std::shared_ptr<state> s_;
  std::chrono::milliseconds limit_;
};

class host_event {
 public:
  host_event() : s_(std::make_shared<state>()) {}

  // The event completes when `s` has run everything enqueued before this call.
  void record(host_stream& s) {
    std::uint64_t gen;
    {
      std::lock_guard lk(s_->m);
      gen = ++s_->recorded;
      s_->stream = s.s_;
    }
    s.enqueue(
        [st = s_, gen] {
          {
            std::lock_guard lk(st->m);
            if (st->reached < gen) st->reached = gen;
          }
          st->cv.notify_all();
        },
        true);
  }

  // true once the last record() has been reached; rethrows the recording stream's sticky error.
  bool ready() const {
    std::shared_ptr<host_stream::state> s;
    bool reached;
    {
      std::lock_guard lk(s_->m);
      s = s_->stream.lock();
      reached = s_->reached >= s_->recorded;
    }
    if (s) {
      std::lock_guard lk(s->m);
      if (s->failure) std::rethrow_exception(s->failure);
    }
    return reached;
  }

  // Work enqueued on `t` after this call runs only once the last record() has been reached.
  void wait_on(host_stream& t) const {
    std::uint64_t gen;
    {
      std::lock_guard lk(s_->m);
      gen = s_->recorded;
    }
    t.enqueue([st = s_, gen, limit = t.wait_limit()] {
      std::unique_lock lk(st->m);
      if (!st->cv.wait_until(lk, deadline_after(limit), [&] { return st->reached >= gen; }))
        throw error(errc::timeout, "host_stream", -1, -1,
                    "a stream waited " + std::to_string(limit.count()) + " ms for an event of another stream");
    });
  }

 private:
  struct state {
    std::mutex m;
    std::condition_variable cv;
    std::uint64_t recorded = 0, reached = 0;
    std::weak_ptr<host_stream::state> stream;  // of the last record()
  };
  std::shared_ptr<state> s_;
};

}  // namespace lockstep
