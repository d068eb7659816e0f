// lockstep/transport/mpi_p2p.hpp: ranks as MPI processes talking point to point through MPI alone.
// The mpi transport (mpi.hpp) uses it for every peer off its node, and for all of them where
// shared memory is off; it is a transport of its own too.
//
//   lockstep::transport::mpi_session session(&argc, &argv);          // MPI_Init_thread .. MPI_Finalize
//   lockstep::transport::mpi_p2p t(MPI_COMM_WORLD);                   // duplicates the communicator
//
// Every endpoint owns one communicator (a duplicate of the one it was built from, or the result of
// MPI_Comm_split), so a group's messages never meet another group's; copies of an endpoint share
// it, and the last copy frees it. The communicator returns errors instead of aborting the job.
//
// Sends are MPI_Isend. A receive is matched with MPI_Improbe before any byte lands: the probe
// tells the message's size, so a message of another size is an errc::mismatch naming the peer and
// is drained into a buffer of its own. Posting MPI_Irecv and relying on MPI_ERR_TRUNCATE is not
// an option: Open MPI 4.1's shared-memory rendezvous (vader, CMA) writes a too-long message past
// the end of the receive buffer. Receives still match messages in the order they were posted:
// unmatched receives queue per (peer, tag), and every poll of any request (a send's too) matches
// what has arrived, so a posted receive lets the peer's send complete as MPI_Irecv would.
//
// Waiting polls with a deadline. Ranks are often oversubscribed (4 ranks on 2 cores in CI) and a
// rank spinning in MPI_Test steals the core its peer needs to make the progress it waits for, so
// the poll backs off: a few tests, then yields, then short sleeps.
//
// abort() marks this endpoint failed (later calls on it throw errc::aborted at once) and tells every
// other rank of the group out of band: a small message {group id, rank, reason} on a second
// communicator of its own (a duplicate made with the first), which every wait of every rank probes
// (MPI_Improbe, at most once a millisecond) beside its own request. A rank that finds one marks its
// endpoint failed and throws errc::aborted naming the failing rank (error::peer()) and its message,
// within a millisecond or so of the message's arrival, whether the failing rank was a neighbour or
// not. The group id (drawn by rank 0 at set-up) keeps a late abort of a group whose communicator
// was freed away from a new group that Open MPI gave the same context id. MPI_Abort is never
// used: it would take the whole job down, the survivors included.
//
// The groups split from one endpoint (and from those) are a family, and a failure in any of them
// fails all of them, as a failing process takes all its communicators down (torch's watchdog;
// docs/reliability.md, "Every group of a rank"): the abort message goes to every rank of the
// family's first group on the first group's abort communicator, which every wait of every group
// of the family probes, and the groups of this process are marked failed at once. A wait in a
// group where the failure did not happen throws errc::aborted naming the failing rank in its own
// numbering (error::peer(); -1 when that rank is not in the group) and in the first group's.
// without_failed() starts a family of its own.
//
// Limits: one message carries at most INT_MAX bytes (MPI's count is an int; the executor's
// segments are far smaller). After a timeout a send this rank gave up on may still be matched by
// a late peer, and MPI is then free to read its buffer: the group should not be used again, and
// the buffers of the failed call should outlive the transport if the peer may still be alive.
// A failed endpoint's communicator is never freed, so no later communicator reuses its context.
#pragma once

// lockstep uses MPI's C interface; the C++ bindings were dropped by MPI-3 and their headers do not
// compile warning-free. Only takes effect where mpi.h was not included before.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "concept.hpp"
#include "poll.hpp"

