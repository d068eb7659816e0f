// lockstep/transport/inproc.hpp: N ranks as threads of one process, talking through shared memory.
//
// Sends are rendezvous: isend posts (pointer, size) into the receiver's mailbox and completes when
// the receiver is done with the bytes. A plain irecv copies them once; borrow() hands the receiver
// the sender's own memory, so fp32 reduce-scatter adds straight from the neighbour's buffer and
// nothing is copied at all. Every wait has a deadline, and a rank that fails aborts the world so
// the others stop waiting at once instead of at their timeout.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "concept.hpp"
#include "mailbox.hpp"

namespace lockstep::transport {

namespace detail {

struct inproc_message {
  int src;
  std::uint32_t tag;
  const void* data;
  std::size_t bytes;
  std::atomic<bool> done{false};

  // The receiver has finished reading (it set `done` under the sender's box lock).
  template <class Box>
  static void await_reader(Box& sender_box, inproc_message& m, std::chrono::steady_clock::time_point until) {
    std::unique_lock lk(sender_box.m);
    sender_box.cv.wait_until(lk, until, [&] { return m.done.load(std::memory_order_acquire); });
  }
};

class inproc_world : public mailbox_world<inproc_message> {
 public:
  explicit inproc_world(int n) : mailbox_world(n), split_seq_(static_cast<std::size_t>(n), 0) {}

  // Wakes the mailboxes' waiters and those of split as well.
  void abort(int rank, const std::string& reason) {
    mailbox_world::abort(rank, reason);
    std::lock_guard lk(split_m_);
    split_cv_.notify_all();
  }

  // MPI_Comm_split over threads: the k-th split call of every rank joins round k.
  std::pair<std::shared_ptr<inproc_world>, int> split(int rank, int color, int key,
                                                      clock::time_point deadline) {
    std::unique_lock lk(split_m_);
    const std::uint64_t round = split_seq_[static_cast<std::size_t>(rank)]++;
    auto& r = rounds_[round];
    if (r.entries.empty()) r.entries.assign(static_cast<std::size_t>(size()), {0, 0, false});
    r.entries[static_cast<std::size_t>(rank)] = {color, key, true};
    if (++r.arrived == size()) {
      std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, rank)
      for (int i = 0; i < size(); ++i) members[r.entries[static_cast<std::size_t>(i)].color].push_back({r.entries[static_cast<std::size_t>(i)].key, i});
      r.result.resize(static_cast<std::size_t>(size()));
      for (auto& [c, list] : members) {
        std::sort(list.begin(), list.end());
        auto w = std::make_shared<inproc_world>(static_cast<int>(list.size()));
        for (std::size_t p = 0; p < list.size(); ++p) r.result[static_cast<std::size_t>(list[p].second)] = {w, static_cast<int>(p)};
      }
      split_cv_.notify_all();
    }
    if (!split_cv_.wait_until(lk, deadline, [&] { return r.arrived == size() || aborted(); })) {
      throw error(errc::timeout, "split", rank, -1,
                  std::to_string(size() - r.arrived) + " of " + std::to_string(size()) +
                      " ranks never called split");
    }
    if (r.arrived != size()) {
      lk.unlock();
      throw_aborted("split", rank);
    }
    auto out = r.result[static_cast<std::size_t>(rank)];
    if (++r.taken == size()) rounds_.erase(round);
    return out;
  }

 private:
  struct split_entry {
    int color, key;
    bool present;
  };
  struct split_round {
    std::vector<split_entry> entries;
    int arrived = 0, taken = 0;
    std::vector<std::pair<std::shared_ptr<inproc_world>, int>> result;
  };

  std::mutex split_m_;
  std::condition_variable split_cv_;
  std::vector<std::uint64_t> split_seq_;
  std::map<std::uint64_t, split_round> rounds_;
};

}  // namespace detail

class inproc {
 public:
  // 1 MiB segments: large enough that the per-message handshake (a few microseconds) is noise,
  // small enough that a neighbour can start decoding while the sender still encodes.
  static constexpr std::size_t segment_bytes = std::size_t{1} << 20;
  // A send completes when the peer has taken the message, so a completed header send tells the
  // executor that the peer entered the collective (its timeout messages say so).
  static constexpr bool send_completion_means_taken = true;

  // One posted send or receive (transport/mailbox.hpp: a failed send is withdrawn or waited for).
  using request = detail::posted<detail::inproc_message, detail::inproc_world>;
  struct view {
    std::shared_ptr<detail::inproc_message> msg;
    const std::byte* data = nullptr;
    std::size_t bytes = 0;
  };

  inproc() = default;
  inproc(std::shared_ptr<detail::inproc_world> world, int rank) : world_(std::move(world)), rank_(rank) {}

