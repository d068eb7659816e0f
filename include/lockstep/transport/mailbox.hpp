// lockstep/transport/mailbox.hpp: what the in-process transports share — one mailbox per rank
// holding the sends posted to it, and an abort flag that wakes every waiter of the world.
//
// A sender posts a message (its own type: host pointer, or device pointer plus events) into the
// receiver's mailbox and waits on its own mailbox for the receiver to be done with it; a receiver
// waits on its own mailbox for a message from (peer, tag). abort() records the first failing
// rank's reason and wakes everyone, who then throw errc::aborted with that reason.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
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

  // Rank `rank` of this world failed; true when this call was the first failure.
  bool abort(int rank, const std::string& reason) { return abort_as(rank, "rank " + std::to_string(rank) + " failed: " + reason); }
  // Fails the world with the error its waiters throw: errc::aborted, peer `peer` (-1: no rank of
  // this world), `detail`. For a failure this world hears of from another (inproc.hpp: the groups
  // split from one parent fail together).
  bool abort_as(int peer, std::string detail) {
    {
      std::lock_guard lk(abort_m_);
      if (aborted_.load()) return false;
      abort_rank_ = peer;
      abort_detail_ = std::move(detail);
      aborted_.store(true);
    }
    for (auto& b : boxes_) {
      std::lock_guard lk(b->m);
      b->cv.notify_all();
    }
    return true;
  }
  bool aborted() const noexcept { return aborted_.load(std::memory_order_relaxed); }
  [[noreturn]] void throw_aborted(const char* op, int rank) {
    std::lock_guard lk(abort_m_);
    throw error(errc::aborted, op, rank, abort_rank_, abort_detail_);
  }

 private:
  std::vector<std::unique_ptr<box>> boxes_;
  std::mutex abort_m_;
  std::atomic<bool> aborted_{false};
  int abort_rank_ = -1;
  std::string abort_detail_;
};

// A posted send or receive of an in-process transport; move-only. A send that is destroyed before
// it completed (its collective failed) settles before the sender's memory can go: a message the
// peer has not taken is withdrawn from its mailbox, and for one the peer is reading this waits
// (bounded: reading takes no waiting of its own) until Message::await_reader says the peer is done
// with the bytes. A receive is lazy: it is matched when waited for or consumed.
template <class Message, class World>
struct posted {
  std::shared_ptr<Message> msg;  // send: our posted message
  void* dst = nullptr;           // recv: where to copy
  std::size_t bytes = 0;
  int peer = -1;
  std::uint32_t tag = 0;
  bool recv = false;
  bool done = false;
  std::shared_ptr<World> world;  // send: where msg was posted

  posted() = default;
  posted(std::shared_ptr<Message> m, void* d, std::size_t b, int p, std::uint32_t t, bool r, std::shared_ptr<World> w)
      : msg(std::move(m)), dst(d), bytes(b), peer(p), tag(t), recv(r), world(std::move(w)) {}
  posted(posted&& o) noexcept { *this = std::move(o); }
  posted& operator=(posted&& o) noexcept {
    if (this != &o) {
      settle();
      msg = std::move(o.msg);
      dst = o.dst;
      bytes = o.bytes;
      peer = o.peer;
      tag = o.tag;
      recv = o.recv;
      done = std::exchange(o.done, true);
      world = std::move(o.world);
    }
    return *this;
  }
  posted(const posted&) = delete;
  posted& operator=(const posted&) = delete;
  ~posted() { settle(); }

 private:
  void settle() noexcept {
    if (done || recv || !msg || !world) return;
    done = true;
    {
      auto& b = world->at(peer);
      std::lock_guard lk(b.m);
      auto it = std::find(b.q.begin(), b.q.end(), msg);
      if (it != b.q.end()) {
        b.q.erase(it);
        return;
      }
    }
    Message::await_reader(world->at(msg->src), *msg, std::chrono::steady_clock::now() + std::chrono::seconds(10));
  }
};

// The checks and the posting every in-process transport's isend / irecv make. A send's message is
// filled (`prepare`: the stream transport records its event) before the peer can see it.
template <class World>
void check_peer(const std::shared_ptr<World>& world, int rank, int peer, const char* op) {
  if (!world) throw error(errc::invalid_argument, op, rank, peer, "endpoint not connected to a world");
  if (peer < 0 || peer >= world->size())
    throw error(errc::invalid_argument, op, rank, peer, "peer out of range for a world of " + std::to_string(world->size()));
}

template <class Message, class World, class Prepare>
posted<Message, World> post_send(const std::shared_ptr<World>& world, int rank, int peer, std::uint32_t tag,
                                 const void* data, std::size_t bytes, Prepare&& prepare) {
  check_peer(world, rank, peer, "send");
  auto m = std::make_shared<Message>();
  m->src = rank;
  m->tag = tag;
  m->data = data;
  m->bytes = bytes;
  prepare(*m);
  auto& b = world->at(peer);
  {
    std::lock_guard lk(b.m);
    b.q.push_back(m);
  }
  b.cv.notify_all();
  return {std::move(m), nullptr, bytes, peer, tag, false, world};
}

template <class Message, class World>
posted<Message, World> post_recv(const std::shared_ptr<World>& world, int rank, int peer, std::uint32_t tag, void* data,
                                 std::size_t bytes) {
  check_peer(world, rank, peer, "recv");
  return {nullptr, data, bytes, peer, tag, true, nullptr};
}

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
