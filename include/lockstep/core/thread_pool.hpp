// lockstep/core/thread_pool.hpp: a small pool of threads for host kernels (optimizer sweeps).
//
//   lockstep::thread_pool pool(4);                     // 3 workers + the calling thread
//   pool.parallel_for(tasks, [&](std::size_t i) { ... });
//
// parallel_for(n, f) runs f(0) .. f(n-1) and returns when all have run; the calling thread takes
// tasks too, so a pool of one thread is a plain loop and a nested call cannot deadlock. Several
// threads may call parallel_for on one pool at once (ranks run as threads of one process share the
// process-wide pool): each call is a job in a queue, and workers help the oldest job that still
// has tasks left. The first exception a task throws is rethrown by parallel_for once every
// task has ended; the tasks not yet started are skipped.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace lockstep {

class thread_pool {
 public:
  // threads: how many threads run tasks, the caller included; 0 means one per hardware thread.
  explicit thread_pool(unsigned threads = 0) {
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    workers_.reserve(threads - 1);
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // Threads that run tasks, the caller included.
  unsigned size() const noexcept { return static_cast<unsigned>(workers_.size()) + 1; }

  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    if (n == 0) return;
    using fn_t = std::remove_reference_t<F>;
    if (n == 1 || workers_.empty()) {
      for (std::size_t i = 0; i < n; ++i) f(i);
      return;
    }
    job j;
    j.n = n;
    j.ctx = const_cast<void*>(static_cast<const void*>(&f));
    j.run = [](void* ctx, std::size_t i) { (*static_cast<fn_t*>(ctx))(i); };
    {
      std::lock_guard lk(m_);
      jobs_.push_back(&j);
    }
    // Wake no more workers than there are tasks for.
    if (n - 1 >= workers_.size()) wake_.notify_all();
    else for (std::size_t i = 0; i + 1 < n; ++i) wake_.notify_one();
    j.drain();
    std::unique_lock lk(m_);
    retire(&j);
    // Every task has been claimed; wait for workers still inside one of ours.
    done_.wait(lk, [&] { return j.helpers == 0; });
    lk.unlock();
    if (j.err) std::rethrow_exception(j.err);
  }

  // The process-wide pool, one thread per hardware thread; built on first use.
  static thread_pool& shared() {
    static thread_pool pool;
    return pool;
  }

 private:
  struct job {
    void (*run)(void*, std::size_t) = nullptr;
    void* ctx = nullptr;
    std::size_t n = 0;
    std::atomic<std::size_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr err;  // written once, by the thread that set `failed`
    std::size_t helpers = 0;  // workers inside this job; guarded by the pool's mutex

    void drain() noexcept {
      for (std::size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        if (failed.load(std::memory_order_relaxed)) continue;
        try {
          run(ctx, i);
        } catch (...) {
          if (!failed.exchange(true)) err = std::current_exception();
        }
      }
    }
  };

  void retire(job* j) {  // with m_ held
    auto it = std::find(jobs_.begin(), jobs_.end(), j);
    if (it != jobs_.end()) jobs_.erase(it);
  }

  void work() {
    std::unique_lock lk(m_);
    for (;;) {
      wake_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job* j = jobs_.front();
      ++j->helpers;
      lk.unlock();
      j->drain();
      lk.lock();
      // All of j's tasks are claimed: it stays off the queue so nobody else joins it.
      retire(j);
      if (--j->helpers == 0) done_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable wake_, done_;
  std::deque<job*> jobs_;  // open jobs, oldest first; each lives on its caller's stack
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace lockstep
