// lockstep/transport/shm.hpp: byte streams between the processes of one machine, through a
// shared-memory segment. The mpi transport sends to peers on its own node this way.
//
// Why not leave it to MPI: Open MPI moves a message above its 4 KiB eager limit on one node by
// rendezvous (vader + CMA): the receiver must run to pull the bytes and the sender must run again to
// see them taken, two scheduling delays per message. With more ranks than cores, and a step of a
// collective being one message per rank, those delays are what a 1 MiB all-reduce costs. Here a
// send copies its bytes into a ring the receiver owns and is complete at once; the receiver copies
// them out when it gets to them; a waiting rank sleeps on a futex that the peer rings, instead of
// polling with sleeps.
//
// Layout: one control block per local rank (doorbell, sleepers, failed flag and reason), then one
// single-producer single-consumer ring per ordered pair of local ranks. A message in a ring is a
// frame {magic, tag, bytes}, its payload, and a trailer saying whether it is whole or was withdrawn
// (its sender's call failed midway: the rest is zeros, and the receiver reports an error instead
// of handing out half a message). Messages larger than a ring stream through it.
//
// Matching follows the transport concept: per (peer, tag) in send order. A message at the head of
// a ring waits there for its receive; only when a receive for another tag from that peer is posted
// does it move to a private buffer (so the first step's data, sent beside a collective's headers,
// is read once, straight into place). A whole message for a posted receive is parked where it
// lies: a wait_view reads it there (nothing passes it until the view is released), a plain wait
// copies it out; it is copied out early when the sender runs out of room (the ring's starved
// flag) or a later receive from that peer is waited for first, so no ring ever waits on a
// receive nobody is waiting for.
//
// Large sends the receiver will copy (an all-gather's) can go by reference instead: the ring
// carries their address, the receiver copies them straight out of the sender's memory
// (process_vm_readv, where Linux allows it), and the send completes when it has.
//
// The segment is created by the node's first rank with shm_open and posix_fallocate (a full /dev/shm
// is an error at set-up, not a SIGBUS later), mapped by the others and unlinked once all have it.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
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

namespace lockstep::transport::detail {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory rings need address-free atomics");

// Sleeps while *word == expected, at most `timeout`; woken by futex_wake_all on the same word in
// any process that maps it. Elsewhere than Linux, a short sleep (callers loop).
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout <= std::chrono::nanoseconds::zero()) return;
#ifdef __linux__
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec ts{static_cast<std::time_t>(s.count()), static_cast<long>((timeout - s).count())};
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
#else
  if (word.load() == expected) std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(timeout, std::chrono::microseconds(50)));
#endif
}
inline void futex_wake_all(std::atomic<std::uint32_t>& word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// A named POSIX shared-memory object mapped into this process.
class shm_segment {
 public:
  shm_segment() = default;
  shm_segment(const shm_segment&) = delete;
  shm_segment& operator=(const shm_segment&) = delete;
  ~shm_segment() {
    if (base_) munmap(base_, bytes_);
  }

  // Creates `name` with every byte backed by memory now; returns an empty string or why not
  // (exists: the name was taken).
  std::string create(const std::string& name, std::size_t bytes, bool* exists = nullptr) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (exists) *exists = fd < 0 && errno == EEXIST;
    if (fd < 0) return "shm_open(" + name + "): " + std::strerror(errno);
    std::string why;
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) why = std::string("ftruncate: ") + std::strerror(errno);
    if (why.empty()) {
      const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
      if (rc != 0) why = "posix_fallocate of " + std::to_string(bytes) + " bytes in /dev/shm: " + std::strerror(rc);
    }
    if (why.empty()) why = map(fd, bytes);
    close(fd);
    if (!why.empty()) shm_unlink(name.c_str());
    return why;
  }
  std::string open(const std::string& name, std::size_t bytes) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) return "shm_open(" + name + "): " + std::strerror(errno);
    std::string why = map(fd, bytes);
    close(fd);
    return why;
  }
  static void unlink(const std::string& name) { shm_unlink(name.c_str()); }
  // Removes /dev/shm/<prefix><pid>-* left by processes that no longer exist (a job killed during
  // set-up, between create and the unlink that follows once every rank has mapped it). The
  // prefix should name this PID namespace: a pid means nothing in another one.
  static void sweep(const std::string& prefix) {
    DIR* dir = opendir("/dev/shm");
    if (!dir) return;
    while (const dirent* e = readdir(dir)) {
      const std::string n = e->d_name;
      if (n.rfind(prefix, 0) != 0) continue;
      char* end = nullptr;
      const long pid = std::strtol(n.c_str() + prefix.size(), &end, 10);
      if (pid <= 0 || !end || *end != '-') continue;  // not <prefix><pid>-<n>
      if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) shm_unlink(("/" + n).c_str());
    }
    closedir(dir);
  }

  std::byte* base() const noexcept { return static_cast<std::byte*>(base_); }

 private:
  std::string map(int fd, std::size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return std::string("mmap: ") + std::strerror(errno);
    base_ = p;
    bytes_ = bytes;
    return {};
  }
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