namespace lockstep::transport {

namespace detail {

inline std::string mpi_error_text(int rc) {
  std::array<char, MPI_MAX_ERROR_STRING> buf{};
  int len = 0;
  if (MPI_Error_string(rc, buf.data(), &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf.data(), static_cast<std::size_t>(len));
}

inline bool mpi_finalized() noexcept {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

// One posted receive. It is matched to a message (MPI_Improbe) in the order receives were posted
// for its (peer, tag), then received into `dst` (MPI_Imrecv) when the sizes agree.
struct mpi_recv_slot {
  void* dst = nullptr;
  std::size_t bytes = 0;
  int peer = -1;
  std::uint32_t tag = 0;
  bool matched = false;
  int got = -1;  // size of the matched message, when it was not `bytes`
  MPI_Request req = MPI_REQUEST_NULL;
};

struct mpi_comm_state;

// The groups of this process split from one first group, directly or not (mpi_p2p.hpp's header).
struct mpi_family {
  MPI_Comm comm = MPI_COMM_NULL;  // the first group's abort communicator: every abort message of the family
  std::uint64_t id = 0;           // the first group's id
  int rank = 0, size = 0;         // this process in the first group
  std::mutex m;
  std::atomic<bool> failed{false};
  int origin = -1;      // the failing rank, in the first group's numbering (this process: rank)
  std::uint64_t where = 0;  // the id of the group it failed in
  std::string reason;
  std::vector<std::weak_ptr<mpi_comm_state>> groups;
  // The next time a wait probes comm (steady_clock ticks): at most once a millisecond.
  std::atomic<clock::rep> next_probe{0};

  mpi_family() = default;
  mpi_family(const mpi_family&) = delete;
  mpi_family& operator=(const mpi_family&) = delete;
  // A failed family's communicator is kept, as a failed group's is (below): late messages.
  ~mpi_family() {
    if (comm != MPI_COMM_NULL && !failed.load() && !mpi_finalized()) MPI_Comm_free(&comm);
  }
};

// The communicator of one group and what all copies of its endpoint share.
struct mpi_comm_state {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm abort_comm = MPI_COMM_NULL;  // the first group's: the family's; a split's: the survivors' handshake
  bool owns_abort_comm = true;          // false for a family's first group (the family owns it)
  std::uint64_t id = 0;                 // the group's, drawn by rank 0 at set-up
  int rank = 0, size = 0;
  long tag_ub = 32767;  // the smallest MPI_TAG_UB the standard allows
  std::shared_ptr<mpi_family> family;
  std::vector<int> first;  // first[i]: rank i of this group in the family's first group

  std::mutex m;
  std::atomic<bool> aborted{false};
  std::string abort_reason;
  bool told = false;     // failed by another rank's failure (else by this rank's own)
  int failed_rank = -1;  // that rank in this group; -1: own failure, or a rank not in this group

  // The rank in this group of rank `f` of the family's first group; -1: not a member.
  int rank_of_first(int f) const {
    const auto it = std::find(first.begin(), first.end(), f);
    return it == first.end() ? -1 : static_cast<int>(it - first.begin());
  }
  // How errors name rank `here` of this group, rank `f` of the family's first group.
  static std::string name(int here, int f) {
    if (here < 0) return "rank " + std::to_string(f) + " of the parent group";
    if (here == f) return "rank " + std::to_string(here);
    return "rank " + std::to_string(here) + " (rank " + std::to_string(f) + " of the parent group)";
  }
  // A split that timed out leaves its MPI_Iallgather running (MPI cannot cancel a collective);
  // its request and buffers stay here so that MPI never writes into freed memory.
  std::vector<std::pair<MPI_Request, std::shared_ptr<std::vector<int>>>> abandoned;
  // Posted receives not yet matched to a message, oldest first, per (peer, tag).
  std::map<std::pair<int, std::uint32_t>, std::deque<std::shared_ptr<mpi_recv_slot>>> unmatched;

  // Collective over c (the abort communicator's MPI_Comm_dup and the id's MPI_Bcast).
  explicit mpi_comm_state(MPI_Comm c) : comm(c) {
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    int rc = MPI_Comm_dup(comm, &abort_comm);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", rank, -1, "MPI_Comm_dup: " + mpi_error_text(rc));
    MPI_Comm_set_errhandler(abort_comm, MPI_ERRORS_RETURN);
    if (rank == 0) id = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}() ^
                        static_cast<std::uint64_t>(clock::now().time_since_epoch().count());
    rc = MPI_Bcast(&id, 1, MPI_UINT64_T, 0, abort_comm);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", rank, -1, "MPI_Bcast: " + mpi_error_text(rc));
    void* ub = nullptr;
    int found = 0;
    // MPI_TAG_UB is an attribute of MPI_COMM_WORLD only; it holds for every communicator.
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found) == MPI_SUCCESS && found && ub)
      tag_ub = *static_cast<int*>(ub);
  }
  mpi_comm_state(const mpi_comm_state&) = delete;
  mpi_comm_state& operator=(const mpi_comm_state&) = delete;
  ~mpi_comm_state() {
    // After MPI_Finalize every MPI call is erroneous; the communicator went with it.
    if (comm != MPI_COMM_NULL && !mpi_finalized()) {
      // A collective abandoned by a timed-out split would make MPI_Comm_free wait for it forever.
      // A failed endpoint's communicator is kept too: peers may still send on it, and Open MPI
      // hands a freed communicator's context id to the next one made, where such a late
      // message would be matched as if it were new (a CI run saw a fresh group fail with a
      // mismatch 0.1 ms into its first call).
      // The abort communicator likewise: the abort messages this rank sent may still be on it.
      if (abandoned.empty() && !aborted.load()) {
        MPI_Comm_free(&comm);
        if (abort_comm != MPI_COMM_NULL && owns_abort_comm) MPI_Comm_free(&abort_comm);
      }
    }
  }
};

// An abort message, on the family's communicator: {family id, group id, rank in the first group,
// reason bytes}.
struct mpi_abort_message {
  static constexpr int tag = 1;
  static constexpr std::size_t head = 2 * sizeof(std::uint64_t) + sizeof(std::int32_t);
  static std::vector<char> make(std::uint64_t family, std::uint64_t group, int first_rank, const std::string& reason) {
    std::vector<char> b(head + std::min<std::size_t>(reason.size(), 4000));
    const auto r = static_cast<std::int32_t>(first_rank);
    std::memcpy(b.data(), &family, sizeof family);
    std::memcpy(b.data() + sizeof family, &group, sizeof group);
    std::memcpy(b.data() + 2 * sizeof family, &r, sizeof r);
    std::memcpy(b.data() + head, reason.data(), b.size() - head);
    return b;
  }
};

// Makes `s` the first group of a family of its own (an endpoint made from a communicator, a group
// of survivors): the family owns its abort communicator.
inline void start_family(const std::shared_ptr<mpi_comm_state>& s) {
  auto f = std::make_shared<mpi_family>();
  f->comm = s->abort_comm;
  f->id = s->id;
  f->rank = s->rank;
  f->size = s->size;
  f->groups.push_back(s);
  s->owns_abort_comm = false;
  s->family = std::move(f);
  s->first.resize(static_cast<std::size_t>(s->size));
  for (int i = 0; i < s->size; ++i) s->first[static_cast<std::size_t>(i)] = i;
}

// The error text of a failure of the family, for group `g`, where it did not happen: rank `origin`
// of the first group (this process's own, or another's) failed in another group.
inline void mark_failed_from_family(mpi_comm_state& g, int origin, bool own, const std::string& reason) {
  const int here = g.rank_of_first(origin);
  std::lock_guard lk(g.m);
  if (g.aborted.load()) return;
  if (own) {
    g.told = false;
    g.abort_reason = "this rank failed in another of its groups: " + reason;
  } else {
    g.told = true;
    g.failed_rank = here;
    g.abort_reason = g.name(here, origin) + " failed in another of its groups: " + reason;
  }
  g.aborted.store(true);
}

// Records the family's first failure (rank `origin` of the first group, in the group with id
// `where`) and marks every other group of this process failed; false when it had failed already.
inline bool fail_family(mpi_family& f, int origin, std::uint64_t where, const std::string& reason) {
  std::vector<std::shared_ptr<mpi_comm_state>> groups;
  {
    std::lock_guard lk(f.m);
    if (f.failed.load()) return false;
    f.origin = origin;
    f.where = where;
    f.reason = reason;
    f.failed.store(true);
    for (auto& w : f.groups)
      if (auto p = w.lock(); p && p->id != where) groups.push_back(std::move(p));
  }
  for (auto& g : groups) mark_failed_from_family(*g, origin, origin == f.rank, reason);
  return true;
}

// Abort messages and their requests outlive the endpoint that sent them: MPI reads the bytes
// until each send completes, which a dead or slow peer may put off indefinitely. Aborts are rare
// and small, so they are kept for the life of the process (reachable, not leaked).
inline void keep_abort_sends(std::shared_ptr<void> bytes, std::vector<MPI_Request> reqs) {
  static std::mutex m;
  static std::vector<std::pair<std::shared_ptr<void>, std::vector<MPI_Request>>> kept;
  std::lock_guard lk(m);
  for (auto& q : reqs)
    if (q != MPI_REQUEST_NULL && !mpi_finalized()) MPI_Request_free(&q);  // MPI completes them itself
  kept.emplace_back(std::move(bytes), std::move(reqs));
}

}  // namespace detail

