// lockstep/transport/inproc.hpp: N ranks as threads of one process, talking through shared memory.
//
// Sends are rendezvous: isend posts (pointer, size) into the receiver's mailbox and completes when
// the receiver is done with the bytes. A plain irecv copies them once; borrow() hands the receiver
// the sender's own memory, so fp32 reduce-scatter adds straight from the neighbour's buffer and
// nothing is copied at all. Every wait has a deadline, and a rank that fails aborts the world so
// the others stop waiting at once instead of at their timeout.
//
// The worlds split from one world (and from those, and so on) are a family: a failure in any of
// them aborts every one, as a failing process takes all its communicators down (torch's watchdog;
// docs/reliability.md, "Every group of a rank"). A waiter in a world where the failure did not
// happen throws errc::aborted naming the failing rank in its own numbering (error::peer(), -1 when
// that rank is not in this world) and in the first world's.
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

class inproc_world;

// The worlds split from one first world, directly or not, and the first failure among them.
struct inproc_family {
  std::mutex m;
  bool failed = false;
  int origin = -1;     // the failing rank, in the first world's numbering
  std::string reason;  // its reason
  std::vector<std::weak_ptr<inproc_world>> worlds;  // every world split off, the first one once it splits
};

class inproc_world : public mailbox_world<inproc_message>, public std::enable_shared_from_this<inproc_world> {
 public:
  explicit inproc_world(int n) : inproc_world(n, std::make_shared<inproc_family>(), {}) {}
  // A world of the family `family`; first[i]: the rank in the first world of this world's rank i.
  inproc_world(int n, std::shared_ptr<inproc_family> family, std::vector<int> first)
      : mailbox_world(n), split_seq_(static_cast<std::size_t>(n), 0), family_(std::move(family)), first_(std::move(first)) {
    if (first_.empty())
      for (int i = 0; i < n; ++i) first_.push_back(i);
  }

  // Rank `rank` failed: this world's waiters, then every other world of the family, throw
  // errc::aborted (split's waiters too).
  void abort(int rank, const std::string& reason) {
    const int origin = first_[static_cast<std::size_t>(rank)];
    const bool first_failure = [&] {
      std::lock_guard lk(family_->m);
      if (family_->failed) return false;
      family_->failed = true;
      family_->origin = origin;
      family_->reason = reason;
      return true;
    }();
    abort_as(rank, name(rank, origin) + " failed: " + reason);
    wake_split();
    if (!first_failure) return;
    std::vector<std::shared_ptr<inproc_world>> others;
    {
      std::lock_guard lk(family_->m);
      for (auto& w : family_->worlds)
        if (auto p = w.lock(); p && p.get() != this) others.push_back(std::move(p));
    }
    for (auto& w : others) w->abort_relayed(origin, reason);
  }

  // The rank in this world of rank `first` of the family's first world; -1: not a member.
  int rank_of_first(int first) const {
    const auto it = std::find(first_.begin(), first_.end(), first);
    return it == first_.end() ? -1 : static_cast<int>(it - first_.begin());
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
      std::vector<std::shared_ptr<inproc_world>> made;
      for (auto& [c, list] : members) {
        std::sort(list.begin(), list.end());
        std::vector<int> first;
        for (auto& [k, old_rank] : list) first.push_back(first_[static_cast<std::size_t>(old_rank)]);
        auto w = std::make_shared<inproc_world>(static_cast<int>(list.size()), family_, std::move(first));
        for (std::size_t p = 0; p < list.size(); ++p) r.result[static_cast<std::size_t>(list[p].second)] = {w, static_cast<int>(p)};
        made.push_back(std::move(w));
      }
      int late_origin = -1;  // the family failed before these worlds joined it: they fail too
      std::string late_reason;
      {
        std::lock_guard fk(family_->m);
        auto& ws = family_->worlds;
        std::erase_if(ws, [](const std::weak_ptr<inproc_world>& w) { return w.expired(); });
        if (std::none_of(ws.begin(), ws.end(), [&](const auto& w) { return w.lock().get() == this; }))
          ws.push_back(weak_from_this());
        for (auto& w : made) ws.push_back(w);
        if (family_->failed) late_origin = family_->origin, late_reason = family_->reason;
      }
      if (late_origin >= 0)  // (no other thread can hold these worlds yet)
        for (auto& w : made) w->abort_relayed(late_origin, late_reason);
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
  // Rank `origin` of the first world failed in another world of the family.
  void abort_relayed(int origin, const std::string& reason) {
    const int here = rank_of_first(origin);
    abort_as(here, name(here, origin) + " failed in another of its groups: " + reason);
    wake_split();
  }
  // How errors name rank `here` of this world, rank `first` of the family's first world.
  static std::string name(int here, int first) {
    if (here < 0) return "rank " + std::to_string(first) + " of the parent group";
    if (here == first) return "rank " + std::to_string(here);
    return "rank " + std::to_string(here) + " (rank " + std::to_string(first) + " of the parent group)";
  }
  void wake_split() {
    std::lock_guard lk(split_m_);
    split_cv_.notify_all();
  }

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
  std::shared_ptr<inproc_family> family_;
  std::vector<int> first_;  // first_[i]: the rank in the family's first world of this world's rank i
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
