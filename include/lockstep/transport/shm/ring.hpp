// lockstep/transport/shm/ring.hpp: one direction between two processes of a node: a
// single-producer single-consumer ring of framed messages in shared memory, the writer that
// fills it, and the futex doorbell a waiting process sleeps on.
//
// A message in a ring is a frame {magic, tag, bytes}, its payload padded to 8 bytes, and a trailer
// saying whether it is whole or was withdrawn (its sender's call failed midway: the rest is zeros,
// and the receiver reports an error instead of handing out half a message). Messages larger than
// the ring stream through it; one that fits starts at the ring's beginning rather than wrap, so
// that the receiver can read it where it lies. A by-reference message is a frame and {address,
// number}: the receiver copies the bytes out of the sender's memory and acknowledges the number.
// Positions are byte counts since the ring was made (head: written, tail: consumed), multiples of 8.
#pragma once

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <deque>
#include <memory>
#include <thread>

namespace lockstep::transport::shm {

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

// What a process waits on: bumped by anything it may be waiting for (a peer's write or read of a
// ring of its, an abort). A waiter reads it before looking, and sleeps only if it has not moved.
struct doorbell {
  std::atomic<std::uint32_t> count;
  std::atomic<std::uint32_t> sleepers;  // threads asleep on count

  std::uint32_t seen() const noexcept { return count.load(std::memory_order_acquire); }
  // A system call only where somebody sleeps (or always: an abort must wake every waiter).
  void ring(bool always = false) {
    count.fetch_add(1, std::memory_order_seq_cst);
    if (always || sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(count);
  }
  void sleep(std::uint32_t seen, std::chrono::nanoseconds timeout) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    futex_wait(count, seen, timeout);
    sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
};

struct ring_control {
  alignas(64) std::atomic<std::uint64_t> head;  // bytes ever written (the producer's)
  std::atomic<std::uint32_t> starved;           // the producer has bytes to write and no room
  alignas(64) std::atomic<std::uint64_t> tail;  // bytes ever consumed (the consumer's)
  std::atomic<std::uint64_t> acked;             // by-reference sends read up to this number
};

// The wire format.
struct frame {
  std::uint32_t magic, tag;
  std::uint64_t bytes;
};
inline constexpr std::uint32_t frame_magic = 0x4c4b534d;  // "LKSM": payload and trailer follow
inline constexpr std::uint32_t skip_magic = 0x4c4b534b;   // "LKSK": the rest up to the ring's end is unused
inline constexpr std::uint32_t ref_magic = 0x4c4b5352;    // "LKSR": a ref_record follows
struct ref_record {
  std::uint64_t addr, seq;
};
// What a withdrawn by-reference send's address word is overwritten with (no process has it).
inline constexpr std::uint64_t revoked_addr = ~std::uint64_t{0};
inline constexpr std::uint64_t trailer_whole = 0x57484f4c45ull, trailer_withdrawn = 0x5749544844ull;
inline constexpr std::size_t trailer_bytes = sizeof(std::uint64_t);
constexpr std::size_t pad8(std::size_t b) { return (b + 7) / 8 * 8; }

// One ring as either end sees it: its control block and its `capacity` bytes of data.
struct ring {
  ring_control& control;
  std::byte* data;
  std::size_t capacity;

