// python/lockstep_torch/csrc/c10d_transport.hpp: lockstep's transport concept over the
// point-to-point send/recv of a torch.distributed (c10d) process group: Gloo on CPU.
//
//   lockstep_torch::c10d_transport t(process_group, channel);      // any c10d::ProcessGroup
//   lockstep::group<lockstep_torch::c10d_transport> g(std::move(t));
//
// It lives with the Python package, not in include/lockstep/: it needs libtorch, and the core
// headers compile without it. Ranks and rendezvous are the process group's (torchrun, mpirun, a
// store); no MPI is needed.
//
// Trailers. Gloo's unbound-buffer receive does not check sizes: a shorter message completes as a
// silent truncation, a longer one fails an enforce in Gloo's device thread and ends the process.
// The concept wants a message of another size to be errc::mismatch, so every message carries a
// 16-byte trailer (magic, its byte count) after its bytes, and a receive of n bytes posts n + 16
// with the trailer's place zeroed: a message of the posted size leaves the magic and n there; a
// shorter one leaves zeros or the tail of its own bytes and count (a count below 2^48 has zero
// high bytes, which the magic has none of), and is errc::mismatch naming the peer. The one case
// left to Gloo is a message longer than posted, which a peer cannot send once the collective's
// headers agreed (they fix count, codec, topology and segment size, and the executor posts data
// receives only after checking them; headers are all 48 bytes). One lockstep message is one Gloo
// message: a separate 64-byte size frame before each payload was tried first and cost one more
// rendezvous per message.
//
// Tags. c10d tags are non-negative ints; lockstep's are below 2^25. The c10d tag is
// 2^30 | channel·2^25 | tag: up to 32 channels, so several lockstep groups over one process group
// (each State, the group of a plain all_reduce) never meet each other's messages. Ranks must
// number their channels alike (lockstep_torch gives them out in creation order per process group,
// as torch gives out new_group's). Tags below 2^30 stay the user's.
//
// Waiting. c10d's Gloo work has no non-blocking test, only wait(timeout), so every wait is one
// blocking call bounded by the remaining time to the deadline. Gloo treats a timed-out receive as
// fatal for its context: it closes every pair, so the peers' pending operations fail at once too
// (what lockstep's abort would want), and the process group cannot be used afterwards. So this
// transport cannot poll as mpi_p2p and shm do (lockstep/transport/poll.hpp: short looks with a
// backoff): a look with a short timeout that found nothing would end the process group.
//
// abort() marks this endpoint failed: later calls throw errc::aborted. c10d has no way to tell the
// peers; they stop at their own timeouts (or when a Gloo timeout closes the pairs).
//
// Memory. Gloo cannot cancel a point-to-point operation, and a buffer that goes while its operation
// is pending leaves a dead operation in the pair that stalls every later message on it (seen: the
// withdrawn sends of one failed call stopped the next calls' headers on the same process group).
// So every message lives in memory the transport owns: a send copies the caller's bytes into a
// pooled buffer (one memcpy per byte sent, which also makes room for the trailer), a receive
// lands in one and consume() reads it there (a reduce step decode-adds from it, a copy step copies
// it into place, as over MPI); and a request destroyed unfinished (its collective failed) hands its
// c10d work and memory to a process-wide graveyard, where Gloo may finish them whenever the peer
// gets to them. Only failed calls add to it. An unfinished send so still reaches its peer, as an
// eager send would: a rank that fails on a mismatch before its header went out does not leave
// the peer to its timeout.
//
// Limits: one message carries at most INT_MAX - 16 bytes.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/core/deadline.hpp>
#include <lockstep/core/error.hpp>
#include <lockstep/transport/concept.hpp>

namespace lockstep_torch {

namespace lt = lockstep::transport;

namespace detail {

// After every message's bytes.
struct trailer {
  static constexpr std::uint32_t magic_value = 0x4c4b5446;  // "LKTF"
  std::uint32_t magic = magic_value;
  std::uint32_t reserved = 0;
  std::uint64_t bytes = 0;  // the sender's message size
};
static_assert(sizeof(trailer) == 16);

// Memory a message lives in while c10d works on it: owned by the transport, never the caller's.
struct pooled {
  std::unique_ptr<std::byte[]> data;
  std::size_t capacity = 0;
};

// Unfinished c10d works with the memory they point into, kept for the life of the process
// (see "Memory" above). Only failed calls add to it.
struct graveyard {
  std::mutex m;
  std::vector<std::pair<pooled, c10::intrusive_ptr<c10d::Work>>> works;  // (memory before work:
                                                                         // the work goes first)
  static graveyard& get() {
    static graveyard* g = new graveyard;  // never destroyed: Gloo's threads outlive static destructors
    return *g;
  }
};

// What all copies of one endpoint share.
struct c10d_state {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int rank = 0, size = 0, channel = 0;
  std::string backend;
  std::mutex m;
  std::atomic<bool> aborted{false};
  std::string abort_reason;
  std::vector<pooled> pool;  // buffers of finished requests, for the next ones

