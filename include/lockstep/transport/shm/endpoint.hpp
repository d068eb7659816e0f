// lockstep/transport/shm/endpoint.hpp: one process's end of a node's shared-memory segment:
// point-to-point messages to and from the other local ranks, matched per (peer, tag) in send
// order. The routed transport (routed.hpp) sends to the peers of its node this way.
//
// Why not leave it to MPI: Open MPI moves a message above its 4 KiB eager limit on one node by
// rendezvous (vader + CMA): the receiver must run to pull the bytes and the sender must run again to
// see them taken, two scheduling delays per message. With more ranks than cores, and a step of a
// collective being one message per rank, those delays are what a 1 MiB all-reduce costs. Here a
// send copies its bytes into a ring the receiver owns and is complete at once; the receiver copies
// them out when it gets to them; a waiting rank sleeps on a futex that the peer rings.
//
// Layout (shm::layout): one block per local rank (doorbell, failed flag and reason, identity for
// by-reference reads), then one ring (ring.hpp) per ordered pair of local ranks.
//
// Matching: a message at the head of a ring waits there for its receive; only when a receive for
// another tag from that peer is posted does it move to a private buffer (so the first step's data,
// sent beside a collective's headers, is read once, straight into place). A whole message for a
// posted receive is parked where it lies: wait_view reads it there (nothing passes it until the
// view is released), a plain wait copies it out; it is copied out early when the sender runs out
// of room (the ring's starved flag) or a later receive from that peer is waited for first, so no
// ring ever waits on a receive nobody is waiting for.
//
// Large sends the receiver will copy (an all-gather's) can go by reference instead: the ring
// carries their address, the receiver copies them straight out of the sender's memory
// (process_vm_readv, where Linux allows it), and the send completes when it has.
//
// Peers are local indices 0..ranks()-1; errors name them by names[i], the communicator's ranks.
#pragma once

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "../../core/error.hpp"
#include "../concept.hpp"
#include "../poll.hpp"
#include "ring.hpp"
#include "segment.hpp"

namespace lockstep::transport::shm {

struct alignas(64) rank_block {
  doorbell bell;
  std::atomic<std::uint32_t> failed;  // this rank aborted the group; reason below
  std::atomic<std::int32_t> pid;      // for process_vm_readv of its by-reference sends
  std::atomic<std::uint64_t> probe;   // address of a word in its memory (the set-up's check)
  char reason[488];
};

// Sizes and offsets of a segment for `ranks` local ranks with rings of `capacity` bytes.
struct layout {
  int ranks = 0;
  std::size_t capacity = 0;

  static constexpr std::size_t page = 4096;
  static constexpr std::size_t round(std::size_t b) { return (b + page - 1) / page * page; }
  std::size_t blocks_bytes() const { return round(sizeof(rank_block) * static_cast<std::size_t>(ranks)); }
  std::size_t ring_bytes() const { return round(sizeof(ring_control)) + capacity; }
  std::size_t rings() const { return static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks - 1); }
  std::size_t total() const { return blocks_bytes() + rings() * ring_bytes(); }
  // The ring from local rank `from` to local rank `to` (from != to).
  std::size_t ring_offset(int from, int to) const {
    const std::size_t i = static_cast<std::size_t>(from) * static_cast<std::size_t>(ranks - 1) +
                          static_cast<std::size_t>(to < from ? to : to - 1);
    return blocks_bytes() + i * ring_bytes();
  }
  // Constructs the blocks and ring controls in a fresh segment (its creator does, once).
  void format(std::byte* base) const {
    for (int r = 0; r < ranks; ++r) new (base + static_cast<std::size_t>(r) * sizeof(rank_block)) rank_block{};
    for (int a = 0; a < ranks; ++a)
      for (int b = 0; b < ranks; ++b)
        if (a != b) new (base + ring_offset(a, b)) ring_control{};
  }
};

// One receive: done once its message is read; got >= 0 when that message had another size;
// withdrawn when the sender abandoned it.
struct recv_op {
  std::byte* dst = nullptr;
  std::size_t bytes = 0;
  int from = -1;
  std::uint32_t tag = 0;
  std::int64_t got = -1;
  bool withdrawn = false;
  std::string read_error;  // a by-reference read that failed (process_vm_readv's reason)
  // Set under the endpoint's lock, after got, withdrawn and read_error; read by waiters.
  std::atomic<bool> done{false};
  // Arrived whole and left in the ring for a wait_view: read it there, then release.
  std::atomic<const std::byte*> in_ring{nullptr};
};

class endpoint;