// MPI_Init_thread on construction, MPI_Finalize on destruction, when this object did the init.
// Asks for MPI_THREAD_MULTIPLE: a group runs asynchronous collectives on its own worker thread,
// and groups made by split() may run collectives at the same time on different threads.
class mpi_session {
 public:
  mpi_session() : mpi_session(nullptr, nullptr) {}
  mpi_session(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) {
      MPI_Query_thread(&provided_);
    } else {
      const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided_);
      if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi_session", -1, -1, detail::mpi_error_text(rc));
      owns_ = true;
    }
    // Below SERIALIZED even a group's worker thread may not call MPI.
    if (provided_ < MPI_THREAD_SERIALIZED) {
      if (owns_) MPI_Finalize();
      throw error(errc::transport, "mpi_session", -1, -1,
                  "the MPI library provides thread level " + std::to_string(provided_) +
                      "; lockstep needs at least MPI_THREAD_SERIALIZED (MPI_THREAD_MULTIPLE for "
                      "concurrent collectives on different groups)");
    }
  }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  ~mpi_session() {
    if (owns_ && !detail::mpi_finalized()) MPI_Finalize();
  }

  // MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE.
  int thread_level() const noexcept { return provided_; }
  bool thread_multiple() const noexcept { return provided_ >= MPI_THREAD_MULTIPLE; }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_ = false;
};

