// lockstep/transport/mpi.hpp: ranks as MPI processes (OpenMPI), talking point to point.
//
//   lockstep::transport::mpi_session session(&argc, &argv);         // MPI_Init_thread .. MPI_Finalize
//   lockstep::group g(lockstep::transport::mpi(MPI_COMM_WORLD));      // duplicates the communicator
//
// Every endpoint owns one communicator (a duplicate of the one it was built from, or the result of
// MPI_Comm_split), so a group's messages never meet another group's; copies of an endpoint share
// it, and the last copy frees it. The communicator returns errors instead of aborting the job.
//
// Peers on the same node are reached through a shared-memory segment instead (shm.hpp: a send is
// complete once copied into the peer's ring, a receive sleeps on a futex the sender rings, and
// wait_view() reads a received message in the ring, so a reduce step adds from it directly). Set
// up by the constructor and by split(), collectively; off with mpi_options or LOCKSTEP_MPI_SHM=0,
// and off by itself (shared_memory_note() says why) where the segment cannot be made.
// Measured on 4 ranks over 2 cores (docs/benchmarks.md, "Shared memory between the ranks of a
// node"): a ring fp32 all-reduce went from 0.96-1.07x MPI_Allreduce at 1..4 MiB (MPI's own path)
// to 1.02-1.39x, and takes 0.72-0.80 of the time at 64 MiB.
//
// Sends are MPI_Isend. A receive is matched with MPI_Improbe before any byte lands: the probe
// tells the message's size, so a message of another size is an errc::mismatch naming the peer and
// is drained into a buffer of its own. Posting MPI_Irecv and relying on MPI_ERR_TRUNCATE is not
// an option: Open MPI 4.1's shared-memory rendezvous (vader, CMA) writes a too-long message past
// the end of the receive buffer. Receives still match messages in the order they were posted:
// unmatched receives queue per (peer, tag), and every poll of any request (a send's too) matches
// what has arrived, so a posted receive lets the peer's send complete as MPI_Irecv would.
//
// Over TCP (btl tcp), Open MPI sends a message above btl_tcp_eager_limit (64 KiB) by rendezvous:
// the bulk waits for the receiver's acknowledgement, a round trip per message that, when two
// ranks exchange (a 2-rank ring, the rows and columns of a 2 x C torus), shares the connection
// with the receiver's own data. Measured over shaped 1 Gbit/s links (docs/scaling.md,
// "Rendezvous"), raising the limit above one segment (--mca btl_tcp_eager_limit 1100000 --mca
// btl_tcp_rndv_eager_limit 1100000 --mca btl_tcp_max_send_size 1100000 for the default 1 MiB
// segment) made the 2x2 torus 1.4-1.7x and the 8-bit ring 1.2-1.3x faster at 16 and 64 MiB. It
// is the job's setting to make, not the library's.
//
// Waiting polls with a deadline. Ranks are often oversubscribed (4 ranks on 2 cores in CI) and a
// rank spinning in MPI_Test steals the core its peer needs to make the progress it waits for, so
// the poll backs off: a few tests, then yields, then short sleeps.
//
// abort() marks this endpoint failed: later calls on it throw errc::aborted at once, and so do the
// waits of the peers on its node for messages to or from a rank of the node (through the
// segment). Peers on other nodes find out through their own timeouts; MPI has no way to interrupt them short of MPI_Abort, which would take the
// whole job down with it.
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
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "concept.hpp"
#include "shm.hpp"

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

// The communicator of one group and what all copies of its endpoint share.
struct mpi_comm_state {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  long tag_ub = 32767;  // the smallest MPI_TAG_UB the standard allows

  std::mutex m;
  std::atomic<bool> aborted{false};
  std::string abort_reason;
  // A split that timed out leaves its MPI_Iallgather running (MPI cannot cancel a collective);
  // its request and buffers stay here so that MPI never writes into freed memory.
  std::vector<std::pair<MPI_Request, std::shared_ptr<std::vector<int>>>> abandoned;
  // Posted receives not yet matched to a message, oldest first, per (peer, tag).
  std::map<std::pair<int, std::uint32_t>, std::deque<std::shared_ptr<mpi_recv_slot>>> unmatched;
  // Peers on this node talk through shared memory (shm.hpp): local_of[peer] is the peer's index
  // there, or -1 for a peer MPI carries. remote: some peer is not local.
  std::unique_ptr<shm_endpoint> shm;
  std::vector<int> local_of;
  bool remote = true;
  std::string shm_note;  // why shared memory is off, when it is