struct alignas(64) shm_rank_block {
  std::atomic<std::uint32_t> doorbell;  // bumped by anything this rank may be waiting for
  std::atomic<std::uint32_t> sleepers;  // threads of this rank asleep on the doorbell
  std::atomic<std::uint32_t> failed;    // this rank aborted the group; reason below
  std::atomic<std::int32_t> pid;        // for process_vm_readv of its by-reference sends
  std::atomic<std::uint64_t> probe;     // address of a word in its memory (the set-up's check)
  char reason[488];
};

struct shm_ring_control {
  alignas(64) std::atomic<std::uint64_t> head;     // bytes ever written (the producer's)
  std::atomic<std::uint32_t> starved;              // the producer has bytes to write and no room
  alignas(64) std::atomic<std::uint64_t> tail;     // bytes ever consumed (the consumer's)
  std::atomic<std::uint64_t> acked;                // by-reference sends read up to this number
};

// Sizes and offsets of a segment for `ranks` local ranks with rings of `capacity` bytes.
struct shm_layout {
  int ranks = 0;
  std::size_t capacity = 0;

  static constexpr std::size_t page = 4096;
  static constexpr std::size_t round(std::size_t b) { return (b + page - 1) / page * page; }
  std::size_t blocks_bytes() const { return round(sizeof(shm_rank_block) * static_cast<std::size_t>(ranks)); }
  std::size_t ring_bytes() const { return round(sizeof(shm_ring_control)) + capacity; }
  std::size_t rings() const { return static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks - 1); }
  std::size_t total() const { return blocks_bytes() + rings() * ring_bytes(); }
  // The ring from local rank `from` to local rank `to` (from != to).
  std::size_t ring_offset(int from, int to) const {
    const std::size_t i = static_cast<std::size_t>(from) * static_cast<std::size_t>(ranks - 1) +
                          static_cast<std::size_t>(to < from ? to : to - 1);
    return blocks_bytes() + i * ring_bytes();
  }
};

// One send: copied into the ring as space allows. data == nullptr once withdrawn (zeros follow).
struct shm_send {
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  std::size_t sent = 0;  // payload bytes written
  std::uint32_t tag = 0;
  bool by_ref = false;       // only its address goes into the ring; the receiver reads it (CMA)
  std::uint64_t ref_seq = 0; // its number among this ring's by-reference sends
  std::uint64_t record_pos = 0;  // ring position of its record's address word
  bool framed = false;
  bool withdrawn = false;
  // The whole message (trailer too) is in the ring, or a by-reference one was read: the
  // sender's memory is its own again. Written under the endpoint's lock, read by waiters.
  std::atomic<bool> done{false};
};

// One receive: done once its message is read; got >= 0 when that message had another size;
// withdrawn when the sender abandoned it.
struct shm_recv {
  std::byte* dst = nullptr;
  std::size_t bytes = 0;
  int from = -1;
  std::uint32_t tag = 0;
  std::int64_t got = -1;
  bool withdrawn = false;
  std::string read_error;  // a by-reference read that failed (process_vm_readv's reason)
  // Set under the endpoint's lock, after got, withdrawn and read_error; read by waiters.
  std::atomic<bool> done{false};
  // Arrived whole and left in the ring for a wait_view: read it there, then release_view().
  std::atomic<const std::byte*> in_ring{nullptr};
};