  std::size_t offset(std::uint64_t pos) const { return static_cast<std::size_t>(pos % capacity); }
  std::size_t to_end(std::uint64_t pos) const { return capacity - offset(pos); }
  // Copies n bytes in at pos, wrapping; src == nullptr writes zeros.
  void put(std::uint64_t pos, const void* src, std::size_t n) const {
    const std::size_t off = offset(pos), first = std::min(n, capacity - off);
    const auto* s = static_cast<const std::byte*>(src);
    if (s) {
      std::memcpy(data + off, s, first);
      std::memcpy(data, s + first, n - first);
    } else {
      std::memset(data + off, 0, first);
      std::memset(data, 0, n - first);
    }
  }
  void get(std::uint64_t pos, void* dst, std::size_t n) const {
    const std::size_t off = offset(pos), first = std::min(n, capacity - off);
    std::memcpy(dst, data + off, first);
    std::memcpy(static_cast<std::byte*>(dst) + first, data, n - first);
  }
  template <class T>
  T read(std::uint64_t pos) const {
    T v;
    get(pos, &v, sizeof v);
    return v;
  }
  // The word at pos (8-aligned, never wrapped): a by-reference record's address.
  std::uint64_t& word(std::uint64_t pos) const { return *reinterpret_cast<std::uint64_t*>(data + offset(pos)); }
};

// One send, from queued to done:
//   queued     nothing written yet (withdrawn: dropped)
//   streaming  frame written, payload going in as room allows (withdrawn: the rest as zeros)
//   trailing   payload written, trailer due
//   reading    by reference: the record is written, the receiver has not read the bytes yet
enum class send_state : std::uint8_t { queued, streaming, trailing, reading };

struct send_op {
  const std::byte* data = nullptr;  // null once withdrawn
  std::size_t bytes = 0;
  std::size_t sent = 0;  // payload bytes written
  std::uint32_t tag = 0;
  bool by_ref = false;            // only its address goes into the ring; the receiver reads it
  std::uint64_t ref_seq = 0;      // its number among this ring's by-reference sends
  std::uint64_t record_pos = 0;   // ring position of its record's address word
  send_state state = send_state::queued;
  bool withdrawn = false;
  std::uint64_t trailer = 0;      // fixed when the payload is in: whole unless withdrawn before
  // The whole message is in the ring, or a by-reference one was read: the sender's memory is
  // its own again. Written under the endpoint's lock, read by waiters.
  std::atomic<bool> done{false};
};

// The producer's end of one ring: its queued sends, written as room allows. Not thread-safe (the
// endpoint's lock guards it).
class ring_writer {
 public:
  // Writes what fits. Rings `bell`, the consumer's, when the head moved or when the ring just ran
  // out of room with bytes still to write: the consumer then copies out what it left parked in
  // the ring, so that a ring never waits on a receive nobody waits for. (Unread by-reference
  // sends count: their records may wait behind a parked message.)
  void pump(const ring& r, doorbell& bell) {
    complete_acknowledged(r);
    std::uint64_t head = r.control.head.load(std::memory_order_relaxed);
    const std::uint64_t start = head, tail = r.control.tail.load(std::memory_order_acquire);
    while (!queue_.empty() && step(r, *queue_.front(), head, r.capacity - static_cast<std::size_t>(head - tail))) {
    }
    const std::uint32_t starved = !queue_.empty() || !reading_.empty() ? 1 : 0;
    const std::uint32_t was = r.control.starved.load(std::memory_order_relaxed);
    if (starved != was) r.control.starved.store(starved, std::memory_order_release);
    if (head != start) r.control.head.store(head, std::memory_order_release);
    if (head != start || (starved && !was)) bell.ring();
  }

  void push(std::shared_ptr<send_op> s) { queue_.push_back(std::move(s)); }

  // A whole message written in one go, its payload by fill(std::byte* payload) straight into the
  // ring (fill is not called for an empty one): only where nothing is queued ahead of it (messages
  // stay in send order) and it fits, contiguous, in the room there is now; false, with nothing
  // written, otherwise. Never waits.
  // What the caller would otherwise have written to its own memory and copied in by push(), it
  // writes here once (the executor's fused add-and-forward, NCCL's recvReduceSend).
  template <class Fill>
  bool try_fill(const ring& r, doorbell& bell, std::uint32_t tag, std::size_t bytes, Fill&& fill) {
    if (!queue_.empty()) return false;
    complete_acknowledged(r);
    const std::size_t total = sizeof(frame) + pad8(bytes) + trailer_bytes;
    if (total > r.capacity) return false;
    std::uint64_t head = r.control.head.load(std::memory_order_relaxed);
    const std::uint64_t tail = r.control.tail.load(std::memory_order_acquire);
    const std::size_t room = r.capacity - static_cast<std::size_t>(head - tail);
    const std::size_t skip_bytes = skip_before(r, head, total);  // as open(): the message must not wrap
    if (room < skip_bytes + total) return false;
    if (skip_bytes) skip_to_start(r, head);
    const frame f{frame_magic, tag, bytes};
    r.put(head, &f, sizeof f);
    if (bytes) fill(r.data + r.offset(head + sizeof f));
    head += sizeof f + pad8(bytes);
    r.put(head, &trailer_whole, trailer_bytes);
    head += trailer_bytes;
    r.control.head.store(head, std::memory_order_release);
    bell.ring();
    return true;
  }

  // A send whose request is destroyed unfinished; the caller's memory is not read again. Queued,
  // it is dropped; streaming, the rest goes as zeros and the trailer says withdrawn; by
  // reference and unread, its record's address is overwritten: the receiver reads that word
  // before and after it copies, so it never hands out bytes read from memory the sender may have
  // freed. The record's room cannot have been reused: the receiver acknowledges before it frees
  // it, and only this writer writes the ring.
  void withdraw(const std::shared_ptr<send_op>& s, const ring& r, doorbell& bell) {
    if (s->done.load(std::memory_order_relaxed)) return;
    switch (s->state) {
      case send_state::reading:
        if (r.control.acked.load(std::memory_order_acquire) < s->ref_seq) {
          std::atomic_ref<std::uint64_t>(r.word(s->record_pos)).store(revoked_addr, std::memory_order_seq_cst);
          std::atomic_thread_fence(std::memory_order_seq_cst);  // no later write of the bytes overtakes it
        }
        s->done.store(true, std::memory_order_relaxed);
        return;
      case send_state::queued:
        // Sends queued behind it (the rest of the failing call's segments, one tag) would take
        // its place at the receiver, whose receive for it would then read the next segment: a
        // false mismatch that hides the failure, or, sizes alike, the wrong bytes. So it goes out
        // in its place as a withdrawn message (zeros, then the withdrawn trailer), as one caught
        // midway does; only the last in the queue is dropped unsent.
        if (queue_.back() != s) {
          s->by_ref = false;
          s->data = nullptr;
          s->withdrawn = true;
        } else {
          queue_.pop_back();
          s->done.store(true, std::memory_order_relaxed);
        }
        pump(r, bell);  // settles the ring's starved flag
        return;
      case send_state::streaming:
      case send_state::trailing:
        s->data = nullptr;
        s->withdrawn = true;
        pump(r, bell);
        return;
    }
  }