  // A buffer of at least `bytes`: the smallest pooled one that fits, else a new one.
  pooled take(std::size_t bytes) {
    {
      std::lock_guard lk(m);
      auto best = pool.end();
      for (auto it = pool.begin(); it != pool.end(); ++it)
        if (it->capacity >= bytes && (best == pool.end() || it->capacity < best->capacity)) best = it;
      if (best != pool.end()) {
        pooled p = std::move(*best);
        pool.erase(best);
        return p;
      }
    }
    return {std::unique_ptr<std::byte[]>(new std::byte[bytes]), bytes};
  }
  void give_back(pooled p) {
    if (!p.data) return;
    std::lock_guard lk(m);
    if (pool.size() < 64) pool.push_back(std::move(p));
  }
};

// A CPU byte tensor over memory the transport owns; c10d keeps it in its work, never frees it.
inline at::Tensor bytes_view(void* p, std::size_t n) {
  return at::from_blob(p, {static_cast<std::int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

}  // namespace detail

class c10d_transport {
 public:
  // The executor's pipelining unit, as mpi_p2p's: Gloo's TCP pairs move a 1 MiB message at full rate.
  static constexpr std::size_t segment_bytes = std::size_t{1} << 20;
  static constexpr int max_channels = 32;
  static constexpr std::uint32_t max_tag = (std::uint32_t{1} << 25) - 1;
  // Gloo's send moves no byte before the peer's receive has sent its notice, which travels on the
  // connection that also carries our data to that peer: the executor posts a step's receives
  // before its sends (collective/executor.hpp), or a torus's two-way steps ran one way at a time.
  static constexpr bool sends_wait_for_receives = true;
  // A timed-out wait closes Gloo's pairs (above): the executor must not look in short slices.
  static constexpr bool waits_end_the_transport = true;

  // One posted send or receive; move-only. Its bytes (and trailer) live in a buffer from the
  // endpoint's pool. Destroying an unfinished request hands its work and buffer to the graveyard,
  // since Gloo cannot withdraw them; the caller's memory is never touched again either way.
  class request {
   public:
    request() = default;
    request(request&& o) noexcept { *this = std::move(o); }
    request& operator=(request&& o) noexcept {
      if (this != &o) {
        release();
        s_ = std::move(o.s_);
        buf_ = std::move(o.buf_);
        work_ = std::move(o.work_);
        dst_ = o.dst_;
        bytes_ = o.bytes_;
        tag_ = o.tag_;
        peer_ = o.peer_;
        recv_ = o.recv_;
        checked_ = o.checked_;
        done_ = std::exchange(o.done_, true);
      }
      return *this;
    }
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    ~request() { release(); }

    bool done() const noexcept { return done_; }

   private:
    friend class c10d_transport;

    void release() noexcept {
      if (work_) {
        auto& g = detail::graveyard::get();
        std::lock_guard lk(g.m);
        g.works.emplace_back(std::move(buf_), std::move(work_));
      }
      if (s_) s_->give_back(std::move(buf_));
      done_ = true;
    }

    std::shared_ptr<detail::c10d_state> s_;
    detail::pooled buf_;                  // (bytes + trailer)
    c10::intrusive_ptr<c10d::Work> work_;  // null once finished
    void* dst_ = nullptr;                 // receives: where wait() copies the bytes
    std::size_t bytes_ = 0;
    std::uint32_t tag_ = 0;
    int peer_ = -1;
    bool recv_ = false;
    bool checked_ = false;  // receives: the trailer was found good
    bool done_ = true;
  };

  c10d_transport() = default;
  // An endpoint over `pg` using tag channel `channel` (0..31); ranks must pass the same channel.
  c10d_transport(c10::intrusive_ptr<c10d::ProcessGroup> pg, int channel) {
    if (!pg) throw lockstep::error(lockstep::errc::invalid_argument, "c10d", -1, -1, "no process group");
    if (channel < 0 || channel >= max_channels)
      throw lockstep::error(lockstep::errc::invalid_argument, "c10d", pg->getRank(), -1,
                            "channel " + std::to_string(channel) + " outside 0.." + std::to_string(max_channels - 1) +
                                " (at most " + std::to_string(max_channels) + " lockstep groups over one process group)");
    s_ = std::make_shared<detail::c10d_state>();
    s_->rank = pg->getRank();
    s_->size = pg->getSize();
    s_->channel = channel;
    s_->backend = pg->getBackendName();
    s_->pg = std::move(pg);
  }

  int rank() const noexcept { return s_ ? s_->rank : 0; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  std::string name() const { return s_ ? "c10d(" + s_->backend + ")" : "c10d"; }
  int channel() const noexcept { return s_ ? s_->channel : -1; }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    check(peer, tag, bytes, "send");
    request r = make(peer, tag, bytes, false);
    if (bytes > 0) std::memcpy(r.buf_.data.get(), data, bytes);
    const detail::trailer t{detail::trailer::magic_value, 0, bytes};
    std::memcpy(r.buf_.data.get() + bytes, &t, sizeof t);
    r.work_ = post(true, peer, tag, r.buf_.data.get(), bytes + sizeof t);
    r.done_ = false;
    return r;
  }

  // Posts a receive of bytes + trailer; wait() checks the trailer.
  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    check(peer, tag, bytes, "recv");
    request r = make(peer, tag, bytes, true);
    r.dst_ = data;
    std::memset(r.buf_.data.get() + bytes, 0, sizeof(detail::trailer));
    r.work_ = post(false, peer, tag, r.buf_.data.get(), bytes + sizeof(detail::trailer));
    r.done_ = false;
    return r;
  }

  // Finishes a request; false when the deadline passed first (Gloo then closes the context). A
  // receive's bytes are then in the caller's buffer.
  bool wait(request& r, lt::clock::time_point deadline) {
    if (!finish_request(r, deadline)) return false;
    if (r.recv_ && r.bytes_ > 0) std::memcpy(r.dst_, r.buf_.data.get(), r.bytes_);
    return true;
  }

  // A receive's bytes are read where they arrived, in the request's buffer.
  template <class F>
  bool consume(request& r, lt::clock::time_point deadline, F&& fn) {
    if (!finish_request(r, deadline)) return false;
    fn(static_cast<const std::byte*>(r.buf_.data.get()));
    return true;
  }

  // Marks this endpoint and every copy failed; true when this call did (not an earlier one).
  bool abort(const std::string& reason) {
    if (!s_) return false;
    std::lock_guard lk(s_->m);
    if (s_->aborted.load()) return false;
    s_->abort_reason = reason;
    s_->aborted.store(true);
    return true;
  }
  bool aborted() const noexcept { return s_ && s_->aborted.load(std::memory_order_relaxed); }

 private:
  request make(int peer, std::uint32_t tag, std::size_t bytes, bool recv) {
    request r;
    r.s_ = s_;
    r.buf_ = s_->take(bytes + sizeof(detail::trailer));
    r.bytes_ = bytes;
    r.peer_ = peer;
    r.tag_ = tag;
    r.recv_ = recv;
    return r;
  }

  // Waits for r's work, then checks a receive's trailer.
  bool finish_request(request& r, lt::clock::time_point deadline) {
    if (!r.done_) {
      if (!r.buf_.data) throw lockstep::error(lockstep::errc::invalid_argument, "wait", rank(), r.peer_, "empty request");
      const char* op = r.recv_ ? "recv" : "send";
      throw_if_aborted(op, r.peer_);
      if (!finish(r.work_, deadline, op, r.peer_)) return false;
      r.work_.reset();
      r.done_ = true;
    }
    if (r.recv_ && !r.checked_) {
      detail::trailer t;
      std::memcpy(&t, r.buf_.data.get() + r.bytes_, sizeof t);
      if (t.magic != detail::trailer::magic_value)
        throw lockstep::error(lockstep::errc::mismatch, "recv", rank(), r.peer_,
                              "expected a message of " + std::to_string(r.bytes_) +
                                  " bytes; the peer sent a shorter one, or not a lockstep_torch message (tag " +
                                  std::to_string(r.tag_) + " on channel " + std::to_string(channel()) + ")");
      if (t.bytes != r.bytes_)
        throw lockstep::error(lockstep::errc::mismatch, "recv", rank(), r.peer_,
                              "expected a message of " + std::to_string(r.bytes_) + " bytes, the peer sent " +
                                  std::to_string(t.bytes) + " (tag " + std::to_string(r.tag_) + ")");
      r.checked_ = true;
    }
    return true;
  }

  int c10d_tag(std::uint32_t tag) const noexcept {
    return static_cast<int>((std::uint32_t{1} << 30) | (static_cast<std::uint32_t>(s_->channel) << 25) | tag);
  }

  void throw_if_aborted(const char* op, int peer) const {
    if (!s_ || !s_->aborted.load(std::memory_order_relaxed)) return;
    std::lock_guard lk(s_->m);
    throw lockstep::error(lockstep::errc::aborted, op, s_->rank, peer, "this endpoint failed earlier: " + s_->abort_reason);
  }

  void check(int peer, std::uint32_t tag, std::size_t bytes, const char* op) const {
    if (!s_) throw lockstep::error(lockstep::errc::invalid_argument, op, -1, peer, "endpoint not connected to a process group");
    throw_if_aborted(op, peer);
    if (peer < 0 || peer >= s_->size)
      throw lockstep::error(lockstep::errc::invalid_argument, op, s_->rank, peer,
                            "peer out of range for a group of " + std::to_string(s_->size));
    if (peer == s_->rank)
      throw lockstep::error(lockstep::errc::invalid_argument, op, s_->rank, peer, "c10d cannot send to its own rank");
    if (tag > max_tag)
      throw lockstep::error(lockstep::errc::invalid_argument, op, s_->rank, peer,
                            "tag " + std::to_string(tag) + " above " + std::to_string(max_tag));
    if (bytes > static_cast<std::size_t>(INT_MAX) - sizeof(detail::trailer))
      throw lockstep::error(lockstep::errc::invalid_argument, op, s_->rank, peer,
                            "message of " + std::to_string(bytes) + " bytes exceeds INT_MAX - 16; use smaller segments");
  }

  // One c10d send or receive of `bytes` at `p`; c10d's own errors become errc::transport.
  c10::intrusive_ptr<c10d::Work> post(bool send, int peer, std::uint32_t tag, void* p, std::size_t bytes) {
    std::vector<at::Tensor> t{detail::bytes_view(p, bytes)};
    try {
      return send ? s_->pg->send(t, peer, c10d_tag(tag)) : s_->pg->recv(t, peer, c10d_tag(tag));
    } catch (const std::exception& e) {
      throw lockstep::error(lockstep::errc::transport, send ? "send" : "recv", s_->rank, peer,
                            std::string(send ? "ProcessGroup::send: " : "ProcessGroup::recv: ") + e.what());
    }
  }

  // Waits for one c10d work until the deadline: false when it ran out, errc::transport on errors.
  bool finish(c10::intrusive_ptr<c10d::Work>& w, lt::clock::time_point deadline, const char* op, int peer) {
    using std::chrono::milliseconds;
    // Gloo's wait takes milliseconds and treats 0 as "now": at least 1 ms, rounded up; at most a
    // century (lockstep::longest_wait), as Gloo adds it to its own now() in nanoseconds (a
    // deadline at the clock's end, passed straight in, would wrap there).
    const auto left = std::chrono::ceil<milliseconds>(deadline - lt::clock::now());
    const milliseconds ms = std::clamp(left, milliseconds(1), std::chrono::duration_cast<milliseconds>(lockstep::longest_wait));
    bool ok = false;
    try {
      ok = w->wait(ms);
    } catch (const std::exception& e) {
      // Gloo reports its timeout as an exception like any other failure; the clock tells which.
      if (lt::clock::now() + milliseconds(1) >= deadline) return false;
      throw lockstep::error(lockstep::errc::transport, op, s_->rank, peer, std::string("c10d work: ") + e.what());
    }
    if (!ok) throw lockstep::error(lockstep::errc::transport, op, s_->rank, peer, "c10d work was aborted");
    return true;
  }

  std::shared_ptr<detail::c10d_state> s_;
};

static_assert(lt::transport<c10d_transport>);

}  // namespace lockstep_torch