// This rank's end of a node's segment: `local` is its index among `ranks` local ranks, and
// names[i] the rank number error messages use for local rank i (the communicator's).
class shm_endpoint {
 public:
  static constexpr std::uint32_t frame_magic = 0x4c4b534d;  // "LKSM"
  // The rest of the ring up to its end is unused: a message that fits the ring starts at its
  // beginning instead of wrapping, so that the receiver can read it in place.
  static constexpr std::uint32_t skip_magic = 0x4c4b534b;  // "LKSK"
  // A by-reference message: the frame, then {address, number}; the receiver copies the bytes out
  // of the sender's memory (process_vm_readv) and acknowledges the number.
  static constexpr std::uint32_t ref_magic = 0x4c4b5352;  // "LKSR"
  struct ref_record {
    std::uint64_t addr, seq;
  };
  // What a withdrawn by-reference send's address word is overwritten with (no process has it).
  static constexpr std::uint64_t revoked_addr = ~std::uint64_t{0};
  static constexpr std::size_t pad8(std::size_t b) { return (b + 7) / 8 * 8; }
  static constexpr std::uint64_t trailer_whole = 0x57484f4c45ull, trailer_withdrawn = 0x5749544844ull;
  struct frame {
    std::uint32_t magic, tag;
    std::uint64_t bytes;
  };

  shm_endpoint(std::shared_ptr<shm_segment> seg, shm_layout layout, int local, std::vector<int> names)
      : seg_(std::move(seg)), lay_(layout), local_(local), names_(std::move(names)),
        out_(static_cast<std::size_t>(layout.ranks)), in_(static_cast<std::size_t>(layout.ranks)),
        posted_count_(static_cast<std::size_t>(layout.ranks), 0) {}

  int ranks() const noexcept { return lay_.ranks; }
  std::size_t capacity() const noexcept { return lay_.capacity; }

  // Queues a send to local rank `to` and writes what fits now. in_place: the caller keeps the bytes
  // unchanged until the send completes, and the receiver will copy them, not add them: from
  // ref_min_bytes on (and where the set-up found process_vm_readv allowed) only their address goes
  // into the ring and the receiver copies them straight from this process, one copy instead of
  // two; the send then completes when the receiver has read them.
  static constexpr std::size_t ref_min_bytes = std::size_t{64} << 10;
  std::shared_ptr<shm_send> post_send(int to, std::uint32_t tag, const void* data, std::size_t bytes, bool in_place = false) {
    auto s = std::make_shared<shm_send>();
    s->data = static_cast<const std::byte*>(data);
    s->bytes = bytes;
    s->tag = tag;
    s->by_ref = in_place && cma_ && bytes >= ref_min_bytes;
    std::lock_guard lk(m_);
    out_[static_cast<std::size_t>(to)].q.push_back(s);
    pump(to);
    return s;
  }

  // Posts a receive from local rank `from`; a message already set aside for it is delivered now.
  std::shared_ptr<shm_recv> post_recv(int from, std::uint32_t tag, void* dst, std::size_t bytes) {
    auto r = std::make_shared<shm_recv>();
    r->dst = static_cast<std::byte*>(dst);
    r->bytes = bytes;
    r->from = from;
    r->tag = tag;
    std::lock_guard lk(m_);
    auto& un = in_[static_cast<std::size_t>(from)].unexpected;
    for (auto it = un.begin(); it != un.end(); ++it) {
      if ((*it)->tag != tag || (*it)->claimed) continue;
      if ((*it)->complete) {
        deliver(**it, *r);
        un.erase(it);
      } else {
        (*it)->claimed = r;
      }
      return r;
    }
    posted_[{from, tag}].push_back(r);
    ++posted_count_[static_cast<std::size_t>(from)];
    drain(from, nullptr, false);
    return r;
  }

  // Moves whatever can move on every ring of this rank. in_place: `want` is waited for by a
  // wait_view, so its message, once whole in the ring, is left there (want->in_ring) for the
  // caller to read, and its ring moves on only at release_view(). Every other message goes to
  // its receive's memory as it arrives, so no ring waits on a receive nobody is reading.
  bool progress(const shm_recv* want = nullptr, bool in_place = false) {
    std::lock_guard lk(m_);
    bool moved = false;
    for (int p = 0; p < lay_.ranks; ++p) {
      if (p == local_) continue;
      moved |= pump(p);
      moved |= drain(p, want, in_place);
    }
    return moved;
  }