class mpi_p2p {
 public:
  // 1 MiB segments: large enough that per-message costs vanish, small enough that a received
  // segment is still in L2 when it is added. Measured with lockstep-bench-allreduce
  // --segment-bytes 256K..4M (4 ranks on 2 cores, ring, fp32, docs/benchmarks.md "All-reduce"):
  // 4..64 MiB all-reduces come out within run-to-run noise of each other, so the size that also
  // suits the cache stays.
  static constexpr std::size_t segment_bytes = std::size_t{1} << 20;

  // One posted send or receive; move-only. Destroying one that has not completed (a collective
  // that failed midway) never blocks for long: an unmatched receive is withdrawn, a receive whose
  // data is already flowing gets a moment to finish, and a send MPI cannot cancel (Open MPI's ob1
  // cannot cancel sends) is left to MPI to free when the peer takes it.
  class request {
   public:
    request() = default;
    request(request&& o) noexcept { *this = std::move(o); }
    request& operator=(request&& o) noexcept {
      if (this != &o) {
        release();
        s_ = std::move(o.s_);
        slot_ = std::move(o.slot_);
        send_ = std::exchange(o.send_, MPI_REQUEST_NULL);
        peer_ = o.peer_;
        done_ = std::exchange(o.done_, true);
      }
      return *this;
    }
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    ~request() { release(); }

    bool done() const noexcept { return done_; }
    bool is_recv() const noexcept { return slot_ != nullptr; }
    // A receive's own buffer, where its bytes land.
    const std::byte* buffer() const noexcept { return slot_ ? static_cast<const std::byte*>(slot_->dst) : nullptr; }
    std::size_t bytes() const noexcept { return slot_ ? slot_->bytes : 0; }

   private:
    friend class mpi_p2p;

    void release() noexcept {
      if (done_ || !s_) return;
      done_ = true;
      if (detail::mpi_finalized()) return;
      MPI_Request* r = &send_;
      if (slot_) {
        std::lock_guard lk(s_->m);
        if (!slot_->matched) {  // withdraw it: no message will ever be matched to it
          auto it = s_->unmatched.find({slot_->peer, slot_->tag});
          if (it != s_->unmatched.end()) {
            auto& q = it->second;
            q.erase(std::remove(q.begin(), q.end(), slot_), q.end());
            if (q.empty()) s_->unmatched.erase(it);
          }
          return;
        }
        r = &slot_->req;
      }
      if (*r == MPI_REQUEST_NULL) return;
      if (!slot_) MPI_Cancel(r);
      const auto until = clock::now() + (slot_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(1));
      int flag = 0;
      while (MPI_Test(r, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && !flag && clock::now() < until)
        std::this_thread::yield();
      if (*r != MPI_REQUEST_NULL) MPI_Request_free(r);
    }

    std::shared_ptr<detail::mpi_comm_state> s_;
    std::shared_ptr<detail::mpi_recv_slot> slot_;  // receives
    MPI_Request send_ = MPI_REQUEST_NULL;          // sends (and a split's MPI_Iallgather)
    int peer_ = -1;
    bool done_ = true;
  };

  // Not connected; the target of an assignment (group::split builds one first).
  mpi_p2p() = default;
  // An endpoint over a duplicate of `parent`; collective over `parent`.
  explicit mpi_p2p(MPI_Comm parent) {
    MPI_Comm dup = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(parent, &dup);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", -1, -1, "MPI_Comm_dup: " + detail::mpi_error_text(rc));
    s_ = std::make_shared<detail::mpi_comm_state>(dup);
    detail::start_family(s_);
  }