  // A world of n ranks; endpoint(r) is rank r's end of it.
  static std::shared_ptr<detail::inproc_world> make_world(int n) {
    if (n < 1) throw error(errc::invalid_argument, "inproc", -1, -1, "world of " + std::to_string(n) + " ranks");
    return std::make_shared<detail::inproc_world>(n);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return world_ ? world_->size() : 0; }
  std::string name() const { return "inproc"; }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    return detail::post_send<detail::inproc_message>(world_, rank_, peer, tag, data, bytes, [](detail::inproc_message&) {});
  }

  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    return detail::post_recv<detail::inproc_message>(world_, rank_, peer, tag, data, bytes);
  }

  bool wait(request& r, clock::time_point deadline) {
    if (r.done) return true;
    if (r.recv) {
      view v = borrow(r.peer, r.tag, r.bytes, deadline);
      if (!v.data && r.bytes) return false;
      if (r.bytes) std::memcpy(r.dst, v.data, r.bytes);
      release(v);
      r.done = true;
      return true;
    }
    // A short spin first: on a ring the receiver is usually already reading.
    for (int i = 0; i < 64 && !r.msg->done.load(std::memory_order_acquire); ++i) std::this_thread::yield();
    auto& b = world_->at(rank_);
    std::unique_lock lk(b.m);
    b.cv.wait_until(lk, deadline, [&] { return r.msg->done.load(std::memory_order_acquire) || world_->aborted(); });
    if (!r.msg->done.load(std::memory_order_acquire)) {
      lk.unlock();
      if (world_->aborted()) world_->throw_aborted("send", rank_);
      return false;
    }
    r.done = true;
    return true;
  }

  // A receive read where the sender's bytes are: no copy at all (a reduce step adds from them).
  template <class F>
  bool consume(request& r, clock::time_point deadline, F&& fn) {
    view v = borrow(r.peer, r.tag, r.bytes, deadline);
    if (!v.data && r.bytes) return false;
    struct on_exit {
      inproc* t;
      view& v;
      ~on_exit() { t->release(v); }
    } guard{this, v};
    r.done = true;
    fn(v.data);
    return true;
  }

  // The next message from `peer` with `tag`, in place in the sender's memory.
  view borrow(int peer, std::uint32_t tag, std::size_t bytes, clock::time_point deadline) {
    check_peer(peer, "recv");
    auto& b = world_->at(rank_);
    std::shared_ptr<detail::inproc_message> m;
    // Nothing is taken once the world has aborted: the failing sender may be about to withdraw
    // its messages and free their memory.
    auto take = [&] {
      if (world_->aborted()) return true;
      m = detail::inproc_world::take(b, peer, tag);
      return m != nullptr;
    };
    {
      std::unique_lock lk(b.m);
      if (!take()) {
        lk.unlock();
        for (int i = 0; i < 64; ++i) {  // short spin before sleeping, as in wait()
          std::this_thread::yield();
          lk.lock();
          const bool got = take();
          lk.unlock();
          if (got) break;
        }
        lk.lock();
        if (!m && !world_->aborted()) b.cv.wait_until(lk, deadline, take);
      }
    }
    if (!m) {
      if (world_->aborted()) world_->throw_aborted("recv", rank_);
      return view{};
    }
    if (m->bytes != bytes) {
      const std::size_t got = m->bytes;
      finish(*m);
      throw error(errc::mismatch, "recv", rank_, peer,
                  "expected a message of " + std::to_string(bytes) + " bytes, the peer sent " +
                      std::to_string(got) + " (tag " + std::to_string(tag) + ")");
    }
    return view{m, static_cast<const std::byte*>(m->data), m->bytes};
  }

  void release(view& v) {
    if (v.msg) finish(*v.msg);
    v = view{};
  }

  inproc split(int color, int key, clock::time_point deadline) {
    if (color < 0) throw error(errc::invalid_argument, "split", rank_, -1, "negative colour " + std::to_string(color));
    auto [w, r] = world_->split(rank_, color, key, deadline);
    return inproc(std::move(w), r);
  }

  void abort(const std::string& reason) {
    if (world_) world_->abort(rank_, reason);
  }
  const std::shared_ptr<detail::inproc_world>& world() const noexcept { return world_; }

 private:
  void check_peer(int peer, const char* op) const { detail::check_peer(world_, rank_, peer, op); }
  void finish(detail::inproc_message& m) {
    auto& sb = world_->at(m.src);
    {
      std::lock_guard lk(sb.m);
      m.done.store(true, std::memory_order_release);
    }
    sb.cv.notify_all();
  }

  std::shared_ptr<detail::inproc_world> world_;
  int rank_ = 0;
};

static_assert(transport<inproc>);

}  // namespace lockstep::transport
