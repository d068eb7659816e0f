// lockstep/transport/mailbox.hpp: what the in-process transports share — one mailbox per rank
// holding the sends posted to it, and an abort flag that wakes every waiter of the world.
//
// A sender posts a message (its own type: host pointer, or device pointer plus events) into the
// receiver's mailbox and waits on its own mailbox for the receiver to be done with it; a receiver
// waits on its own mailbox for a message from (peer, tag). abort() records the first failing
// rank's reason and wakes everyone, who then throw errc::aborted with that reason.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/error.hpp"

namespace lockstep::transport::detail {

template <class Message>
class mailbox_world {
 public:
  struct box {
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::shared_ptr<Message>> q;  // posted sends addressed to this rank
  };

  explicit mailbox_world(int n) : boxes_(static_cast<std::size_t>(n)) {
    for (auto& b : boxes_) b = std::make_unique<box>();
  }
  int size() const noexcept { return static_cast<int>(boxes_.size()); }
  box& at(int r) { return *boxes_[static_cast<std::size_t>(r)]; }

  // Removes and returns the oldest message from `src` with `tag` in box `b` (lock held), or null.
  static std::shared_ptr<Message> take(box& b, int src, std::uint32_t tag) {
    for (auto it = b.q.begin(); it != b.q.end(); ++it)
      if ((*it)->src == src && (*it)->tag == tag) {
        auto m = *it;
        b.q.erase(it);
        return m;
      }
    return nullptr;
  }

  void abort(int rank, const std::string& reason) {
    {
      std::lock_guard lk(abort_m_);
      if (aborted_.load()) return;
      abort_rank_ = rank;
      abort_reason_ = reason;
      aborted_.store(true);
    }
    for (auto& b : boxes_) {
      std::lock_guard lk(b->m);
      b->cv.notify_all();
    }
  }
  bool aborted() const noexcept { return aborted_.load(std::memory_order_relaxed); }
  [[noreturn]] void throw_aborted(const char* op, int rank) {
    std::lock_guard lk(abort_m_);
    throw error(errc::aborted, op, rank, abort_rank_,
                "rank " + std::to_string(abort_rank_) + " failed: " + abort_reason_);
  }

 private:
  std::vector<std::unique_ptr<box>> boxes_;
  std::mutex abort_m_;
  std::atomic<bool> aborted_{false};
  int abort_rank_ = -1;
  std::string abort_reason_;
};

// Runs body(r) for r in [0, n) on a thread each. A rank that throws aborts `world`, so the others
// leave their waits at once; after every thread has ended, the first real failure is rethrown
// (or, if every failure was a consequence of another, the first errc::aborted).
template <class World, class Body>
void run_ranks(int n, World& world, Body body) {
  std::mutex m;
  std::exception_ptr first, first_aborted;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const error& e) {
        world.abort(r, e.what());
        std::lock_guard lk(m);
        auto& slot = e.code() == errc::aborted ? first_aborted : first;
        if (!slot) slot = std::current_exception();
      } catch (const std::exception& e) {
        world.abort(r, e.what());
        std::lock_guard lk(m);
        if (!first) first = std::current_exception();
      } catch (...) {
        world.abort(r, "unknown exception");
        std::lock_guard lk(m);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  if (first_aborted) std::rethrow_exception(first_aborted);
}

}  // namespace lockstep::transport::detail
