// lockstep/collective/group.hpp: a group of ranks over a transport, and the order its collectives
// run in.
//
// Collectives on one group run one at a time and in call order on every rank (that order is what
// matches them across ranks). A blocking call with nothing queued runs on the caller's thread; an
// asynchronous call, or a blocking call behind one, runs on the group's worker thread, so backward
// can go on while gradients travel. Each group owns the scratch memory its collectives encode into.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../core/error.hpp"
#include "../transport/concept.hpp"
#include "request.hpp"

namespace lockstep {

struct group_options {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // every blocking wait
  std::size_t segment_bytes = 0;  // pipelining unit of large buffers; 0: the transport's choice
};

template <transport::transport T>
class group {
 public:
  using transport_type = T;

  explicit group(T t, group_options opt = {}) : s_(std::make_shared<state>(std::move(t), opt)) {}

  int rank() const noexcept { return s_->t.rank(); }
  int size() const noexcept { return s_->t.size(); }
  const group_options& options() const noexcept { return s_->opt; }
  // The segment collectives pipeline large buffers in: the option, else the transport's choice.
  std::size_t segment_bytes() const noexcept { return s_->opt.segment_bytes ? s_->opt.segment_bytes : T::segment_bytes; }
  T& transport() noexcept { return s_->t; }
  std::string name() const { return s_->t.name(); }

  // Collective over this group, like MPI_Comm_split: ranks of equal colour form a new group,
  // ordered by (key, rank). Runs after everything already queued on this group.
  group split(int color, int key) {
    group out{T{}, s_->opt};
    run([&] { out = group(s_->t.split(color, key, deadline()), s_->opt); });
    return out;
  }

  transport::clock::time_point deadline() const { return transport::clock::now() + s_->opt.timeout; }

  // Runs `fn` in this group's order: inline when nothing is queued, else after the queue drains.
  // A collective called from inside another's epilogue (LARS all-reducing its norms, say) runs
  // nested, at once, with scratch memory of its own.
  template <class F>
  void run(F&& fn) {
    if (s_->runner.load() == std::this_thread::get_id()) {
      ++s_->depth;
      struct pop {
        state* s;
        ~pop() { --s->depth; }
      } guard{s_.get()};
      fn();
      return;
    }
    std::unique_lock lk(s_->m);
    if (!s_->busy && s_->q.empty()) {
      s_->busy = true;
      s_->runner = std::this_thread::get_id();
      lk.unlock();
      struct idle_on_exit {
        state* s;
        ~idle_on_exit() {
          {
            std::lock_guard g(s->m);
            s->busy = false;
            s->runner = std::thread::id{};
          }
          s->cv.notify_all();
        }
      } guard{s_.get()};
      fn();
      return;
    }
    lk.unlock();
    submit(std::function<void()>(std::forward<F>(fn))).wait();
  }

  // Queues `fn` on the worker thread; the request completes when it has run.
  request submit(std::function<void()> fn) {
    auto st = std::make_shared<detail::request_state>();
    {
      std::lock_guard lk(s_->m);
      s_->q.push_back({std::move(fn), st});
      if (!s_->worker.joinable()) s_->worker = std::thread([s = s_.get()] { s->loop(); });
    }
    s_->cv.notify_all();
    return request(st);
  }

  // Bump-allocated scratch that lives as long as the group; valid until the next call.
  // One buffer per nesting depth, 64-byte aligned.
  std::byte* scratch(std::size_t bytes) {
    auto& v = s_->scratch[std::min<std::size_t>(s_->depth, s_->scratch.size() - 1)];
    if (v.size() < bytes + 64) v.assign(bytes + 64, std::byte{0});
    auto p = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + ((64 - (p & 63)) & 63);
  }
  std::uint64_t next_sequence() noexcept { return s_->seq++; }

 private:
  struct task {
    std::function<void()> fn;
    std::shared_ptr<detail::request_state> st;
  };
  struct state {
    state(T tr, group_options o) : t(std::move(tr)), opt(o) {}
    ~state() {
      {
        std::lock_guard lk(m);
        stop = true;
      }
      cv.notify_all();
      if (worker.joinable()) worker.join();
    }
    void loop() {
      std::unique_lock lk(m);
      for (;;) {
        cv.wait(lk, [&] { return stop || (!q.empty() && !busy); });
        if (q.empty()) return;
        task tk = std::move(q.front());
        q.pop_front();
        busy = true;
        runner = std::this_thread::get_id();
        lk.unlock();
        std::exception_ptr e;
        try {
          tk.fn();
        } catch (...) {
          e = std::current_exception();
        }
        tk.st->finish(e);
        lk.lock();
        busy = false;
        runner = std::thread::id{};
        cv.notify_all();
      }
    }

    T t;
    group_options opt;
    std::mutex m;
    std::condition_variable cv;
    std::deque<task> q;
    bool busy = false, stop = false;
    std::thread worker;
    std::atomic<std::thread::id> runner{};
    std::size_t depth = 0;
    std::array<std::vector<std::byte>, 4> scratch;
    std::uint64_t seq = 0;
  };

  std::shared_ptr<state> s_;
};

}  // namespace lockstep