  explicit mpi_comm_state(MPI_Comm c) : comm(c) {
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
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
      if (abandoned.empty() && !aborted.load()) MPI_Comm_free(&comm);
    }
  }
};

}  // namespace detail

// How an mpi endpoint reaches the peers on its own node.
struct mpi_options {
  // Through a shared-memory segment (shm.hpp) rather than MPI. The environment variable
  // LOCKSTEP_MPI_SHM=0 turns it off for every endpoint (netlab does, so that its ranks, one machine
  // posing as several, talk over the shaped network).
  bool shared_memory = true;
  // Bytes of each ring (one per ordered pair of local ranks); 0: 2 MiB, less where the node has
  // so many ranks that the segment would pass 64 MiB (never below 64 KiB: from 31 local ranks).
  std::size_t ring_bytes = 0;
  // Large sends the receiver copies (isend_in_place) go by reference: the receiver reads them from
  // the sender's memory with process_vm_readv, where Linux allows it (checked at set-up). Off, or
  // LOCKSTEP_MPI_CMA=0: every byte goes through the rings.
  bool by_reference = true;
};

namespace detail {

inline std::size_t shm_ring_bytes(const mpi_options& opt, int local_ranks) {
  if (opt.ring_bytes) return std::max<std::size_t>((opt.ring_bytes + 4095) / 4096 * 4096, 4096);
  // 64 MiB in all, the rings' control pages and the ranks' blocks included.
  const shm_layout empty{local_ranks, 0};
  const std::size_t pairs = empty.rings(), fixed = empty.total();
  const std::size_t all = std::size_t{64} << 20;
  const std::size_t budget = all > fixed ? (all - fixed) / pairs / 4096 * 4096 : 0;
  return std::clamp<std::size_t>(budget, std::size_t{64} << 10, std::size_t{2} << 20);
}

// Collective over s.comm: finds the ranks on this node and maps one segment among them. Every
// choice is agreed (the group's ranks could be given different options or environments): shared
// memory is on only if every rank asks for it, the ring size is the node's first rank's, and
// by-reference sends are on only if every local rank asks for them and can read its neighbour.
// When the segment cannot be made (no /dev/shm room, say), every peer stays with MPI and
// shm_note says why.
inline void connect_shm(mpi_comm_state& s, const mpi_options& opt) {
  s.local_of.assign(static_cast<std::size_t>(s.size), -1);
  auto must = [&](int rc, const char* what) {
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", s.rank, -1, std::string(what) + ": " + mpi_error_text(rc));
  };
  if (s.size == 1) {
    s.shm_note = "off (one rank)";
    return;
  }
  const char* env = std::getenv("LOCKSTEP_MPI_SHM");
  const bool env_off = env && std::string(env) == "0";
  int want = opt.shared_memory && !env_off ? 1 : 0, all_want = 0;
  must(MPI_Allreduce(&want, &all_want, 1, MPI_INT, MPI_MIN, s.comm), "MPI_Allreduce");
  if (!all_want) {
    s.shm_note = !want ? (env_off ? "off (LOCKSTEP_MPI_SHM=0)" : "off (mpi_options)") : "off (another rank of the group turned it off)";
    return;
  }
  MPI_Comm node = MPI_COMM_NULL;
  must(MPI_Comm_split_type(s.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  struct free_on_exit {
    MPI_Comm* c;
    ~free_on_exit() {
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
    }
  } free_node{&node};
  int local = 0, me = 0;
  MPI_Comm_size(node, &local);
  MPI_Comm_rank(node, &me);
  std::vector<int> names(static_cast<std::size_t>(local));
  must(MPI_Allgather(&s.rank, 1, MPI_INT, names.data(), 1, MPI_INT, node), "MPI_Allgather");
  s.remote = local < s.size;
  if (local == 1) {
    s.shm_note = "off (no other rank on this node)";
    return;
  }
  // The first local rank creates the segment and says its ring size and name, or why it could not.
  auto seg = std::make_shared<shm_segment>();
  std::array<char, 512> msg{};
  static std::atomic<unsigned> made{0};
  if (me == 0) {
    const shm_layout lay{local, shm_ring_bytes(opt, local)};
    std::string why, name;
    // Named after this PID namespace and process: the sweep only judges names whose pids it can see.
    struct stat ns {};
    const std::string prefix = "lockstep-" + std::to_string(stat("/proc/self/ns/pid", &ns) == 0 ? ns.st_ino : 0) + "-";
    shm_segment::sweep(prefix);
    for (int attempt = 0; attempt < 8; ++attempt) {
      name = "/" + prefix + std::to_string(getpid()) + "-" + std::to_string(made++);
      bool exists = false;
      why = seg->create(name, lay.total(), &exists);
      if (why.empty() || !exists) break;
    }
    if (why.empty()) {
      for (int r = 0; r < local; ++r) new (seg->base() + static_cast<std::size_t>(r) * sizeof(shm_rank_block)) shm_rank_block{};
      for (int a = 0; a < local; ++a)
        for (int b = 0; b < local; ++b)
          if (a != b) new (seg->base() + lay.ring_offset(a, b)) shm_ring_control{};
    }
    const std::string out = why.empty() ? "+" + std::to_string(lay.capacity) + " " + name : "-" + why;
    std::memcpy(msg.data(), out.data(), std::min(out.size(), msg.size() - 1));
  }
  must(MPI_Bcast(msg.data(), static_cast<int>(msg.size()), MPI_CHAR, 0, node), "MPI_Bcast");
  const std::string text(msg.data());
  const bool made_it = !text.empty() && text[0] == '+';
  std::string why = made_it ? std::string{} : text.substr(std::min<std::size_t>(1, text.size()));
  shm_layout lay{local, 0};
  std::string name;
  if (made_it) {
    const auto space = text.find(' ');
    lay.capacity = static_cast<std::size_t>(std::stoull(text.substr(1, space - 1)));
    name = text.substr(space + 1);
    if (me != 0) why = seg->open(name, lay.total());
  }
  int ok = why.empty() ? 1 : 0, all_ok = 0;
  must(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce");
  if (me == 0 && made_it) shm_segment::unlink(name);  // mapped by all who could
  if (!all_ok) {
    s.shm_note = "off (" + (why.empty() ? std::string("another rank of this node could not map the segment") : why) + ")";
    return;
  }
  s.shm = std::make_unique<shm_endpoint>(std::move(seg), lay, me, names);
  for (int i = 0; i < local; ++i) s.local_of[static_cast<std::size_t>(names[static_cast<std::size_t>(i)])] = i;
  const char* cma_env = std::getenv("LOCKSTEP_MPI_CMA");
  const bool ref_wanted = opt.by_reference && !(cma_env && std::string(cma_env) == "0");
  s.shm->publish_identity();
  must(MPI_Barrier(node), "MPI_Barrier");
  int can = ref_wanted && s.shm->can_read_peers() ? 1 : 0, all_can = 0;
  must(MPI_Allreduce(&can, &all_can, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce");
  s.shm->set_by_reference(all_can != 0);
  if (!all_can)
    s.shm_note = ref_wanted ? "on, without by-reference sends (process_vm_readv not allowed here, or off on another rank)"
                            : "on, without by-reference sends (off by request)";
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

class mpi {
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
        ssend_ = std::move(o.ssend_);
        srecv_ = std::move(o.srecv_);
        peer_ = o.peer_;
        done_ = std::exchange(o.done_, true);
      }
      return *this;
    }
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    ~request() { release(); }

    bool done() const noexcept { return done_; }
    int peer() const noexcept { return peer_; }

   private:
    friend class mpi;

    void release() noexcept {
      if (done_ || !s_) return;
      done_ = true;
      if (ssend_ || srecv_) {
        const int local = s_->local_of[static_cast<std::size_t>(peer_)];
        if (ssend_) s_->shm->withdraw(ssend_, local);
        else s_->shm->withdraw(srecv_, local);
        return;
      }
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
    MPI_Request send_ = MPI_REQUEST_NULL;          // sends
    std::shared_ptr<detail::shm_send> ssend_;      // sends to a peer on this node
    std::shared_ptr<detail::shm_recv> srecv_;      // receives from one
    int peer_ = -1;
    bool done_ = true;
  };

  // Not connected; the target of an assignment (group::split builds one first).
  mpi() = default;
  // An endpoint over a duplicate of `parent`; collective over `parent` (MPI_Comm_dup, and the
  // shared-memory set-up among the ranks of each node). Endpoints split from it keep `opt`.
  explicit mpi(MPI_Comm parent, mpi_options opt = {}) : opt_(opt) {
    MPI_Comm dup = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(parent, &dup);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", -1, -1, "MPI_Comm_dup: " + detail::mpi_error_text(rc));
    s_ = std::make_shared<detail::mpi_comm_state>(dup);
    detail::connect_shm(*s_, opt_);
  }

  int rank() const noexcept { return s_ ? s_->rank : 0; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  std::string name() const { return "mpi"; }
  // The communicator this endpoint owns (for MPI calls beside lockstep's, like a benchmark's peer).
  MPI_Comm comm() const noexcept { return s_ ? s_->comm : MPI_COMM_NULL; }
  // How many peers this endpoint reaches through shared memory, and why none when none.
  int shared_memory_peers() const noexcept { return s_ && s_->shm ? s_->shm->ranks() - 1 : 0; }
  bool by_reference() const noexcept { return s_ && s_->shm && s_->shm->by_reference(); }
  // Why shared memory (or its by-reference sends) is off; empty when all is on.
  std::string shared_memory_note() const { return s_ ? s_->shm_note : std::string("not connected"); }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) { return send(peer, tag, data, bytes, false); }

  // isend for bytes that stay unchanged until the send completes and that the receiver copies
  // rather than adds: to a peer on this node a large one goes by reference (mpi_options).
  request isend_in_place(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    return send(peer, tag, data, bytes, true);
  }


  // Posts a receive of exactly `bytes`; the next message from `peer` with `tag` that no earlier
  // receive took is matched to it by the next poll of any request of this endpoint.
  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    check(peer, tag, bytes, "recv");
    if (const int local = local_of(peer); local >= 0) {
      request r;
      r.srecv_ = s_->shm->post_recv(local, tag, data, bytes);
      r.s_ = s_;
      r.peer_ = peer;
      r.done_ = false;
      return r;
    }
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

  bool wait(request& r, clock::time_point deadline) {
    if (r.done_) return true;
    if (!r.s_) throw error(errc::invalid_argument, "wait", rank(), r.peer_, "request of another endpoint");
    const char* op = r.slot_ || r.srecv_ ? "recv" : "send";
    throw_if_aborted(op, r.peer_);
    if (r.ssend_ || r.srecv_) return wait_local(r, deadline, op);
    auto sleep = first_sleep;
    for (int polls = 0;; ++polls) {
      if (poll(r, op)) return true;
      if (clock::now() >= deadline) return false;
      if (polls < spin_polls) continue;
      if (polls < spin_polls + yield_polls) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, max_sleep);
    }
  }

  // What a finished receive holds: its bytes where they are, in the receive's own memory or, from
  // a peer on this node, still in the shared ring (ok == false: the deadline passed first).
  // Move-only: a view of a message in the ring holds that ring until released or destroyed.
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
        held_ = std::move(o.held_);
        s_ = std::move(o.s_);
      }
      return *this;
    }
    view(const view&) = delete;
    view& operator=(const view&) = delete;
    ~view() { reset(); }

    void reset() noexcept {
      if (held_ && s_ && s_->shm) s_->shm->release_view(held_);
      held_ = nullptr;
      s_ = nullptr;
      data = nullptr;
      bytes = 0;
      ok = false;
    }

   private:
    friend class mpi;
    std::shared_ptr<detail::shm_recv> held_;
    std::shared_ptr<detail::mpi_comm_state> s_;
  };

  // wait() for a receive without the last copy: the view is the received bytes, from a peer on
  // this node read in the ring they arrived in. Errors as wait().
  view wait_view(request& r, clock::time_point deadline) {
    if (r.srecv_ && !r.done_) {
      throw_if_aborted("recv", r.peer_);
      if (!wait_local(r, deadline, "recv", true)) return view{nullptr, r.srecv_->bytes, false};
      if (const std::byte* in_ring = s_->shm->hold_view(r.srecv_)) {
        r.done_ = true;
        view v{in_ring, r.srecv_->bytes, true};
        v.held_ = r.srecv_;
        v.s_ = s_;
        return v;
      }
      if (!r.srecv_->done.load(std::memory_order_acquire) && !wait(r, deadline))  // copied out meanwhile
        return view{nullptr, r.srecv_->bytes, false};
      r.done_ = true;
      return view{r.srecv_->dst, r.srecv_->bytes, true};
    }
    const std::size_t bytes = r.slot_ ? r.slot_->bytes : r.srecv_ ? r.srecv_->bytes : 0;
    if (!wait(r, deadline)) return view{nullptr, bytes, false};
    return view{static_cast<const std::byte*>(r.slot_ ? r.slot_->dst : r.srecv_ ? r.srecv_->dst : nullptr), bytes, true};
  }
  // Done reading a view: a message read in the ring leaves it.
  void release(view& v) { v.reset(); }

  // A receive read where it lies: from a peer on this node in the ring, else in its own buffer.
  template <class F>
  bool consume(request& r, clock::time_point deadline, F&& fn) {
    view v = wait_view(r, deadline);
    if (!v.ok) return false;
    fn(v.data);
    return true;
  }

  // Collective over this endpoint's group, like MPI_Comm_split. The colours and keys travel first
  // by MPI_Iallgather, which can be waited on with a deadline; once it completes every rank is
  // inside split, so the blocking MPI_Comm_split that follows cannot hang.
  mpi split(int color, int key, clock::time_point deadline) {
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
    if (!wait(pending, deadline)) {
      // A collective cannot be cancelled: it stays with the communicator, buffers and all.
      std::lock_guard lk(s_->m);
      s_->abandoned.emplace_back(std::exchange(pending.send_, MPI_REQUEST_NULL), all);
      pending.done_ = true;
      throw error(errc::timeout, "split", rank(), -1, "not every rank of the group called split");
    }
    MPI_Comm out = MPI_COMM_NULL;
    rc = MPI_Comm_split(s_->comm, color, key, &out);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "split", rank(), -1, "MPI_Comm_split: " + detail::mpi_error_text(rc));
    mpi t;
    t.opt_ = opt_;
    t.s_ = std::make_shared<detail::mpi_comm_state>(out);
    detail::connect_shm(*t.s_, t.opt_);
    return t;
  }