// A posted send or receive; move-only. Destroying one unfinished withdraws it (endpoint::withdraw).
class request {
 public:
  request() = default;
  request(request&& o) noexcept { *this = std::move(o); }
  request& operator=(request&& o) noexcept {
    if (this != &o) {
      release();
      ep_ = std::move(o.ep_);
      op_ = std::move(o.op_);
      peer_ = o.peer_;
      done_ = std::exchange(o.done_, true);
    }
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  ~request() { release(); }

  bool done() const noexcept { return done_; }
  bool is_recv() const noexcept { return std::holds_alternative<std::shared_ptr<recv_op>>(op_); }

 private:
  friend class endpoint;
  inline void release() noexcept;
  recv_op* recv() const noexcept {
    auto* p = std::get_if<std::shared_ptr<recv_op>>(&op_);
    return p ? p->get() : nullptr;
  }

  std::shared_ptr<endpoint> ep_;
  std::variant<std::shared_ptr<send_op>, std::shared_ptr<recv_op>> op_;
  int peer_ = -1;  // local index
  bool done_ = true;
};

// A received message where it lies: in the receive's own memory or still in the ring (then the
// ring moves on only once the view is released or destroyed). ok == false: the deadline passed.
class view {
 public:
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  bool ok = false;

  view() = default;
  view(const std::byte* d, std::size_t b, bool k) : data(d), bytes(b), ok(k) {}
  view(view&& o) noexcept { *this = std::move(o); }
  view& operator=(view&& o) noexcept {
    if (this != &o) {
      reset();
      data = std::exchange(o.data, nullptr);
      bytes = std::exchange(o.bytes, 0);
      ok = std::exchange(o.ok, false);
      ep_ = std::move(o.ep_);
      held_ = std::move(o.held_);
    }
    return *this;
  }
  view(const view&) = delete;
  view& operator=(const view&) = delete;
  ~view() { reset(); }
  inline void reset() noexcept;

 private:
  friend class endpoint;
  std::shared_ptr<endpoint> ep_;
  std::shared_ptr<recv_op> held_;
};

// This rank's end of a segment: `local` is its index among `lay.ranks` local ranks.
class endpoint : public std::enable_shared_from_this<endpoint> {
 public:
  // From ref_min_bytes on, in-place sends go by reference (where the set-up allowed it).
  static constexpr std::size_t ref_min_bytes = std::size_t{64} << 10;
  // The largest by-reference message set aside (match()); larger ones wait for their receive.
  static constexpr std::uint64_t ref_aside_max = std::uint64_t{64} << 20;
  // The longest sleep of a wait with nothing else to do: everything a wait can wait for rings the
  // doorbell (a peer's write or read, an abort, another thread of this rank completing the
  // request); the cap only bounds a lost wake-up.
  static constexpr std::chrono::milliseconds idle_sleep{1000};

  endpoint(std::shared_ptr<segment> seg, layout lay, int local, std::vector<int> names)
      : seg_(std::move(seg)), lay_(lay), local_(local), names_(std::move(names)),
        out_(static_cast<std::size_t>(lay.ranks)), in_(static_cast<std::size_t>(lay.ranks)),
        posted_count_(static_cast<std::size_t>(lay.ranks), 0) {}

  int ranks() const noexcept { return lay_.ranks; }
  bool by_reference() const noexcept { return cma_; }

  // Queues a send to local rank `to` and writes what fits now. in_place: the caller keeps the bytes
  // unchanged until the send completes, and the receiver will copy them, not add them: large ones
  // then go by reference, one copy instead of two, and complete when the receiver has read them.
  request isend(int to, std::uint32_t tag, const void* data, std::size_t bytes, bool in_place = false) {
    auto s = std::make_shared<send_op>();
    s->data = static_cast<const std::byte*>(data);
    s->bytes = bytes;
    s->tag = tag;
    s->by_ref = in_place && cma_ && bytes >= ref_min_bytes;
    {
      std::lock_guard lk(m_);
      out_[static_cast<std::size_t>(to)].push(s);
      pump(to);
    }
    return make_request(to, std::move(s));
  }