  // The caller has read a message in the ring (wait_view): free its room for the sender.
  void release_view(const std::shared_ptr<shm_recv>& r) {
    std::lock_guard lk(m_);
    if (r->in_ring.load(std::memory_order_relaxed)) consume_held(r->from);
  }
  // The caller of wait_view takes r's parked message to read in place: nothing passes it until
  // release_view(). Null when it is not parked (copied out meanwhile: r is done).
  const std::byte* hold_view(const std::shared_ptr<shm_recv>& r) {
    std::lock_guard lk(m_);
    auto& in = in_[static_cast<std::size_t>(r->from)];
    if (!in.parked || in.target != r) return nullptr;
    in.viewed = true;
    return r->in_ring.load(std::memory_order_relaxed);
  }
  // A plain wait for a receive whose message waits in the ring: copy it to the receive's memory.
  void take(const std::shared_ptr<shm_recv>& r) {
    std::lock_guard lk(m_);
    auto& in = in_[static_cast<std::size_t>(r->from)];
    if (!r->in_ring.load(std::memory_order_relaxed) || in.viewed) return;
    if (r->bytes) std::memcpy(r->dst, r->in_ring.load(std::memory_order_relaxed), r->bytes);
    consume_held(r->from);
  }

  // A send whose request is destroyed unfinished: unwritten, it is dropped; half written, the
  // rest goes as zeros and the trailer says withdrawn. The caller's memory is not read again.
  void withdraw(const std::shared_ptr<shm_send>& s, int to) {
    std::lock_guard lk(m_);
    if (s->done.load(std::memory_order_relaxed)) return;
    auto& q = out_[static_cast<std::size_t>(to)].q;
    if (s->by_ref && s->framed) {
      // Unread yet: overwrite its record's address. The receiver reads that word before and
      // after it copies, so it never hands out bytes read from memory the sender may have freed
      // (it reports the message withdrawn instead). The record's room cannot have been reused:
      // the receiver acknowledges before it frees it, and only this rank, under this lock,
      // writes the ring.
      if (control(local_, to).acked.load(std::memory_order_acquire) < s->ref_seq) {
        std::atomic_ref<std::uint64_t>(*address_word(local_, to, s->record_pos)).store(revoked_addr, std::memory_order_seq_cst);
        std::atomic_thread_fence(std::memory_order_seq_cst);  // no later write of the bytes overtakes it
      }
      s->done.store(true, std::memory_order_relaxed);
      return;
    }
    if (!s->framed) {
      q.erase(std::remove(q.begin(), q.end(), s), q.end());
      s->done.store(true, std::memory_order_relaxed);
      pump(to);  // settles the ring's starved flag
      return;
    }
    s->data = nullptr;
    s->withdrawn = true;
    pump(to);
  }
  // A receive whose request is destroyed unfinished: no byte lands in its memory afterwards.
  void withdraw(const std::shared_ptr<shm_recv>& r, int from) {
    std::lock_guard lk(m_);
    if (r->done.load(std::memory_order_relaxed)) return;
    auto& in = in_[static_cast<std::size_t>(from)];
    if (in.target == r && in.parked) {  // viewed too: a live view finished the request first
      consume_held(from);                // dropped unread
      return;
    }
    r->done.store(true, std::memory_order_relaxed);
    if (in.target == r) {
      in.target = nullptr;
      in.sink = nullptr;
      return;
    }
    for (auto& u : in.unexpected)
      if (u->claimed == r) {
        // Its message belongs to the next receive posted for the tag, as if r had never been.
        u->claimed = nullptr;
        auto next = posted_.find({from, r->tag});
        if (next != posted_.end()) {
          u->claimed = next->second.front();
          next->second.pop_front();
          --posted_count_[static_cast<std::size_t>(from)];
          if (next->second.empty()) posted_.erase(next);
          if (u->complete) {
            deliver(*u, *u->claimed);
            in.unexpected.erase(std::find(in.unexpected.begin(), in.unexpected.end(), u));
          }
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

  // The doorbell's value before a look at the rings; sleep(seen, ...) returns at once if it moved.
  std::uint32_t doorbell() const noexcept { return block(local_).doorbell.load(std::memory_order_acquire); }
  void sleep(std::uint32_t seen, std::chrono::nanoseconds timeout) {
    auto& b = block(local_);
    b.sleepers.fetch_add(1, std::memory_order_seq_cst);
    futex_wait(b.doorbell, seen, timeout);
    b.sleepers.fetch_sub(1, std::memory_order_relaxed);
  }

  // Marks this rank failed for every local rank of the group and wakes them.
  void fail(const std::string& reason) {
    auto& b = block(local_);
    if (b.failed.load()) return;
    const std::size_t n = std::min(reason.size(), sizeof b.reason - 1);
    std::memcpy(b.reason, reason.data(), n);
    b.reason[n] = '\0';
    b.failed.store(1, std::memory_order_release);
    for (int p = 0; p < lay_.ranks; ++p) ring(p, true);
  }
  // Throws errc::aborted when another local rank of the group failed.
  void throw_if_peer_failed(const char* op, int peer_name) const {
    for (int p = 0; p < lay_.ranks; ++p) {
      if (p == local_ || !block(p).failed.load(std::memory_order_acquire)) continue;
      throw error(errc::aborted, op, names_[static_cast<std::size_t>(local_)], peer_name,
                  "rank " + std::to_string(names_[static_cast<std::size_t>(p)]) + " failed: " + std::string(block(p).reason));
    }
  }

  // Set-up of by-reference sends (collective over the node, with a barrier between the two
  // calls): publish this process, then read a word of every other local rank's memory. Linux may
  // forbid it (Yama ptrace_scope, containers); set_by_reference(false) then keeps every byte in
  // the rings.
  void publish_identity() {
    static const std::uint64_t probe_word = 0x4c4f434b53544550ull;  // "LOCKSTEP"
    block(local_).pid.store(static_cast<std::int32_t>(getpid()), std::memory_order_relaxed);
    block(local_).probe.store(reinterpret_cast<std::uintptr_t>(&probe_word), std::memory_order_release);
  }
  bool can_read_peers() const {
    for (int p = 0; p < lay_.ranks; ++p) {
      if (p == local_) continue;
      std::uint64_t got = 0;
      const std::uint64_t addr = block(p).probe.load(std::memory_order_acquire);
      if (!read_peer(p, &got, addr, sizeof got) || got != 0x4c4f434b53544550ull) return false;
    }
    return true;
  }
  void set_by_reference(bool on) { cma_ = on; }
  bool by_reference() const noexcept { return cma_; }

 private:
  struct unexpected_msg {
    std::uint32_t tag = 0;
    std::vector<std::byte> data;
    bool complete = false, withdrawn = false;
    std::shared_ptr<shm_recv> claimed;  // a receive posted while this was still arriving
  };
  struct outgoing {
    std::deque<std::shared_ptr<shm_send>> q;
    std::deque<std::shared_ptr<shm_send>> reading;  // by-reference sends the receiver has not read
    std::uint64_t ref_seq = 0;
    bool trailer_due = false;
    std::size_t pad = 0;  // bytes after the payload that keep positions 8-aligned
    std::uint64_t trailer = 0;
  };
  struct incoming {
    bool active = false;              // inside a message
    // The message lies whole in the ring for target (target->in_ring): parked until its receive
    // is waited for, copied out if the producer runs out of room or a later receive from this
    // peer is waited for first; viewed while a wait_view's caller reads it (nothing passes).
    bool parked = false, viewed = false;
    frame f{};
    std::uint64_t got = 0;            // payload bytes read
    std::byte* sink = nullptr;        // where payload goes (null: skipped)
    std::shared_ptr<shm_recv> target; // the receive being filled, if any
    std::shared_ptr<unexpected_msg> aside;
    std::deque<std::shared_ptr<unexpected_msg>> unexpected;
  };

  shm_rank_block& block(int r) const { return reinterpret_cast<shm_rank_block*>(seg_->base())[r]; }
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
  shm_ring_control& control(int from, int to) const {
    return *reinterpret_cast<shm_ring_control*>(seg_->base() + lay_.ring_offset(from, to));
  }
  std::byte* data(int from, int to) const {
    return seg_->base() + lay_.ring_offset(from, to) + shm_layout::round(sizeof(shm_ring_control));
  }
  // The address word of a by-reference record at ring position `pos` (8-aligned, never wrapped).
  std::uint64_t* address_word(int from, int to, std::uint64_t pos) const {
    return reinterpret_cast<std::uint64_t*>(data(from, to) + static_cast<std::size_t>(pos % lay_.capacity));
  }

  void ring(int p, bool always = false) {
    auto& b = block(p);
    b.doorbell.fetch_add(1, std::memory_order_seq_cst);
    if (always || b.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(b.doorbell);
  }

  void put(std::byte* ring_data, std::uint64_t pos, const std::byte* src, std::size_t n) const {
    const std::size_t off = static_cast<std::size_t>(pos % lay_.capacity), first = std::min(n, lay_.capacity - off);
    if (src) {
      std::memcpy(ring_data + off, src, first);
      std::memcpy(ring_data, src + first, n - first);
    } else {
      std::memset(ring_data + off, 0, first);
      std::memset(ring_data, 0, n - first);
    }
  }
  void get(const std::byte* ring_data, std::uint64_t pos, std::byte* dst, std::size_t n) const {
    const std::size_t off = static_cast<std::size_t>(pos % lay_.capacity), first = std::min(n, lay_.capacity - off);
    std::memcpy(dst, ring_data + off, first);
    std::memcpy(dst + first, ring_data, n - first);
  }

  // Writes queued sends to local rank `to` as far as its ring has room. Lock held. Positions stay
  // multiples of 8 (frame 16, payload padded, trailer 8).
  bool pump(int to) {
    auto& o = out_[static_cast<std::size_t>(to)];
    auto& c = control(local_, to);
    if (!o.reading.empty()) {  // acknowledged by-reference sends are complete (in ring order)
      const std::uint64_t acked = c.acked.load(std::memory_order_acquire);
      while (!o.reading.empty() && o.reading.front()->ref_seq <= acked) {
        o.reading.front()->done.store(true, std::memory_order_release);
        o.reading.pop_front();
      }
    }
    std::byte* d = data(local_, to);
    const std::size_t cap = lay_.capacity;
    std::uint64_t head = c.head.load(std::memory_order_relaxed);
    const std::uint64_t tail = c.tail.load(std::memory_order_acquire);
    auto room = [&] { return cap - static_cast<std::size_t>(head - tail); };
    const std::uint64_t start = head;
    for (;;) {
      if (o.trailer_due) {
        if (room() < o.pad + sizeof o.trailer) break;
        head += o.pad;
        put(d, head, reinterpret_cast<const std::byte*>(&o.trailer), sizeof o.trailer);
        head += sizeof o.trailer;
        o.trailer_due = false;
        o.q.front()->done.store(true, std::memory_order_release);
        o.q.pop_front();
      }
      if (o.q.empty()) break;
      shm_send& s = *o.q.front();
      if (!s.framed) {
        const std::size_t to_end = cap - static_cast<std::size_t>(head % cap);
        const std::size_t total = s.by_ref ? sizeof(frame) + sizeof(ref_record) : sizeof(frame) + pad8(s.bytes) + sizeof(std::uint64_t);
        if (to_end < sizeof(frame) || (total <= cap && total > to_end)) {
          if (room() < to_end) break;
          if (to_end >= sizeof(frame)) {
            const frame k{skip_magic, 0, 0};
            put(d, head, reinterpret_cast<const std::byte*>(&k), sizeof k);
          }
          head += to_end;
          continue;
        }
        if (s.by_ref) {
          if (room() < total) break;
          const frame f{ref_magic, s.tag, s.bytes};
          const ref_record rr{reinterpret_cast<std::uintptr_t>(s.data), ++o.ref_seq};
          put(d, head, reinterpret_cast<const std::byte*>(&f), sizeof f);
          put(d, head + sizeof f, reinterpret_cast<const std::byte*>(&rr), sizeof rr);
          s.record_pos = head + sizeof f;
          head += total;
          s.framed = true;
          s.ref_seq = rr.seq;
          o.reading.push_back(o.q.front());
          o.q.pop_front();
          continue;
        }
        if (room() < sizeof(frame)) break;
        const frame f{frame_magic, s.tag, s.bytes};
        put(d, head, reinterpret_cast<const std::byte*>(&f), sizeof f);
        head += sizeof f;
        s.framed = true;
      }
      const std::size_t n = std::min(room(), s.bytes - s.sent);
      if (n) {
        put(d, head, s.data ? s.data + s.sent : nullptr, n);
        head += n;
        s.sent += n;
      }
      if (s.sent < s.bytes) break;
      o.trailer = s.withdrawn ? trailer_withdrawn : trailer_whole;
      o.pad = pad8(s.bytes) - s.bytes;
      o.trailer_due = true;
    }
    // Out of room with bytes still to write: tell the receiver, which then copies out messages
    // it had left parked in the ring (drain), so that a ring never waits on a receive nobody
    // is waiting for.
    // (Unread by-reference sends count: their records may wait behind a parked message.)
    const std::uint32_t starved = !o.q.empty() || o.trailer_due || !o.reading.empty() ? 1 : 0;
    const bool newly = starved && !c.starved.load(std::memory_order_relaxed);
    if (starved != c.starved.load(std::memory_order_relaxed)) c.starved.store(starved, std::memory_order_release);
    if (head == start) {
      if (newly) ring(to);
      return false;
    }
    c.head.store(head, std::memory_order_release);
    ring(to);
    return true;
  }

  // Reads messages from local rank `from` into their receives. A message nobody asked for stays
  // in the ring unless a receive for another tag from `from` is waiting behind it; the message a
  // wait_view waits for stays once whole (progress()). Lock held.
  bool drain(int from, const shm_recv* want, bool in_place) {
    auto& in = in_[static_cast<std::size_t>(from)];
    auto& c = control(from, local_);
    const std::byte* d = data(from, local_);
    const std::size_t cap = lay_.capacity;
    std::uint64_t tail = c.tail.load(std::memory_order_relaxed);
    const std::uint64_t head = c.head.load(std::memory_order_acquire);
    const std::uint64_t start = tail;
    for (;;) {
      if (in.viewed) break;  // a view is reading it; nothing passes until release_view()
      if (in.parked) {
        if (in_place && in.target.get() == want) break;  // for the caller's hold_view()
        const bool must_pass = c.starved.load(std::memory_order_acquire) || (want && want->from == from && want != in.target.get());
        if (!must_pass) break;
        const std::byte* at = in.target->in_ring.load(std::memory_order_relaxed);
        if (in.target->bytes) std::memcpy(in.target->dst, at, in.target->bytes);
        tail += pad8(in.f.bytes) + sizeof(std::uint64_t);
        in.target->in_ring.store(nullptr, std::memory_order_relaxed);
        in.target->done.store(true, std::memory_order_release);
        in.active = in.parked = false;
        in.target = nullptr;
        in.sink = nullptr;
        continue;
      }
      if (!in.active) {
        const std::size_t to_end = cap - static_cast<std::size_t>(tail % cap);
        if (to_end < sizeof(frame)) {  // the producer skipped this stub too
          if (head - tail < to_end) break;
          tail += to_end;
          continue;
        }
        if (head - tail < sizeof(frame)) break;
        frame f;
        get(d, tail, reinterpret_cast<std::byte*>(&f), sizeof f);
        if (f.magic == skip_magic) {  // written together with the whole skipped stretch
          tail += to_end;
          continue;
        }
        if (f.magic != frame_magic && f.magic != ref_magic)
          throw error(errc::transport, "recv", names_[static_cast<std::size_t>(local_)], names_[static_cast<std::size_t>(from)],
                      "shared-memory ring corrupt (no message frame where one was due)");
        const bool ref = f.magic == ref_magic;
        if (ref && head - tail < sizeof(frame) + sizeof(ref_record)) break;  // written at once; not yet
        auto it = posted_.find({from, f.tag});
        if (it != posted_.end()) {
          in.target = it->second.front();
          it->second.pop_front();
          --posted_count_[static_cast<std::size_t>(from)];
          if (it->second.empty()) posted_.erase(it);
          if (in.target->bytes == f.bytes) {
            in.sink = in.target->dst;
          } else {
            in.target->got = static_cast<std::int64_t>(f.bytes);
            in.sink = nullptr;
          }
        } else if (posted_count_[static_cast<std::size_t>(from)] > 0) {
          in.aside = std::make_shared<unexpected_msg>();
          in.aside->tag = f.tag;
          in.aside->data.resize(f.bytes);
          in.sink = in.aside->data.data();
          in.unexpected.push_back(in.aside);
        } else {
          break;  // leave it for the receive that will come
        }
        tail += sizeof f;
        in.f = f;
        in.got = 0;
        in.active = true;
        in.parked = in.viewed = false;
        if (ref) {
          // The address word may be overwritten by a withdrawing sender: read it atomically, before
          // and after the copy, and keep nothing read while it withdrew.
          std::atomic_ref<std::uint64_t> addr_word(*address_word(from, local_, tail));
          std::uint64_t seq = 0;
          get(d, tail + sizeof(std::uint64_t), reinterpret_cast<std::byte*>(&seq), sizeof seq);
          tail += sizeof(ref_record);
          const std::uint64_t addr = addr_word.load(std::memory_order_seq_cst);
          bool withdrawn = addr == revoked_addr;
          std::string failed;
          if (!withdrawn && in.sink && f.bytes) {
            const bool ok = read_peer(from, in.sink, addr, f.bytes);
            const int err = errno;
            std::atomic_thread_fence(std::memory_order_seq_cst);  // the copy is done before the check
            withdrawn = addr_word.load(std::memory_order_seq_cst) == revoked_addr;
            if (!ok && !withdrawn)
              failed = "process_vm_readv of a " + std::to_string(f.bytes) + "-byte message from rank " +
                       std::to_string(names_[static_cast<std::size_t>(from)]) + ": " + std::strerror(err);
          }
          c.acked.store(seq, std::memory_order_release);
          if (!failed.empty() && in.target) in.target->read_error = failed;  // its wait reports it
          finish(in, withdrawn || !failed.empty());
          continue;
        }
      }
      const std::size_t body = pad8(in.f.bytes);
      if (in.target && in.sink && in.got == 0 && sizeof(frame) + body + sizeof(std::uint64_t) <= cap &&
          head - tail >= body + sizeof(std::uint64_t)) {
        // Whole, and in one piece (pump starts such a message at the ring's beginning if need
        // be): park it where it is; the loop's top decides whether it stays.
        std::uint64_t trailer = 0;
        get(d, tail + body, reinterpret_cast<std::byte*>(&trailer), sizeof trailer);
        if (trailer == trailer_whole) {
          in.parked = true;
          in.target->in_ring.store(d + tail % cap, std::memory_order_release);
          continue;
        }
      }
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(head - tail, in.f.bytes - in.got));
      if (n) {
        if (in.sink) get(d, tail, in.sink + in.got, n);
        tail += n;
        in.got += n;
      }
      const std::size_t pad = body - in.f.bytes;
      if (in.got < in.f.bytes || head - tail < pad + sizeof(std::uint64_t)) break;
      tail += pad;
      std::uint64_t trailer = 0;
      get(d, tail, reinterpret_cast<std::byte*>(&trailer), sizeof trailer);
      tail += sizeof trailer;
      finish(in, trailer != trailer_whole);
    }
    if (tail == start) return false;
    c.tail.store(tail, std::memory_order_release);
    ring(from);
    // A receive completed here may be another thread's of this rank, asleep on our doorbell.
    if (block(local_).sleepers.load(std::memory_order_seq_cst) > 0) ring(local_, true);
    return true;
  }

  // The message being read is complete: its receive is done, or it waits aside. Lock held.
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
    in.active = false;
    in.target = nullptr;
    in.aside = nullptr;
    in.sink = nullptr;
  }

  // Frees the room of the message held in the ring from `from`; its receive is done. Lock held.
  void consume_held(int from) {
    auto& in = in_[static_cast<std::size_t>(from)];
    auto& c = control(from, local_);
    const std::uint64_t tail = c.tail.load(std::memory_order_relaxed) + pad8(in.f.bytes) + sizeof(std::uint64_t);
    in.target->in_ring.store(nullptr, std::memory_order_relaxed);
    in.target->done.store(true, std::memory_order_release);
    in.active = in.parked = in.viewed = false;
    in.target = nullptr;
    in.sink = nullptr;
    c.tail.store(tail, std::memory_order_release);
    ring(from);
  }

  static void deliver(unexpected_msg& u, shm_recv& r) {
    if (u.data.size() == r.bytes) {
      if (r.bytes) std::memcpy(r.dst, u.data.data(), r.bytes);
    } else {
      r.got = static_cast<std::int64_t>(u.data.size());
    }
    r.withdrawn = u.withdrawn;
    r.done.store(true, std::memory_order_release);
  }

  std::shared_ptr<shm_segment> seg_;
  shm_layout lay_;
  int local_;
  std::vector<int> names_;
  std::mutex m_;
  std::vector<outgoing> out_;
  std::vector<incoming> in_;
  std::map<std::pair<int, std::uint32_t>, std::deque<std::shared_ptr<shm_recv>>> posted_;
  std::vector<std::size_t> posted_count_;  // posted receives per local peer
  bool cma_ = false;
};

}  // namespace lockstep::transport::detail