  void abort(const std::string& reason) {
    if (!s_) return;
    std::lock_guard lk(s_->m);
    if (s_->aborted.load()) return;
    s_->abort_reason = reason;
    s_->aborted.store(true);
    if (s_->shm) s_->shm->fail(reason);
  }
  bool aborted() const noexcept { return s_ && s_->aborted.load(std::memory_order_relaxed); }

 private:
  request send(int peer, std::uint32_t tag, const void* data, std::size_t bytes, bool in_place) {
    check(peer, tag, bytes, "send");
    request r;
    if (const int local = local_of(peer); local >= 0) {
      r.ssend_ = s_->shm->post_send(local, tag, data, bytes, in_place);
      r.s_ = s_;
      r.peer_ = peer;
      r.done_ = false;
      return r;
    }
    const int rc = MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, peer, static_cast<int>(tag), s_->comm, &r.send_);
    if (rc != MPI_SUCCESS) throw error(errc::transport, "send", rank(), peer, "MPI_Isend: " + detail::mpi_error_text(rc));
    r.s_ = s_;
    r.peer_ = peer;
    r.done_ = false;
    return r;
  }

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

  void throw_if_aborted(const char* op, int peer) const {
    if (!s_ || !s_->aborted.load(std::memory_order_relaxed)) return;
    std::lock_guard lk(s_->m);
    throw error(errc::aborted, op, s_->rank, peer, "this endpoint failed earlier: " + s_->abort_reason);
  }

  // A message to this rank itself goes through MPI: shared memory has rings between pairs only.
  int local_of(int peer) const { return s_->shm && peer != s_->rank ? s_->local_of[static_cast<std::size_t>(peer)] : -1; }

  // The backoff of a wait for a peer on this node: a few looks, a few yields, then sleep on the
  // doorbell that the peer rings when it writes to or reads from a ring of ours. With peers
  // that MPI carries the sleep is capped at max_sleep, so their messages progress too.
  static constexpr int local_spin_polls = 4, local_yield_polls = 8;

  bool wait_local(request& r, clock::time_point deadline, const char* op, bool in_place = false) {
    auto& sh = *s_->shm;
    for (int polls = 0;; ++polls) {
      const std::uint32_t seen = sh.doorbell();
      sh.progress(r.srecv_.get(), in_place);
      if (s_->remote) match_all(nullptr);
      if (r.srecv_ && r.srecv_->in_ring.load(std::memory_order_acquire)) {
        if (in_place) return true;  // wait_view reads it there
        sh.take(r.srecv_);          // parked in the ring: a plain wait copies it out
      }
      if (r.ssend_ ? r.ssend_->done.load(std::memory_order_acquire) : r.srecv_->done.load(std::memory_order_acquire)) {
        r.done_ = true;
        if (r.srecv_ && r.srecv_->got >= 0)
          throw error(errc::mismatch, "recv", rank(), r.peer_,
                      "expected a message of " + std::to_string(r.srecv_->bytes) + " bytes, the peer sent " +
                          std::to_string(r.srecv_->got) + " (tag " + std::to_string(r.srecv_->tag) + ")");
        if (r.srecv_ && !r.srecv_->read_error.empty())
          throw error(errc::transport, "recv", rank(), r.peer_, r.srecv_->read_error);
        if (r.srecv_ && r.srecv_->withdrawn)
          throw error(errc::aborted, "recv", rank(), r.peer_,
                      "the peer withdrew this message midway (its call failed; tag " + std::to_string(r.srecv_->tag) + ")");
        return true;
      }
      sh.throw_if_peer_failed(op, r.peer_);
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (polls < local_spin_polls) continue;
      if (polls < local_spin_polls + local_yield_polls) {
        std::this_thread::yield();
        continue;
      }
      // Everything a local wait can wait for rings the doorbell (a peer's write or read, an abort,
      // another thread of this rank completing the request); the cap only bounds a lost wake-up.
      const std::chrono::nanoseconds cap = s_->remote ? std::chrono::nanoseconds(max_sleep) : std::chrono::milliseconds(1000);
      sh.sleep(seen, std::min<std::chrono::nanoseconds>(deadline - now, cap));
    }
  }

  // One look at a request: true when it has finished.
  bool poll(request& r, const char* op) {
    if (s_->shm) s_->shm->progress();  // sends to local peers move while MPI is waited for
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

  // Matches every message that has arrived to the oldest receive posted for its (peer, tag).
  // Runs on every poll of every request, sends included: a peer's send may only complete once
  // this rank's receive is matched (MPI's rendezvous), so posted receives must be matched while
  // this rank waits for anything, as MPI_Irecv would be. Returns whether `target` (a receive, or
  // null) is matched, read under the lock that guards matching; once matched, a slot belongs to
  // its request alone.
  bool match_all(const detail::mpi_recv_slot* target) {
    std::lock_guard lk(s_->m);
    for (auto it = s_->unmatched.begin(); it != s_->unmatched.end();) {
      auto& q = it->second;
      while (!q.empty() && match_head(*q.front())) q.pop_front();
      // Tags carry a call number, so a queue is dropped once empty instead of kept for good.
      it = q.empty() ? s_->unmatched.erase(it) : std::next(it);
    }
    return target && target->matched;
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
  mpi_options opt_;
};

static_assert(transport<mpi>);

}  // namespace lockstep::transport