  // A send whose payload fill(std::byte* dst) writes straight into the ring to local rank `to`,
  // complete at once; empty, with nothing sent, where it cannot be written whole now (earlier sends
  // to `to` still queued, or too little room: ring_writer::try_fill). The caller then sends the
  // usual way. fill runs under this endpoint's lock and must not call it.
  template <class Fill>
  std::optional<request> try_isend_fill(int to, std::uint32_t tag, std::size_t bytes, Fill&& fill) {
    // Made first: nothing may throw once the message is in the ring.
    auto s = std::make_shared<send_op>();
    request r = make_request(to, s);
    {
      std::lock_guard lk(m_);
      auto& w = out_[static_cast<std::size_t>(to)];
      if (!w.try_fill(ring_of(local_, to), block(to).bell, tag, bytes, fill)) {
        r.done_ = true;  // never sent: nothing to withdraw
        return std::nullopt;
      }
    }
    s->bytes = bytes;
    s->sent = bytes;
    s->tag = tag;
    s->state = send_state::trailing;
    s->done.store(true, std::memory_order_release);
    r.done_ = true;
    return r;
  }

  // Posts a receive from local rank `from`; a message already set aside for it is delivered now.
  request irecv(int from, std::uint32_t tag, void* dst, std::size_t bytes) {
    auto r = std::make_shared<recv_op>();
    r->dst = static_cast<std::byte*>(dst);
    r->bytes = bytes;
    r->from = from;
    r->tag = tag;
    std::lock_guard lk(m_);
    if (!claim_unexpected(r)) {
      posted_[{from, tag}].push_back(r);
      ++posted_count_[static_cast<std::size_t>(from)];
      drain(from, nullptr, false);
    }
    return make_request(from, std::move(r));
  }

  // Finishes a request. Between looks it runs `idle` (the routed transport's MPI matching) and
  // sleeps on the doorbell at most `cap` (shorter where other work waits outside the rings).
  // in_place (wait_view's): a message parked for the receive stays in the ring, and the wait
  // returns with the request still open.
  template <class Idle>
  bool wait(request& r, clock::time_point deadline, Idle&& idle, std::chrono::nanoseconds cap, bool in_place = false) {
    if (r.done_) return true;
    recv_op* const recv = r.recv();
    send_op* const send = recv ? nullptr : std::get<std::shared_ptr<send_op>>(r.op_).get();
    const char* op = recv ? "recv" : "send";
    std::uint32_t seen = 0;  // the doorbell before the last look: a ring after it ends the pause
    return transport::detail::poll_until(
        deadline, {spin_polls, yield_polls},
        [&] {
          seen = block(local_).bell.seen();
          progress(recv, in_place);
          if (recv && recv->in_ring.load(std::memory_order_acquire)) {
            if (in_place) return true;  // wait_view reads it there
            take(*recv);                // parked in the ring: a plain wait copies it out
          }
          if (!(recv ? recv->done : send->done).load(std::memory_order_acquire)) return false;
          r.done_ = true;
          if (recv && recv->withdrawn) throw_if_peer_failed(op, r.peer_);  // the failure, not its echo
          if (recv) throw_if_failed(*recv, r.peer_);
          return true;
        },
        [&] {
          // After a look that found nothing, so that what idle checks (the routed transport: is
          // the peer's process still there?) never overtakes a message that had arrived.
          idle();
          throw_if_peer_failed(op, names_[static_cast<std::size_t>(r.peer_)]);
        },
        [&](clock::time_point now) { sleep(seen, std::min<std::chrono::nanoseconds>(deadline - now, cap)); });
  }
  bool wait(request& r, clock::time_point deadline) { return wait(r, deadline, [] {}, idle_sleep); }

  // wait() for a receive without the last copy: a message that arrived whole in the ring is read
  // there (the view holds the ring), any other in the receive's memory. Errors as wait().
  template <class Idle>
  view wait_view(request& r, clock::time_point deadline, Idle&& idle, std::chrono::nanoseconds cap) {
    recv_op* const recv = r.recv();
    const std::size_t bytes = recv ? recv->bytes : 0;
    if (!recv || r.done_) {
      if (!wait(r, deadline, idle, cap)) return view{nullptr, bytes, false};
      return view{recv ? recv->dst : nullptr, bytes, true};
    }
    if (!wait(r, deadline, idle, cap, true)) return view{nullptr, bytes, false};
    if (const std::byte* in_ring = hold(*recv)) {
      r.done_ = true;
      view v{in_ring, bytes, true};
      v.ep_ = shared_from_this();
      v.held_ = std::get<std::shared_ptr<recv_op>>(r.op_);
      return v;
    }
    // Copied out meanwhile (another thread's wait, a starved ring): done, or finishing.
    if (!recv->done.load(std::memory_order_acquire) && !wait(r, deadline, idle, cap)) return view{nullptr, bytes, false};
    r.done_ = true;
    return view{recv->dst, bytes, true};
  }