  int rank() const noexcept { return s_ ? s_->rank : 0; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  std::string name() const { return "mpi_p2p"; }
  // The communicator this endpoint owns (for MPI calls beside lockstep's, like a benchmark's peer).
  MPI_Comm comm() const noexcept { return s_ ? s_->comm : MPI_COMM_NULL; }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    check(peer, tag, bytes, "send");
    request r;
    const int rc = MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, static_cast<int>(tag), s_->comm, &r.send_);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "send", rank(), peer, "MPI_Isend: " + detail::mpi_error_text(rc));
    r.s_ = s_;
    r.peer_ = peer;
    r.done_ = false;
    return r;
  }

  // Posts a receive of exactly `bytes`; the next message from `peer` with `tag` that no earlier
  // receive took is matched to it by the next poll of any request of this endpoint.
  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    check(peer, tag, bytes, "recv");
    auto slot = std::make_shared<detail::mpi_recv_slot>();
    slot->dst = data;
    slot->bytes = bytes;
    slot->peer = peer;
    slot->tag = tag;
    {
      std::lock_guard lk(s_->m);
      s_->unmatched[{peer, tag}].push_back(slot);
    }
    request r;
    r.s_ = s_;
    r.slot_ = std::move(slot);
    r.peer_ = peer;
    r.done_ = false;
    return r;
  }

  // The backoff of wait(): 16 bare polls (a message in flight lands within them), 32 yields,
  // then sleeps of 20, 40, 80, 100, 100 ... us. Measured on 4 ranks over 2 cores shared with other
  // work (docs/benchmarks.md "All-reduce"): against 256 yields and sleeps growing to 1 ms, lockstep
  // over mpi went from 0.90x to 1.3x MPI_Allreduce at 1 MiB under load and stayed level when the
  // machine was quiet. A rank that sleeps leaves the core to the peer it waits for and, woken
  // by its timer, is scheduled ahead of busy neighbours; a longer sleep only adds latency.
  static constexpr int spin_polls = 16;
  static constexpr int yield_polls = 32;
  static constexpr std::chrono::microseconds first_sleep{20}, max_sleep{100};

  // Finishes a request; false when the deadline passed first. `idle` runs before every look (the
  // routed transport moves its shared-memory messages there while MPI is waited for).
  template <class Idle>
  bool wait(request& r, clock::time_point deadline, Idle&& idle) {
    if (r.done_) return true;
    if (!r.s_) throw error(errc::invalid_argument, "wait", rank(), r.peer_, "request of another endpoint");
    const char* op = r.slot_ ? "recv" : "send";
    throw_if_aborted(op, r.peer_);
    auto sleep = first_sleep;
    return detail::poll_until(
        deadline, {spin_polls, yield_polls}, [&] { return test(r, op); },
        [&] {
          // After a look that found nothing: what a wait on its behalf checks (another rank's
          // abort, and whatever the caller's idle does) sees the state that look saw, or a later one.
          poll_abort(op, r.peer_);
          idle();
        },
        [&](clock::time_point) {
          std::this_thread::sleep_for(sleep);
          sleep = std::min(sleep * 2, max_sleep);
        });
  }
  bool wait(request& r, clock::time_point deadline) { return wait(r, deadline, [] {}); }

  // A receive's bytes are in its own buffer: fn reads them there.
  template <class F>
  bool consume(request& r, clock::time_point deadline, F&& fn) {
    if (!wait(r, deadline)) return false;
    fn(r.buffer());
    return true;
  }

  // Collective over this endpoint's group, like MPI_Comm_split. The colours and keys travel first
  // by MPI_Iallgather, which can be waited on with a deadline; once it completes every rank is
  // inside split, so the blocking MPI_Comm_split that follows cannot hang.
  template <class Idle>
  mpi_p2p split(int color, int key, clock::time_point deadline, Idle&& idle) {
    if (!s_) throw error(errc::invalid_argument, "split", -1, -1, "endpoint not connected to a communicator");
    if (color < 0) throw error(errc::invalid_argument, "split", rank(), -1, "negative colour " + std::to_string(color));
    throw_if_aborted("split", -1);
    // (rank, {colour, key}) for every rank, then this rank's own pair.
    auto all = std::make_shared<std::vector<int>>(2 * static_cast<std::size_t>(size()) + 2);
    int* mine = all->data() + 2 * size();
    mine[0] = color;
    mine[1] = key;
    request pending;
    int rc = MPI_Iallgather(mine, 2, MPI_INT, all->data(), 2, MPI_INT, s_->comm, &pending.send_);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "split", rank(), -1, "MPI_Iallgather: " + detail::mpi_error_text(rc));
    pending.s_ = s_;
    pending.done_ = false;
    if (!wait(pending, deadline, idle)) {
      // A collective cannot be cancelled: it stays with the communicator, buffers and all.
      std::lock_guard lk(s_->m);
      s_->abandoned.emplace_back(std::exchange(pending.send_, MPI_REQUEST_NULL), all);
      pending.done_ = true;
      throw error(errc::timeout, "split", rank(), -1, "not every rank of the group called split");
    }
    MPI_Comm out = MPI_COMM_NULL;
    rc = MPI_Comm_split(s_->comm, color, key, &out);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "split", rank(), -1, "MPI_Comm_split: " + detail::mpi_error_text(rc));
    mpi_p2p t;
    t.s_ = std::make_shared<detail::mpi_comm_state>(out);
    join_family(*t.s_, t.s_);
    return t;
  }
  mpi_p2p split(int color, int key, clock::time_point deadline) { return split(color, key, deadline, [] {}); }

  // A new endpoint over `members` (ranks of this group, distinct; new ranks follow this list's
  // order), collective over those ranks alone, so it works on a group that failed and whose other
  // ranks are gone: what the survivors of an abort build to go on. The members first exchange a
  // word over the abort communicator, waited for with the deadline; once each has every other's,
  // all are inside this call and MPI_Comm_create_group (blocking) cannot hang on an absent one.
  // The members must agree on the list: the caller's (error::peer() of the abort names the rank
  // that failed). Open MPI needs mpirun --enable-recovery to keep the others running when a
  // process dies; without it mpirun ends the whole job.
  mpi_p2p without_failed(const std::vector<int>& members, clock::time_point deadline) {
    if (!s_) throw error(errc::invalid_argument, "regroup", -1, -1, "endpoint not connected to a communicator");
    const int me = s_->rank;
    if (std::find(members.begin(), members.end(), me) == members.end())
      throw error(errc::invalid_argument, "regroup", me, -1, "this rank is not one of the members");
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] < 0 || members[i] >= s_->size)
        throw error(errc::invalid_argument, "regroup", me, members[i], "member out of range for a group of " + std::to_string(s_->size));
      if (std::find(members.begin(), members.begin() + static_cast<std::ptrdiff_t>(i), members[i]) != members.begin() + static_cast<std::ptrdiff_t>(i))
        throw error(errc::invalid_argument, "regroup", me, members[i], "member listed twice");
    }
    constexpr int hello_tag = 2;
    auto words = std::make_shared<std::vector<int>>(members.size() + 1, 0);
    (*words)[members.size()] = me;
    std::vector<MPI_Request> reqs;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] == me) continue;
      MPI_Request q = MPI_REQUEST_NULL;
      int rc = MPI_Irecv(&(*words)[i], 1, MPI_INT, members[i], hello_tag, s_->abort_comm, &q);
      if (rc == MPI_SUCCESS) reqs.push_back(q);
      rc = rc == MPI_SUCCESS ? MPI_Isend(&(*words)[members.size()], 1, MPI_INT, members[i], hello_tag, s_->abort_comm, &q) : rc;
      if (rc != MPI_SUCCESS) throw error(errc::transport, "regroup", me, members[i], "MPI_Isend: " + detail::mpi_error_text(rc));
      reqs.push_back(q);
    }
    for (int all = 0;;) {
      if (MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &all, MPI_STATUSES_IGNORE) != MPI_SUCCESS || all) break;
      if (clock::now() >= deadline) {
        // Requests stay with MPI (and their words with them): a late member may still answer.
        detail::keep_abort_sends(words, std::move(reqs));
        std::string missing;
        for (std::size_t i = 0; i < members.size(); ++i)
          if (members[i] != me && (*words)[i] != members[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(members[i]);
        throw error(errc::timeout, "regroup", me, -1, "not every member called it (no word from rank " + missing + ")");
      }
      std::this_thread::sleep_for(max_sleep);
    }
    MPI_Group whole = MPI_GROUP_NULL, part = MPI_GROUP_NULL;
    MPI_Comm_group(s_->comm, &whole);
    MPI_Group_incl(whole, static_cast<int>(members.size()), members.data(), &part);
    MPI_Comm out = MPI_COMM_NULL;
    const int rc = MPI_Comm_create_group(s_->comm, part, 0, &out);
    MPI_Group_free(&part);
    MPI_Group_free(&whole);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "regroup", me, -1, "MPI_Comm_create_group: " + detail::mpi_error_text(rc));
    mpi_p2p t;
    t.s_ = std::make_shared<detail::mpi_comm_state>(out);
    detail::start_family(t.s_);
    return t;
  }

  // Marks this endpoint and every copy failed and sends the abort message to every other rank of
  // the group; true when this call did (not an earlier one, nor another rank's abort message).
  // `origin`: the rank that failed, where this one only saw it happen (a node-local peer's
  // process gone); -1: this rank.
  // Every rank of every group of the family is told (the message goes to the first group's ranks),
  // and this process's other groups of the family are marked failed.
  bool abort(const std::string& reason, int origin = -1) {
    if (!s_) return false;
    {
      std::lock_guard lk(s_->m);
      if (s_->aborted.load()) return false;
      s_->abort_reason = reason;
      s_->aborted.store(true);
    }
    detail::mpi_family& fam = *s_->family;
    const int first = s_->first[static_cast<std::size_t>(origin < 0 ? s_->rank : origin)];
    // Another group of the family failed first: its ranks were told then.
    if (!detail::fail_family(fam, first, s_->id, reason)) return true;
    if (detail::mpi_finalized()) return true;
    auto bytes = std::make_shared<std::vector<char>>(detail::mpi_abort_message::make(fam.id, s_->id, first, reason));
    std::vector<MPI_Request> reqs;
    for (int p = 0; p < fam.size; ++p) {
      if (p == fam.rank) continue;
      MPI_Request q = MPI_REQUEST_NULL;
      // Best effort: a peer that is gone may make MPI refuse; the others are still told.
      if (MPI_Isend(bytes->data(), static_cast<int>(bytes->size()), MPI_BYTE, p, detail::mpi_abort_message::tag,
                    fam.comm, &q) == MPI_SUCCESS)
        reqs.push_back(q);
    }
    // A moment for the messages to leave (they are small: eager), in case this process exits next.
    const auto until = clock::now() + std::chrono::milliseconds(20);
    int all = 0;
    while (!reqs.empty() && MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &all, MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
           !all && clock::now() < until)
      std::this_thread::yield();
    detail::keep_abort_sends(std::move(bytes), std::move(reqs));
    return true;
  }
  bool aborted() const noexcept { return s_ && s_->aborted.load(std::memory_order_relaxed); }
  // Marks this endpoint failed because rank `origin` did, without telling anyone: the caller heard
  // it from a channel every rank hears (a shared-memory flag), so a relay would only add noise.
  // This process's other groups of the family are marked failed too (the rank that failed tells
  // the other processes).
  void mark_failed(int origin, const std::string& detail_text) {
    if (!s_) return;
    {
      std::lock_guard lk(s_->m);
      if (s_->aborted.load()) return;
      s_->told = true;
      s_->failed_rank = origin;
      s_->abort_reason = detail_text;
      s_->aborted.store(true);
    }
    if (origin >= 0 && origin < s_->size) detail::fail_family(*s_->family, s_->first[static_cast<std::size_t>(origin)], s_->id, detail_text);
  }
  // The rank whose abort message failed this endpoint; -1 when none did.
  int failed_rank() const {
    if (!s_) return -1;
    std::lock_guard lk(s_->m);
    return s_->failed_rank;
  }

  void throw_if_aborted(const char* op, int peer) const {
    if (!s_ || !s_->aborted.load(std::memory_order_relaxed)) return;
    std::lock_guard lk(s_->m);
    if (s_->told) throw error(errc::aborted, op, s_->rank, s_->failed_rank, s_->abort_reason);
    throw error(errc::aborted, op, s_->rank, peer, "this endpoint failed earlier: " + s_->abort_reason);
  }

  // Looks for another rank's abort message (at most once a millisecond unless `now`); when one of
  // this family has come, marks this endpoint and the family's other groups failed and throws
  // errc::aborted naming that rank (error::peer()) and its reason. Throws as well when another
  // group of the family failed this one meanwhile. Matched probes: threads of this rank may look
  // at once.
  void poll_abort(const char* op, int peer, bool now = false) {
    if (!s_ || !s_->family) return;
    throw_if_aborted(op, peer);
    detail::mpi_family& fam = *s_->family;
    if (fam.comm == MPI_COMM_NULL) return;
    const auto t = clock::now().time_since_epoch().count();
    if (!now && t < fam.next_probe.load(std::memory_order_relaxed)) return;
    fam.next_probe.store(t + std::chrono::duration_cast<clock::duration>(std::chrono::milliseconds(1)).count(),
                         std::memory_order_relaxed);
    for (;;) {
      int flag = 0;
      MPI_Message msg = MPI_MESSAGE_NULL;
      MPI_Status st{};
      if (MPI_Improbe(MPI_ANY_SOURCE, detail::mpi_abort_message::tag, fam.comm, &flag, &msg, &st) != MPI_SUCCESS || !flag)
        break;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      std::vector<char> b(static_cast<std::size_t>(std::max(count, 1)));
      if (MPI_Mrecv(b.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      std::uint64_t id = 0, where = 0;
      std::int32_t from = -1;
      if (static_cast<std::size_t>(count) < detail::mpi_abort_message::head) continue;
      std::memcpy(&id, b.data(), sizeof id);
      std::memcpy(&where, b.data() + sizeof id, sizeof where);
      std::memcpy(&from, b.data() + 2 * sizeof id, sizeof from);
      // A late message for an earlier family on a reused context id, or a rank out of range.
      if (id != fam.id || from < 0 || from >= fam.size) continue;
      const std::string reason(b.data() + detail::mpi_abort_message::head, static_cast<std::size_t>(count) - detail::mpi_abort_message::head);
      // The group the failure happened in (if this process is in it) hears "rank R failed", as a
      // group alone always did; the family's other groups hear where it happened.
      std::vector<std::shared_ptr<detail::mpi_comm_state>> there;
      {
        std::lock_guard lk(fam.m);
        for (auto& w : fam.groups)
          if (auto p = w.lock(); p && p->id == where) there.push_back(std::move(p));
      }
      for (auto& g : there) {
        const int here = g->rank_of_first(from);
        std::lock_guard lk(g->m);
        if (g->aborted.load() || here < 0) continue;
        g->told = true;
        g->failed_rank = here;
        g->abort_reason = g->name(here, from) + " failed: " + reason;
        g->aborted.store(true);
      }
      detail::fail_family(fam, from, where, reason);
      throw_if_aborted(op, peer);
    }
  }

  // The checks of every send and receive: connected, not failed, a peer of the group, a tag and
  // a size MPI can carry.
  void check(int peer, std::uint32_t tag, std::size_t bytes, const char* op) const {
    if (!s_) throw error(errc::invalid_argument, op, -1, peer, "endpoint not connected to a communicator");
    throw_if_aborted(op, peer);
    if (peer < 0 || peer >= s_->size)
      throw error(errc::invalid_argument, op, s_->rank, peer, "peer out of range for a group of " + std::to_string(s_->size));
    if (tag > static_cast<unsigned long>(s_->tag_ub))
      throw error(errc::invalid_argument, op, s_->rank, peer,
                  "tag " + std::to_string(tag) + " above this MPI's MPI_TAG_UB " + std::to_string(s_->tag_ub));
    if (bytes > static_cast<std::size_t>(INT_MAX))
      throw error(errc::invalid_argument, op, s_->rank, peer,
                  "message of " + std::to_string(bytes) + " bytes exceeds MPI's int count; use smaller segments");
  }

  // Matches every message that has arrived to the oldest receive posted for its (peer, tag).
  // Runs on every poll of every request, sends included: a peer's send may only complete once
  // this rank's receive is matched (MPI's rendezvous), so posted receives must be matched while
  // this rank waits for anything, as MPI_Irecv would be. Returns whether `target` (a receive, or
  // null) is matched, read under the lock that guards matching; once matched, a slot belongs to
  // its request alone.
  bool match_all(const detail::mpi_recv_slot* target = nullptr) {
    std::lock_guard lk(s_->m);
    for (auto it = s_->unmatched.begin(); it != s_->unmatched.end();) {
      auto& q = it->second;
      while (!q.empty() && match_head(*q.front())) q.pop_front();
      // Tags carry a call number, so a queue is dropped once empty instead of kept for good.
      it = q.empty() ? s_->unmatched.erase(it) : std::next(it);
    }
    return target && target->matched;
  }

 private:
  // Makes `child` (split from this endpoint's group) a group of this one's family: where its ranks
  // are in the first group, and failed at once if the family already is.
  void join_family(detail::mpi_comm_state& child, const std::shared_ptr<detail::mpi_comm_state>& owner) {
    detail::mpi_family& fam = *s_->family;
    child.family = s_->family;
    MPI_Group mine = MPI_GROUP_NULL, first = MPI_GROUP_NULL;
    MPI_Comm_group(child.comm, &mine);
    MPI_Comm_group(fam.comm, &first);
    std::vector<int> ranks(static_cast<std::size_t>(child.size));
    for (int i = 0; i < child.size; ++i) ranks[static_cast<std::size_t>(i)] = i;
    child.first.assign(ranks.size(), MPI_UNDEFINED);
    MPI_Group_translate_ranks(mine, child.size, ranks.data(), first, child.first.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&first);
    int origin = -1;
    std::string reason;
    {
      std::lock_guard lk(fam.m);
      std::erase_if(fam.groups, [](const std::weak_ptr<detail::mpi_comm_state>& w) { return w.expired(); });
      fam.groups.push_back(owner);
      if (fam.failed.load()) origin = fam.origin, reason = fam.reason;
    }
    if (origin >= 0) detail::mark_failed_from_family(child, origin, origin == fam.rank, reason);
  }

  // One look at a request: true when it has finished.
  bool test(request& r, const char* op) {
    if (!match_all(r.slot_.get()) && r.slot_) return false;
    if (r.slot_ && r.slot_->got >= 0) {
      r.done_ = true;
      throw error(errc::mismatch, "recv", rank(), r.peer_,
                  "expected a message of " + std::to_string(r.slot_->bytes) + " bytes, the peer sent " +
                      std::to_string(r.slot_->got) + " (tag " + std::to_string(r.slot_->tag) + ")");
    }
    MPI_Request* req = r.slot_ ? &r.slot_->req : &r.send_;
    int flag = 0;
    const int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      r.done_ = true;
      throw error(errc::transport, op, rank(), r.peer_, "MPI_Test: " + detail::mpi_error_text(rc));
    }
    if (flag) r.done_ = true;
    return r.done_;
  }

  // True when a message for `head` had arrived and is now matched to it. Called with s_->m held.
  bool match_head(detail::mpi_recv_slot& head) {
    int flag = 0;
    MPI_Message msg = MPI_MESSAGE_NULL;
    MPI_Status st{};
    int rc = MPI_Improbe(head.peer, static_cast<int>(head.tag), s_->comm, &flag, &msg, &st);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "recv", rank(), head.peer, "MPI_Improbe: " + detail::mpi_error_text(rc));
    if (!flag) return false;
    int count = 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    if (count == static_cast<int>(head.bytes)) {
      rc = MPI_Imrecv(head.dst, count, MPI_BYTE, &msg, &head.req);
    } else {
      // Drained whole, so that neither a truncation nor a stray message is left behind.
      std::vector<std::byte> sink(static_cast<std::size_t>(std::max(count, 1)));
      rc = MPI_Mrecv(sink.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      head.got = count;
    }
    head.matched = true;
    if (rc != MPI_SUCCESS) throw error(errc::transport, "recv", rank(), head.peer, "MPI_Imrecv: " + detail::mpi_error_text(rc));
    return true;
  }

  std::shared_ptr<detail::mpi_comm_state> s_;
};

static_assert(transport<mpi_p2p>);

}  // namespace lockstep::transport
