// lockstep/collective/group.hpp: a group of ranks over a transport, and the order its collectives
// run in. One group for every transport; what differs is the transport's execution space:
//
//   host transports (inproc, mpi)   the work is done by the thread that runs the collective. A
//                                   blocking call with nothing queued runs on the caller's thread;
//                                   an asynchronous call, or a blocking call behind one, runs on the
//                                   group's worker thread, so backward goes on while gradients travel.
//   stream-ordered transports       the work is enqueued on the transport's stream and the call
//   (inproc_device, nccl,           returns; the stream is the queue, so there is no worker: an
//    inproc_deferred)               asynchronous call's request is an event recorded behind it.
//
// Either way collectives on one group run one at a time and in call order on every rank (that order
// is what matches them across ranks). Each group owns the scratch memory its collectives encode into,
// in its space, one buffer per nesting depth: a collective called from another's epilogue (LARS
// all-reducing norms, say) runs at once, inside it, with scratch of its own.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#if defined(__GLIBCXX__)
#include <cxxabi.h>  // abi::__forced_unwind
#endif

#include "../core/deadline.hpp"
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
  using space_type = transport::space_of<T>;
  static constexpr bool ordered = space_type::ordered;

  explicit group(T t, group_options opt = {}) : s_(std::make_shared<state>(std::move(t), opt)) {}

  int rank() const noexcept { return s_->t.rank(); }
  int size() const noexcept { return s_->t.size(); }
  const group_options& options() const noexcept { return s_->opt; }
  // The segment collectives pipeline large buffers in: the option, else the transport's choice
  // (a stream-ordered transport's is a whole chunk, and no option cuts it).
  std::size_t segment_bytes() const noexcept {
    if constexpr (ordered) return T::segment_bytes;
    return s_->opt.segment_bytes ? s_->opt.segment_bytes : T::segment_bytes;
  }
  T& transport() noexcept { return s_->t; }
  space_type& space() noexcept { return s_->space; }
  std::string name() const { return s_->t.name(); }
  // The stream an ordered group's work is enqueued on.
  auto stream() const noexcept
    requires ordered
  {
    return s_->t.stream();
  }

  // Collective over this group, like MPI_Comm_split: ranks of equal colour form a new group,
  // ordered by (key, rank). Runs after everything already queued on this group.
  group split(int color, int key)
    requires transport::splittable<T>
  {
    group out{T{}, s_->opt};
    run([&] { out = group(s_->t.split(color, key, deadline()), s_->opt); });
    return out;
  }

  // A new group of this group's ranks except `gone`, collective over those ranks alone: the
  // survivors' way on after a failure (this group stays failed). New ranks keep the old order.
  // Where the transport can build one (mpi: transport/mpi_p2p.hpp, without_failed).
  group without(const std::vector<int>& gone)
    requires requires(T& t, const std::vector<int>& m, transport::clock::time_point d) {
      { t.without_failed(m, d) } -> std::same_as<T>;
    }
  {
    std::vector<int> members;
    for (int r = 0; r < size(); ++r)
      if (std::find(gone.begin(), gone.end(), r) == gone.end()) members.push_back(r);
    return group(s_->t.without_failed(members, deadline()), s_->opt);
  }

  // Tells every rank of the group that this one failed (a failure outside a collective: a
  // program's own error, caught at its top): their waits throw errc::aborted naming this rank and
  // `reason`, and so do this rank's later calls. A collective that fails does this itself. The
  // groups split from the same first group as this one fail with it (docs/reliability.md, "Every
  // group of a rank").
  void abort(const std::string& reason) { s_->t.abort(reason); }

  transport::clock::time_point deadline() const { return deadline_after(s_->opt.timeout); }

  // Runs `fn` in this group's order: inline when nothing is queued, else after the queue drains.
  // Called from inside a running collective (its epilogue), `fn` runs nested, at once.
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
    if constexpr (ordered) {
      // Enqueueing is the whole call: callers on several threads take turns.
      s_->cv.wait(lk, [&] { return !s_->busy; });
    } else if (s_->busy || !s_->q.empty()) {
      lk.unlock();
      submit(std::function<void()>(std::forward<F>(fn)), "collective").wait();
      return;
    }
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
  }

  // The asynchronous form of run: host groups queue `fn` on the worker thread and the request
  // completes when it has run; ordered groups run `fn` now (it only enqueues) and the request is
  // an event behind its work. `label` names the call in a timeout.
  request submit(std::function<void()> fn, std::string label) {
    if constexpr (ordered) {
      auto st = std::make_shared<detail::stream_request<space_type>>();
      try {
        run(fn);
      } catch (...) {
        st->error = std::current_exception();
        // What was queued before the failure still reads and writes the caller's buffers: let it
        // finish before the error can reach code that frees them.
        s_->space.drain(deadline());
      }
      s_->space.record(st->done);
      st->label = std::move(label);
      st->rank = rank();
      st->timeout = s_->opt.timeout;
      st->abort = [s = s_](const std::string& why) { s->t.abort(why); };
      st->drain = [s = s_] { s->space.drain(deadline_after(s->opt.timeout)); };
      if constexpr (requires(T& t) { { t.async_error() } -> std::convertible_to<std::string>; })
        st->async_error = [s = s_] { return std::string(s->t.async_error()); };
      return request(st);
    } else {
      auto st = std::make_shared<detail::request_state>();
      {
        std::lock_guard lk(s_->m);
        s_->q.push_back({std::move(fn), st});
        if (!s_->worker.joinable()) s_->worker = std::thread([s = s_.get()] { s->loop(); });
      }
      s_->cv.notify_all();
      return request(st);
    }
  }

  // Scratch of at least `bytes` in the group's space, 64-byte aligned, valid until the next
  // collective at the same nesting depth. Grown by a quarter more than asked, so buckets of
  // slightly different sizes do not reallocate every call (on a stream, the old buffer is freed
  // behind the work that still uses it).
  std::byte* scratch(std::size_t bytes) {
    auto& all = s_->scratch;
    while (all.size() <= s_->depth) all.emplace_back();
    auto& m = all[s_->depth];
    if (m.size() < bytes) m = s_->space.allocate(bytes + bytes / 4);
    return m.data();
  }
  std::size_t depth() const noexcept { return s_->depth; }
  std::uint64_t next_sequence() noexcept { return s_->seq++; }

 private:
  struct task {
    std::function<void()> fn;
    std::shared_ptr<detail::request_state> st;
  };
  using memory = typename space_type::memory;
  static space_type make_space(T& t) {
    if constexpr (ordered) return space_type(t.stream());
    else return space_type{};
  }
  struct state {
    state(T tr, group_options o) : t(std::move(tr)), opt(o), space(make_space(t)) {}
    ~state() {
      std::deque<task> orphans;
      {
        std::lock_guard lk(m);
        stop = true;
        if (worker.joinable() && worker.get_id() == std::this_thread::get_id()) orphans.swap(q);
      }
      cv.notify_all();
      if (!worker.joinable()) return;
      if (worker.get_id() == std::this_thread::get_id()) {
        // The last reference went with a task this worker ran (a completion callback that drops
        // its group): the worker cannot join itself. It leaves its loop without touching this
        // state again (loop_gone) and ends on its own. Calls queued behind that task will never
        // run: their requests fail now rather than wait for ever.
        for (task& t : orphans)
          t.st->finish(std::make_exception_ptr(
              error(errc::aborted, "group", -1, -1, "the group was destroyed (its last reference dropped by a call it ran) before this call ran")));
        if (loop_gone) *loop_gone = true;
        worker.detach();
      } else {
        worker.join();
      }
    }
    void loop() {
      bool gone = false;
      std::unique_lock lk(m);
      loop_gone = &gone;
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
#if defined(__GLIBCXX__)
        } catch (abi::__forced_unwind&) {
          // The thread is being cancelled or is exiting (pthread_exit: an interpreter that
          // finalises while a task waits for its lock): that unwind must go on, or the process
          // aborts. The task is left undestroyed: its captures may need that interpreter to die
          // (a Python callable), and a second exit inside a destructor mid-unwind terminates.
          (void)new task(std::move(tk));
          throw;
#endif
        } catch (...) {
          e = std::current_exception();
        }
        tk.st->finish(e);
        // The task's captures go now, with the lock free: dropping the last reference to this
        // group here destroys this state (see ~state), after which nothing of it may be touched.
        tk = task{};
        if (gone) return;
        lk.lock();
        busy = false;
        runner = std::thread::id{};
        cv.notify_all();
      }
    }

    T t;
    group_options opt;
    space_type space;
    std::mutex m;
    std::condition_variable cv;
    std::deque<task> q;
    bool busy = false, stop = false;
    std::thread worker;
    bool* loop_gone = nullptr;  // the worker's flag: this state was destroyed on the worker itself
    std::atomic<std::thread::id> runner{};
    std::size_t depth = 0;
    std::deque<memory> scratch;  // (nesting depth)
    std::uint64_t seq = 0;
  };

  std::shared_ptr<state> s_;
};

}  // namespace lockstep