  // A receive read where it lies (wait_view): fn(bytes) is called once, while the view holds them.
  template <class F>
  bool consume(request& r, clock::time_point deadline, F&& fn) {
    view v = wait_view(r, deadline, [] {}, idle_sleep);
    if (!v.ok) return false;
    fn(v.data);
    return true;
  }

  // Moves whatever can move on every ring of this rank. in_place: `want` is waited for by a
  // wait_view, so its message, once whole in the ring, is left there (want->in_ring) for the
  // caller to read. Every other message goes to its receive's memory as it arrives.
  void progress(const recv_op* want = nullptr, bool in_place = false) {
    std::lock_guard lk(m_);
    for (int p = 0; p < lay_.ranks; ++p) {
      if (p == local_) continue;
      pump(p);
      drain(p, want, in_place);
    }
  }

  // Marks this rank failed for every local rank of the group and wakes them.
  void fail(const std::string& reason) {
    auto& b = block(local_);
    if (b.failed.load()) return;
    const std::size_t n = std::min(reason.size(), sizeof b.reason - 1);
    std::memcpy(b.reason, reason.data(), n);
    b.reason[n] = '\0';
    b.failed.store(1, std::memory_order_release);
    for (int p = 0; p < lay_.ranks; ++p) block(p).bell.ring(true);
  }
  // Whether another local rank of the group has set its failed flag.
  bool any_peer_failed() const {
    for (int p = 0; p < lay_.ranks; ++p)
      if (p != local_ && block(p).failed.load(std::memory_order_acquire)) return true;
    return false;
  }
  // Throws errc::aborted, naming the failed rank as its peer(), when another local rank of the
  // group failed (whichever peer the caller waited for: the failed rank need not be that one).
  void throw_if_peer_failed(const char* op, int /*waited_for*/) const {
    for (int p = 0; p < lay_.ranks; ++p) {
      if (p == local_ || !block(p).failed.load(std::memory_order_acquire)) continue;
      const int name = names_[static_cast<std::size_t>(p)];
      throw error(errc::aborted, op, names_[static_cast<std::size_t>(local_)], name,
                  "rank " + std::to_string(name) + " failed: " + std::string(block(p).reason));
    }
  }

  // Set-up of by-reference sends (collective over the node, with a barrier between the two
  // calls): publish this process, then read a word of every other local rank's memory. Linux may
  // forbid it (Yama ptrace_scope, containers); set_by_reference(false) then keeps every byte in
  // the rings.
  void publish_identity() {
    block(local_).pid.store(static_cast<std::int32_t>(getpid()), std::memory_order_relaxed);
    block(local_).probe.store(reinterpret_cast<std::uintptr_t>(&probe_word), std::memory_order_release);
  }
  bool can_read_peers() const {
    for (int p = 0; p < lay_.ranks; ++p) {
      if (p == local_) continue;
      std::uint64_t got = 0;
      const std::uint64_t addr = block(p).probe.load(std::memory_order_acquire);
      if (!read_peer(p, &got, addr, sizeof got) || got != probe_word) return false;
    }
    return true;
  }
  void set_by_reference(bool on) { cma_ = on; }

 private:
  friend class request;
  friend class view;

  // A wait's backoff before it sleeps on the doorbell: a few looks, a few yields.
  static constexpr int spin_polls = 4, yield_polls = 8;
  static constexpr std::uint64_t probe_word = 0x4c4f434b53544550ull;  // "LOCKSTEP"

  // A message read before its receive was posted (another tag's receive was waiting behind it).
  struct unexpected_msg {
    std::uint32_t tag = 0;
    std::uint64_t bytes = 0;       // as its frame says
    std::vector<std::byte> data;   // what has arrived of them
    bool complete = false, withdrawn = false;
    std::shared_ptr<recv_op> claimed;  // a receive posted while this was still arriving
  };

  // The consumer's end of the ring from one peer. Between messages, then streaming one into its
  // receive (or aside, or skipping it: sink null); parked: whole in the ring for target
  // (target->in_ring) until its wait comes; viewed: a wait_view's caller reads it there.
  enum class read_state : std::uint8_t { between, streaming, parked, viewed };
  struct incoming {
    read_state state = read_state::between;
    frame f{};
    std::uint64_t got = 0;             // payload bytes read
    std::byte* sink = nullptr;         // where payload goes (null: skipped)
    std::shared_ptr<recv_op> target;   // the receive being filled, if any
    std::shared_ptr<unexpected_msg> aside;
    std::deque<std::shared_ptr<unexpected_msg>> unexpected;
    bool whole() const { return state == read_state::parked || state == read_state::viewed; }
  };
  // The consumer's positions in one ring during a drain: tail moves, head is what it saw.
  struct cursor {
    std::uint64_t tail, head;
    std::uint64_t available() const { return head - tail; }
  };