 private:
  // By-reference sends the consumer acknowledged are complete, in ring order.
  void complete_acknowledged(const ring& r) {
    if (reading_.empty()) return;
    const std::uint64_t acked = r.control.acked.load(std::memory_order_acquire);
    while (!reading_.empty() && reading_.front()->ref_seq <= acked) {
      reading_.front()->done.store(true, std::memory_order_release);
      reading_.pop_front();
    }
  }

  // Moves the oldest send on by one state, with `room` bytes free; false when they do not suffice.
  bool step(const ring& r, send_op& s, std::uint64_t& head, std::size_t room) {
    switch (s.state) {
      case send_state::queued: return open(r, s, head, room);
      case send_state::streaming: {
        const std::size_t n = std::min(room, s.bytes - s.sent);
        if (n) {
          r.put(head, s.data ? s.data + s.sent : nullptr, n);
          head += n;
          s.sent += n;
        }
        if (s.sent < s.bytes) return false;
        s.trailer = s.withdrawn ? trailer_withdrawn : trailer_whole;
        s.state = send_state::trailing;
        return true;
      }
      case send_state::trailing: {
        const std::size_t pad = pad8(s.bytes) - s.bytes;
        if (room < pad + trailer_bytes) return false;
        head += pad;
        r.put(head, &s.trailer, trailer_bytes);
        head += trailer_bytes;
        s.done.store(true, std::memory_order_release);
        queue_.pop_front();
        return true;
      }
      case send_state::reading: break;  // never queued
    }
    return false;
  }

  // What a message of `total` bytes (frame to trailer) written at `head` must skip first: the rest
  // of the ring, where the frame would not fit before the end, or the whole message would fit the
  // ring but not the rest of it (a message larger than the ring streams through its end); else 0.
  static std::size_t skip_before(const ring& r, std::uint64_t head, std::size_t total) {
    const std::size_t to_end = r.to_end(head);
    return to_end < sizeof(frame) || (total <= r.capacity && total > to_end) ? to_end : 0;
  }
  // Moves `head` to the ring's start, with a skip frame where one fits (the reader skips a tail
  // too short for a frame on its own).
  static void skip_to_start(const ring& r, std::uint64_t& head) {
    const std::size_t to_end = r.to_end(head);
    if (to_end >= sizeof(frame)) r.put(head, &skip, sizeof skip);
    head += to_end;
  }

  // Writes the frame of a queued send (its whole record, by reference), first skipping to the
  // ring's start where skip_before says so.
  bool open(const ring& r, send_op& s, std::uint64_t& head, std::size_t room) {
    const std::size_t total = s.by_ref ? sizeof(frame) + sizeof(ref_record) : sizeof(frame) + pad8(s.bytes) + trailer_bytes;
    if (const std::size_t skip_bytes = skip_before(r, head, total)) {
      if (room < skip_bytes) return false;
      skip_to_start(r, head);
      return true;
    }
    if (s.by_ref) {
      if (room < total) return false;
      const frame f{ref_magic, s.tag, s.bytes};
      const ref_record rr{reinterpret_cast<std::uintptr_t>(s.data), ++ref_seq_};
      r.put(head, &f, sizeof f);
      r.put(head + sizeof f, &rr, sizeof rr);
      s.record_pos = head + sizeof f;
      s.ref_seq = rr.seq;
      s.state = send_state::reading;
      head += total;
      reading_.push_back(std::move(queue_.front()));
      queue_.pop_front();
      return true;
    }
    if (room < sizeof(frame)) return false;
    const frame f{frame_magic, s.tag, s.bytes};
    r.put(head, &f, sizeof f);
    head += sizeof f;
    s.state = send_state::streaming;
    return true;
  }

  static constexpr frame skip{skip_magic, 0, 0};
  std::deque<std::shared_ptr<send_op>> queue_;    // not yet whole in the ring, oldest first
  std::deque<std::shared_ptr<send_op>> reading_;  // by reference, not yet read by the consumer
  std::uint64_t ref_seq_ = 0;
};

}  // namespace lockstep::transport::shm