  template <class Op>
  request make_request(int peer, std::shared_ptr<Op> op) {
    request r;
    r.ep_ = shared_from_this();
    r.op_ = std::move(op);
    r.peer_ = peer;
    r.done_ = false;
    return r;
  }

  rank_block& block(int r) const { return reinterpret_cast<rank_block*>(seg_->base())[r]; }
  ring ring_of(int from, int to) const {
    std::byte* at = seg_->base() + lay_.ring_offset(from, to);
    return ring{*reinterpret_cast<ring_control*>(at), at + layout::round(sizeof(ring_control)), lay_.capacity};
  }
  void pump(int to) { out_[static_cast<std::size_t>(to)].pump(ring_of(local_, to), block(to).bell); }

  // Copies `bytes` at `addr` in local rank p's memory into `dst`.
  bool read_peer(int p, void* dst, std::uint64_t addr, std::size_t bytes) const {
    std::size_t done = 0;
    while (done < bytes) {
      iovec local{static_cast<std::byte*>(dst) + done, bytes - done};
      iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(addr + done)), bytes - done};
      const ssize_t n = process_vm_readv(block(p).pid.load(std::memory_order_relaxed), &local, 1, &remote, 1, 0);
      if (n <= 0) return false;
      done += static_cast<std::size_t>(n);
    }
    return true;
  }

  void sleep(std::uint32_t seen, std::chrono::nanoseconds timeout) { block(local_).bell.sleep(seen, timeout); }

  // A finished receive whose message was not what it asked for.
  void throw_if_failed(const recv_op& r, int peer) const {
    const int me = names_[static_cast<std::size_t>(local_)], name = names_[static_cast<std::size_t>(peer)];
    if (r.got >= 0)
      throw error(errc::mismatch, "recv", me, name,
                  "expected a message of " + std::to_string(r.bytes) + " bytes, the peer sent " + std::to_string(r.got) +
                      " (tag " + std::to_string(r.tag) + ")");
    if (!r.read_error.empty()) throw error(errc::transport, "recv", me, name, r.read_error);
    if (r.withdrawn)
      throw error(errc::aborted, "recv", me, name,
                  "the peer withdrew this message midway (its call failed; tag " + std::to_string(r.tag) + ")");
  }

  // The caller of wait_view takes r's parked message to read in place: nothing passes it until
  // release(). Null when it is not parked (copied out meanwhile: r is done).
  const std::byte* hold(const recv_op& r) {
    std::lock_guard lk(m_);
    auto& in = in_[static_cast<std::size_t>(r.from)];
    if (!in.whole() || in.target.get() != &r) return nullptr;
    in.state = read_state::viewed;
    return r.in_ring.load(std::memory_order_relaxed);
  }
  // The caller has read a message in the ring (its view is gone): free its room for the sender.
  void release(const recv_op& r) {
    std::lock_guard lk(m_);
    if (r.in_ring.load(std::memory_order_relaxed)) consume_held(r.from);
  }
  // A plain wait for a receive whose message waits in the ring: copy it to the receive's memory.
  void take(const recv_op& r) {
    std::lock_guard lk(m_);
    const std::byte* at = r.in_ring.load(std::memory_order_relaxed);
    if (!at || in_[static_cast<std::size_t>(r.from)].state == read_state::viewed) return;
    if (r.bytes) std::memcpy(r.dst, at, r.bytes);
    consume_held(r.from);
  }

  // A send whose request is destroyed unfinished (ring_writer::withdraw).
  void withdraw(const std::shared_ptr<send_op>& s, int to) {
    std::lock_guard lk(m_);
    out_[static_cast<std::size_t>(to)].withdraw(s, ring_of(local_, to), block(to).bell);
  }
  // A receive whose request is destroyed unfinished: no byte lands in its memory afterwards.
  void withdraw(const std::shared_ptr<recv_op>& r, int from) {
    std::lock_guard lk(m_);
    if (r->done.load(std::memory_order_relaxed)) return;
    auto& in = in_[static_cast<std::size_t>(from)];
    if (in.target == r && in.whole()) {  // viewed too: a live view finished the request first
      consume_held(from);                // dropped unread
      return;
    }
    r->done.store(true, std::memory_order_relaxed);
    if (in.target == r) {  // the rest of its message is skipped
      in.target = nullptr;
      in.sink = nullptr;
      return;
    }
    for (auto& u : in.unexpected)
      if (u->claimed == r) {
        // Its message belongs to the next receive posted for the tag, as if r had never been.
        u->claimed = take_posted(from, r->tag);
        if (u->claimed && u->complete) {
          deliver(*u, *u->claimed);
          in.unexpected.erase(std::find(in.unexpected.begin(), in.unexpected.end(), u));
        }
        return;
      }
    auto it = posted_.find({from, r->tag});
    if (it == posted_.end()) return;
    auto& q = it->second;
    const auto before = q.size();
    q.erase(std::remove(q.begin(), q.end(), r), q.end());
    posted_count_[static_cast<std::size_t>(from)] -= before - q.size();
    if (q.empty()) posted_.erase(it);
  }

  // --- matching. Lock held throughout.

  // The oldest posted receive for (from, tag), taken off its queue; null when none.
  std::shared_ptr<recv_op> take_posted(int from, std::uint32_t tag) {
    auto it = posted_.find({from, tag});
    if (it == posted_.end()) return nullptr;
    auto r = std::move(it->second.front());
    it->second.pop_front();
    --posted_count_[static_cast<std::size_t>(from)];
    if (it->second.empty()) posted_.erase(it);
    return r;
  }
  // A new receive takes the oldest message set aside for its tag: now if it is complete, else
  // when it is. False when none waits.
  bool claim_unexpected(const std::shared_ptr<recv_op>& r) {
    auto& un = in_[static_cast<std::size_t>(r->from)].unexpected;
    for (auto it = un.begin(); it != un.end(); ++it) {
      if ((*it)->tag != r->tag || (*it)->claimed) continue;
      if ((*it)->complete) {
        deliver(**it, *r);
        un.erase(it);
      } else {
        (*it)->claimed = r;
      }
      return true;
    }
    return false;
  }
  static void deliver(unexpected_msg& u, recv_op& r) {
    if (u.bytes == r.bytes) {
      // Short only when withdrawn midway (its receive reports that, whatever the bytes).
      if (r.bytes && u.data.size() == r.bytes) std::memcpy(r.dst, u.data.data(), r.bytes);
    } else {
      r.got = static_cast<std::int64_t>(std::min<std::uint64_t>(u.bytes, INT64_MAX));  // >= 0: a mismatch
    }
    r.withdrawn = u.withdrawn;
    r.done.store(true, std::memory_order_release);
  }

  // --- the consumer. Lock held throughout.

  // Reads messages from local rank `from` into their receives, one step at a time, until a step
  // cannot go on. A message nobody asked for stays in the ring unless a receive for another tag
  // from `from` is waiting behind it; the message a wait_view waits for stays once whole.
  void drain(int from, const recv_op* want, bool in_place) {
    auto& in = in_[static_cast<std::size_t>(from)];
    const ring r = ring_of(from, local_);
    cursor c{r.control.tail.load(std::memory_order_relaxed), r.control.head.load(std::memory_order_acquire)};
    if (c.head < c.tail || c.head - c.tail > r.capacity)
      throw error(errc::transport, "recv", names_[static_cast<std::size_t>(local_)], names_[static_cast<std::size_t>(from)],
                  "shared-memory ring corrupt (the producer's head is " + std::to_string(c.head) + ", the tail " +
                      std::to_string(c.tail) + ", in a ring of " + std::to_string(r.capacity) + " bytes)");
    const std::uint64_t start = c.tail;
    for (bool more = true; more;) {
      switch (in.state) {
        case read_state::viewed: more = false; break;  // nothing passes a view until it is released
        case read_state::parked: more = pass_parked(from, in, r, c, want, in_place); break;
        case read_state::between: more = open_message(from, in, r, c); break;
        case read_state::streaming: more = park(in, r, c) || stream(in, r, c); break;
      }
    }
    if (c.tail == start) return;
    r.control.tail.store(c.tail, std::memory_order_release);
    block(from).bell.ring();
    // A receive completed here may be another thread's of this rank, asleep on our doorbell.
    auto& mine = block(local_).bell;
    if (mine.sleepers.load(std::memory_order_seq_cst) > 0) mine.ring(true);
  }

  // A parked message stays unless the producer is starved or a later receive from its peer is
  // waited for; then it is copied out. A wait_view's own message stays for its hold().
  bool pass_parked(int from, incoming& in, const ring& r, cursor& c, const recv_op* want, bool in_place) {
    if (in_place && in.target.get() == want) return false;
    const bool must_pass = r.control.starved.load(std::memory_order_acquire) || (want && want->from == from && want != in.target.get());
    if (!must_pass) return false;
    if (in.target->bytes) std::memcpy(in.target->dst, in.target->in_ring.load(std::memory_order_relaxed), in.target->bytes);
    c.tail += pad8(in.f.bytes) + trailer_bytes;
    complete_parked(in);
    return true;
  }

  // Between messages: skips the producer's unused stretch before the ring's end, or reads the
  // next frame and opens its message for a receive (or aside); leaves it when nobody asked yet.
  bool open_message(int from, incoming& in, const ring& r, cursor& c) {
    const std::size_t to_end = r.to_end(c.tail);
    if (to_end < sizeof(frame)) {  // the producer skipped this stub too
      if (c.available() < to_end) return false;
      c.tail += to_end;
      return true;
    }
    if (c.available() < sizeof(frame)) return false;
    const auto f = r.read<frame>(c.tail);
    if (f.magic == skip_magic) {  // written together with the whole skipped stretch
      if (c.available() < to_end) return false;  // only a corrupt producer leaves it short
      c.tail += to_end;
      return true;
    }
    if (f.magic != frame_magic && f.magic != ref_magic)
      throw error(errc::transport, "recv", names_[static_cast<std::size_t>(local_)], names_[static_cast<std::size_t>(from)],
                  "shared-memory ring corrupt (no message frame where one was due)");
    const bool by_ref = f.magic == ref_magic;
    if (by_ref && c.available() < sizeof(frame) + sizeof(ref_record)) return false;  // written at once; not yet
    if (!match(from, in, f)) return false;  // left for the receive that will come
    c.tail += sizeof f;
    in.f = f;
    in.got = 0;
    in.state = read_state::streaming;
    if (by_ref) read_by_reference(from, in, r, c);
    return true;
  }

  // Where the message in frame f goes: its posted receive, else aside when a receive for another
  // tag waits behind it. False: neither (it stays in the ring).
  bool match(int from, incoming& in, const frame& f) {
    if ((in.target = take_posted(from, f.tag))) {
      if (in.target->bytes == f.bytes) {
        in.sink = in.target->dst;
      } else {
        in.target->got = static_cast<std::int64_t>(std::min<std::uint64_t>(f.bytes, INT64_MAX));
        in.sink = nullptr;
      }
      return true;
    }
    if (posted_count_[static_cast<std::size_t>(from)] == 0) return false;
    // A by-reference message is copied aside at once, out of the sender's memory: beyond
    // ref_aside_max it waits in the ring for its own receive instead (which checks its size), so
    // a corrupt count cannot make this rank copy gigabytes of whatever the sender has mapped.
    if (f.magic == ref_magic && f.bytes > ref_aside_max) return false;
    // Its buffer grows as the bytes arrive (stream, read_by_reference), never sized from the
    // frame alone: a corrupt count must not ask for more memory than the ring ever delivers.
    in.aside = std::make_shared<unexpected_msg>();
    in.aside->tag = f.tag;
    in.aside->bytes = f.bytes;
    in.sink = nullptr;
    in.unexpected.push_back(in.aside);
    return true;
  }

  // A by-reference record: copies the bytes out of the sender's memory and acknowledges them.
  // The address word may be overwritten by a withdrawing sender: it is read atomically before
  // and after the copy, and nothing read while the sender withdrew is kept.
  void read_by_reference(int from, incoming& in, const ring& r, cursor& c) {
    std::atomic_ref<std::uint64_t> addr_word(r.word(c.tail));
    const auto seq = r.read<std::uint64_t>(c.tail + sizeof(std::uint64_t));
    c.tail += sizeof(ref_record);
    const std::uint64_t addr = addr_word.load(std::memory_order_seq_cst);
    bool withdrawn = addr == revoked_addr;
    std::string failed;
    if (!withdrawn && (in.sink || in.aside) && in.f.bytes) {
      bool ok = true;
      if (in.aside) {  // in pieces: an unmapped address (a corrupt count) fails before it costs memory
        auto& d = in.aside->data;
        constexpr std::uint64_t piece = std::uint64_t{1} << 20;
        for (std::uint64_t at = 0; ok && at < in.f.bytes; at += piece) {
          const std::size_t len = static_cast<std::size_t>(std::min(piece, in.f.bytes - at));
          d.resize(static_cast<std::size_t>(at) + len);
          ok = read_peer(from, d.data() + at, addr + at, len);
        }
      } else {
        ok = read_peer(from, in.sink, addr, in.f.bytes);
      }
      const int err = errno;
      std::atomic_thread_fence(std::memory_order_seq_cst);  // the copy is done before the check
      withdrawn = addr_word.load(std::memory_order_seq_cst) == revoked_addr;
      if (!ok && !withdrawn)
        failed = "process_vm_readv of a " + std::to_string(in.f.bytes) + "-byte message from rank " +
                 std::to_string(names_[static_cast<std::size_t>(from)]) + ": " + std::strerror(err);
    }
    r.control.acked.store(seq, std::memory_order_release);
    if (!failed.empty() && in.target) in.target->read_error = failed;  // its wait reports it
    finish(in, withdrawn || !failed.empty());
  }

  // A message for a receive that lies whole and in one piece in the ring (the producer starts such
  // a message at the ring's beginning if need be) is parked there; pass_parked decides if it stays.
  bool park(incoming& in, const ring& r, const cursor& c) {
    const std::size_t body = pad8(in.f.bytes);
    // In one piece: a correct producer starts such a message at the ring's beginning rather than
    // wrap it, but only the position says so (a wrapped one is streamed instead).
    if (!in.target || !in.sink || in.got != 0 || sizeof(frame) + body + trailer_bytes > r.capacity ||
        r.to_end(c.tail) < body + trailer_bytes ||
        c.available() < body + trailer_bytes || r.read<std::uint64_t>(c.tail + body) != trailer_whole)
      return false;
    in.state = read_state::parked;
    in.target->in_ring.store(r.data + r.offset(c.tail), std::memory_order_release);
    return true;
  }

  // Copies what has arrived of the message; at its trailer, the message is finished.
  bool stream(incoming& in, const ring& r, cursor& c) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(c.available(), in.f.bytes - in.got));
    if (n) {
      if (in.aside) {
        auto& d = in.aside->data;
        d.resize(static_cast<std::size_t>(in.got) + n);
        r.get(c.tail, d.data() + in.got, n);
      } else if (in.sink) {
        r.get(c.tail, in.sink + in.got, n);
      }
      c.tail += n;
      in.got += n;
    }
    const std::size_t pad = pad8(in.f.bytes) - in.f.bytes;
    if (in.got < in.f.bytes || c.available() < pad + trailer_bytes) return false;
    c.tail += pad;
    const auto trailer = r.read<std::uint64_t>(c.tail);
    c.tail += trailer_bytes;
    finish(in, trailer != trailer_whole);
    return true;
  }

  // The message being read is complete: its receive is done, or it waits aside.
  static void finish(incoming& in, bool withdrawn) {
    if (in.target) {
      in.target->withdrawn = withdrawn;
      in.target->done.store(true, std::memory_order_release);
    }
    if (in.aside) {
      in.aside->complete = true;
      in.aside->withdrawn = withdrawn;  // kept even so: its receive reports the withdrawal
      auto& un = in.unexpected;
      if (in.aside->claimed) {
        deliver(*in.aside, *in.aside->claimed);
        un.erase(std::remove(un.begin(), un.end(), in.aside), un.end());
      }
    }
    in.state = read_state::between;
    in.target = nullptr;
    in.aside = nullptr;
    in.sink = nullptr;
  }

  // The parked message's receive is done; the caller frees its room.
  static void complete_parked(incoming& in) {
    in.target->in_ring.store(nullptr, std::memory_order_relaxed);
    in.target->done.store(true, std::memory_order_release);
    in.state = read_state::between;
    in.target = nullptr;
    in.sink = nullptr;
  }
  // Frees the room of the message held in the ring from `from` and completes its receive.
  void consume_held(int from) {
    auto& in = in_[static_cast<std::size_t>(from)];
    const ring r = ring_of(from, local_);
    const std::uint64_t tail = r.control.tail.load(std::memory_order_relaxed) + pad8(in.f.bytes) + trailer_bytes;
    complete_parked(in);
    r.control.tail.store(tail, std::memory_order_release);
    block(from).bell.ring();
  }

  std::shared_ptr<segment> seg_;
  layout lay_;
  int local_;
  std::vector<int> names_;
  std::mutex m_;
  std::vector<ring_writer> out_;
  std::vector<incoming> in_;
  std::map<std::pair<int, std::uint32_t>, std::deque<std::shared_ptr<recv_op>>> posted_;
  std::vector<std::size_t> posted_count_;  // posted receives per local peer
  bool cma_ = false;
};

inline void request::release() noexcept {
  if (done_ || !ep_) return;
  done_ = true;
  std::visit([&](const auto& op) { ep_->withdraw(op, peer_); }, op_);
}

inline void view::reset() noexcept {
  if (held_ && ep_) ep_->release(*held_);
  held_ = nullptr;
  ep_ = nullptr;
  data = nullptr;
  bytes = 0;
  ok = false;
}

}  // namespace lockstep::transport::shm
