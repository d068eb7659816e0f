// lockstep/transport/routed.hpp: the transport behind lockstep::transport::mpi (mpi.hpp, which
// says how to use it): per peer, shared memory (shm/endpoint.hpp) for the ranks of this node and
// plain MPI (mpi_p2p.hpp) for the others. A request holds whichever kind its peer uses (a variant).
//
// Set up by the constructor and by split(), collectively (set_up_shared_memory below). A wait on
// either kind keeps the other moving: while MPI is waited for, messages to and from the node's
// ranks move through the rings; while a ring is waited for, MPI's arrivals are matched to their
// receives, and the sleep on the doorbell is capped so that they are.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "../core/error.hpp"
#include "concept.hpp"
#include "mpi_p2p.hpp"
#include "peer_watch.hpp"
#include "shm/endpoint.hpp"

namespace lockstep::transport {

// How an mpi endpoint reaches the peers on its own node.
struct mpi_options {
  // Through a shared-memory segment (shm/) rather than MPI. The environment variable
  // LOCKSTEP_MPI_SHM=0 turns it off for every endpoint (netlab does, so that its ranks, one machine
  // posing as several, talk over the shaped network).
  bool shared_memory = true;
  // Bytes of each ring (one per ordered pair of local ranks); 0: 2 MiB, less where the node has
  // so many ranks that the segment would pass 64 MiB (never below 64 KiB: from 31 local ranks).
  std::size_t ring_bytes = 0;
  // Large sends the receiver copies (isend_in_place) by reference: the receiver reads them from
  // the sender's memory with process_vm_readv, where Linux allows it (checked at set-up); else
  // every byte goes through the rings. Unset: off unless LOCKSTEP_MPI_CMA=1; LOCKSTEP_MPI_CMA=0
  // turns it off even where asked for. Off by default since 2026-12-03: on an AMD EPYC VM (2
  // cores) the rings alone ran fp32 rings 1.2..4.1x faster from 256 KiB to 4 MiB and 1.0..1.3x at
  // 64 MiB, 2 to 4 ranks (docs/benchmarks.md, "By reference or through the rings"): a by-reference
  // send completes only when its receiver has read it, one more wake-up per message, and the
  // kernel pins the sender's pages for every read; where wake-ups are cheap it can still win.
  std::optional<bool> by_reference{};
};

namespace detail {

// How one endpoint's peers are reached; shared by its copies.
struct routes {
  std::shared_ptr<shm::endpoint> near;  // null: every peer through MPI
  std::vector<int> local_of;            // local_of[peer]: its index on this node, or -1
  bool remote = true;                   // some peer is off this node
  std::string note;                     // why shared memory (or by-reference sends) is off
  std::shared_ptr<peer_watch> watch;    // this node's other ranks' processes (null: one rank)
};

// Collective over far's communicator: the process ids of the group's ranks on this node, watched
// by every wait for them (peer_watch.hpp), with or without shared memory. Peers in another PID
// namespace (containers sharing a node) are left out: their pids mean nothing here.
inline std::shared_ptr<peer_watch> watch_node_peers(const mpi_p2p& far) {
  auto must = [&](int rc, const char* what) {
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", far.rank(), -1, std::string(what) + ": " + mpi_error_text(rc));
  };
  MPI_Comm node = MPI_COMM_NULL;
  must(MPI_Comm_split_type(far.comm(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  int local = 0;
  MPI_Comm_size(node, &local);
  struct stat ns {};
  // (rank, pid, PID namespace) of every local rank.
  const long long mine[3] = {far.rank(), static_cast<long long>(getpid()),
                             stat("/proc/self/ns/pid", &ns) == 0 ? static_cast<long long>(ns.st_ino) : 0};
  std::vector<long long> all(3 * static_cast<std::size_t>(local));
  const int rc = MPI_Allgather(mine, 3, MPI_LONG_LONG, all.data(), 3, MPI_LONG_LONG, node);
  MPI_Comm_free(&node);
  must(rc, "MPI_Allgather");
  auto w = std::make_shared<peer_watch>(far.size());
  for (int i = 0; i < local; ++i) {
    const long long* e = all.data() + 3 * static_cast<std::size_t>(i);
    if (e[0] != far.rank() && e[2] == mine[2] && mine[2] != 0) w->add(static_cast<int>(e[0]), static_cast<pid_t>(e[1]));
  }
  return w;
}

inline std::size_t shm_ring_bytes(const mpi_options& opt, int local_ranks) {
  if (opt.ring_bytes) return std::max<std::size_t>((opt.ring_bytes + 4095) / 4096 * 4096, 4096);
  // 64 MiB in all, the rings' control pages and the ranks' blocks included.
  const shm::layout empty{local_ranks, 0};
  const std::size_t pairs = empty.rings(), fixed = empty.total();
  const std::size_t all = std::size_t{64} << 20;
  const std::size_t budget = all > fixed ? (all - fixed) / pairs / 4096 * 4096 : 0;
  return std::clamp<std::size_t>(budget, std::size_t{64} << 10, std::size_t{2} << 20);
}

// Collective over far's communicator: finds the ranks on this node and maps one segment among
// them. Every choice is agreed (the group's ranks could be given different options or
// environments): shared memory is on only if every rank asks for it, the ring size is the node's
// first rank's, and by-reference sends are on only if every local rank asks for them and can
// read its neighbour. When the segment cannot be made (no /dev/shm room, say), every peer stays
// with MPI and the note says why.
inline std::shared_ptr<routes> set_up_shared_memory(const mpi_p2p& far, const mpi_options& opt) {
  auto out = std::make_shared<routes>();
  out->local_of.assign(static_cast<std::size_t>(far.size()), -1);
  auto must = [&](int rc, const char* what) {
    if (rc != MPI_SUCCESS) throw error(errc::transport, "mpi", far.rank(), -1, std::string(what) + ": " + mpi_error_text(rc));
  };
  if (far.size() == 1) {
    out->note = "off (one rank)";
    return out;
  }
  out->watch = watch_node_peers(far);
  const char* env = std::getenv("LOCKSTEP_MPI_SHM");
  const bool env_off = env && std::string(env) == "0";
  int want = opt.shared_memory && !env_off ? 1 : 0, all_want = 0;
  must(MPI_Allreduce(&want, &all_want, 1, MPI_INT, MPI_MIN, far.comm()), "MPI_Allreduce");
  if (!all_want) {
    out->note = !want ? (env_off ? "off (LOCKSTEP_MPI_SHM=0)" : "off (mpi_options)") : "off (another rank of the group turned it off)";
    return out;
  }
  MPI_Comm node = MPI_COMM_NULL;
  must(MPI_Comm_split_type(far.comm(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
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
  const int rank = far.rank();
  must(MPI_Allgather(&rank, 1, MPI_INT, names.data(), 1, MPI_INT, node), "MPI_Allgather");
  out->remote = local < far.size();
  if (local == 1) {
    out->note = "off (no other rank on this node)";
    return out;
  }
  // The first local rank creates the segment and says its ring size and name, or why it could not.
  auto seg = std::make_shared<shm::segment>();
  std::array<char, 512> msg{};
  if (me == 0) {
    const shm::layout lay{local, shm_ring_bytes(opt, local)};
    std::string name;
    const std::string why = seg->create_unique(lay.total(), name);
    if (why.empty()) lay.format(seg->base());
    const std::string text = why.empty() ? "+" + std::to_string(lay.capacity) + " " + name : "-" + why;
    std::memcpy(msg.data(), text.data(), std::min(text.size(), msg.size() - 1));
  }
  must(MPI_Bcast(msg.data(), static_cast<int>(msg.size()), MPI_CHAR, 0, node), "MPI_Bcast");
  const std::string text(msg.data());
  const bool made = !text.empty() && text[0] == '+';
  std::string why = made ? std::string{} : text.substr(std::min<std::size_t>(1, text.size()));
  shm::layout lay{local, 0};
  std::string name;
  if (made) {
    const auto space = text.find(' ');
    lay.capacity = static_cast<std::size_t>(std::stoull(text.substr(1, space - 1)));
    name = text.substr(space + 1);
    if (me != 0) why = seg->open(name, lay.total());
  }
  int ok = why.empty() ? 1 : 0, all_ok = 0;
  must(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce");
  if (me == 0 && made) shm::segment::unlink(name);  // mapped by all who could
  if (!all_ok) {
    out->note = "off (" + (why.empty() ? std::string("another rank of this node could not map the segment") : why) + ")";
    return out;
  }
  auto near = std::make_shared<shm::endpoint>(std::move(seg), lay, me, names);
  for (int i = 0; i < local; ++i) out->local_of[static_cast<std::size_t>(names[static_cast<std::size_t>(i)])] = i;
  const char* cma_env = std::getenv("LOCKSTEP_MPI_CMA");
  const std::string cma = cma_env ? cma_env : "";
  const bool ref_wanted = cma != "0" && opt.by_reference.value_or(cma == "1");
  near->publish_identity();
  must(MPI_Barrier(node), "MPI_Barrier");
  int can = ref_wanted && near->can_read_peers() ? 1 : 0, all_can = 0;
  must(MPI_Allreduce(&can, &all_can, 1, MPI_INT, MPI_MIN, node), "MPI_Allreduce");
  near->set_by_reference(all_can != 0);
  if (!all_can)
    out->note = std::string("on, without by-reference sends ") +
                (ref_wanted                                   ? "(process_vm_readv not allowed here, or off on another rank)"
                 : cma == "0" || opt.by_reference.has_value() ? "(off by request)"
                                                              : "(off by default; LOCKSTEP_MPI_CMA=1 turns them on)");
  out->near = std::move(near);
  return out;
}

}  // namespace detail

class routed {
 public:
  static constexpr std::size_t segment_bytes = mpi_p2p::segment_bytes;

  // One posted send or receive, through shared memory or MPI; move-only. Destroying one that has
  // not completed withdraws it as its kind does (shm::request, mpi_p2p::request).
  class request {
   public:
    bool done() const noexcept {
      return std::visit([](const auto& q) { return q.done(); }, q_);
    }
    int peer() const noexcept { return peer_; }

   private:
    friend class routed;
    std::variant<mpi_p2p::request, shm::request> q_;
    int peer_ = -1;
  };

  // A finished receive's bytes where they are: in its own memory, or in the shared ring a peer of
  // this node wrote them into (held until released or destroyed). ok == false: the deadline
  // passed first. One view for both kinds: a view of a message MPI carried holds no ring.
  using view = shm::view;

  // Not connected; the target of an assignment (group::split builds one first).
  routed() = default;
  // An endpoint over a duplicate of `parent`; collective over `parent` (MPI_Comm_dup, and the
  // shared-memory set-up among the ranks of each node). Endpoints split from it keep `opt`.
  explicit routed(MPI_Comm parent, mpi_options opt = {})
      : far_(parent), routes_(detail::set_up_shared_memory(far_, opt)), opt_(opt) {}

  int rank() const noexcept { return far_.rank(); }
  int size() const noexcept { return far_.size(); }
  std::string name() const { return "mpi"; }
  // The communicator this endpoint owns (for MPI calls beside lockstep's, like a benchmark's peer).
  MPI_Comm comm() const noexcept { return far_.comm(); }
  // How many peers this endpoint reaches through shared memory.
  int shared_memory_peers() const noexcept { return routes_ && routes_->near ? routes_->near->ranks() - 1 : 0; }
  bool by_reference() const noexcept { return routes_ && routes_->near && routes_->near->by_reference(); }
  // Why shared memory (or its by-reference sends) is off; empty when all is on.
  std::string shared_memory_note() const { return routes_ ? routes_->note : std::string("not connected"); }

  request isend(int peer, std::uint32_t tag, const void* data, std::size_t bytes) { return send(peer, tag, data, bytes, false); }
  // isend for bytes that stay unchanged until the send completes and that the receiver copies
  // rather than adds: to a peer on this node a large one goes by reference where by-reference
  // sends are on (mpi_options).
  request isend_in_place(int peer, std::uint32_t tag, const void* data, std::size_t bytes) {
    return send(peer, tag, data, bytes, true);
  }

  // A send to a peer on this node whose payload fill(std::byte* dst) writes straight into the
  // shared ring (shm::endpoint::try_isend_fill), complete at once; empty where the peer is off this
  // node or the ring cannot take it whole now: then nothing was sent, and the caller sends as usual.
  template <class Fill>
  std::optional<request> try_isend_fill(int peer, std::uint32_t tag, std::size_t bytes, Fill&& fill) {
    far_.check(peer, tag, bytes, "send");
    const int local = local_of(peer);
    if (local < 0) return std::nullopt;
    auto q = routes_->near->try_isend_fill(local, tag, bytes, fill);
    if (!q) return std::nullopt;
    request r;
    r.peer_ = peer;
    r.q_ = std::move(*q);
    return r;
  }

  request irecv(int peer, std::uint32_t tag, void* data, std::size_t bytes) {
    far_.check(peer, tag, bytes, "recv");
    request r;
    r.peer_ = peer;
    if (const int local = local_of(peer); local >= 0) r.q_ = routes_->near->irecv(local, tag, data, bytes);
    else r.q_ = far_.irecv(peer, tag, data, bytes);
    return r;
  }

  bool wait(request& r, clock::time_point deadline) {
    if (r.done()) return true;
    return settled([&] {
      if (auto* q = std::get_if<mpi_p2p::request>(&r.q_)) return far_.wait(*q, deadline, move_near(op_of(*q), r.peer_));
      auto& q = std::get<shm::request>(r.q_);
      far_.throw_if_aborted(q.is_recv() ? "recv" : "send", r.peer_);
      return routes_->near->wait(q, deadline, move_far(op_of(q), r.peer_), far_sleep());
    });
  }

  // wait() for a receive without the last copy: the view is the received bytes, from a peer on
  // this node read in the ring they arrived in. Errors as wait().
  view wait_view(request& r, clock::time_point deadline) {
    if (auto* q = std::get_if<shm::request>(&r.q_)) {
      return settled([&] {
        if (!q->done()) far_.throw_if_aborted(q->is_recv() ? "recv" : "send", r.peer_);
        return routes_->near->wait_view(*q, deadline, move_far(op_of(*q), r.peer_), far_sleep());
      });
    }
    const auto& q = std::get<mpi_p2p::request>(r.q_);
    const std::byte* data = q.buffer();  // MPI receives into the receive's own buffer
    const std::size_t bytes = q.bytes();
    if (!wait(r, deadline)) return view{nullptr, bytes, false};
    return view{data, bytes, true};
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

  // Collective over this endpoint's group, like MPI_Comm_split (mpi_p2p::split), then the new
  // group's shared-memory set-up.
  routed split(int color, int key, clock::time_point deadline) {
    routed t;
    t.far_ = far_.split(color, key, deadline, move_near("split", -1));
    t.routes_ = detail::set_up_shared_memory(t.far_, opt_);
    t.opt_ = opt_;
    return t;
  }

  // A new endpoint over `members` of this group, collective over them alone, usable after this
  // one failed (mpi_p2p::without_failed), then the new group's shared-memory set-up.
  routed without_failed(const std::vector<int>& members, clock::time_point deadline) {
    routed t;
    t.far_ = far_.without_failed(members, deadline);
    t.routes_ = detail::set_up_shared_memory(t.far_, opt_);
    t.opt_ = opt_;
    return t;
  }

  // Marks this endpoint failed: later calls throw errc::aborted at once, and so do the waits of
  // the peers on its node for messages to or from a rank of the node (through the segment).
  void abort(const std::string& reason) {
    if (far_.abort(reason) && routes_ && routes_->near) routes_->near->fail(reason);
  }
  bool aborted() const noexcept { return far_.aborted(); }

  // What this node can tell about `peer`'s process, for a timeout's message: "process 1234 on this
  // node, stopped (SIGSTOP or SIGTSTP)"; "on another node" where nothing can be seen.
  // Any other rank of this node that is stopped is named too: the one a whole group waits for is
  // often not the peer this rank waits for.
  std::string describe_peer(int peer) const {
    if (!routes_ || peer < 0 || peer >= size() || peer == rank()) return {};
    peer_watch* const w = routes_->watch.get();
    std::string d = w ? w->describe(peer) : std::string{};
    if (d.empty()) d = "on another node";
    for (int r = 0; w && r < size(); ++r) {
      if (r == peer || r == rank() || !w->pid(r)) continue;
      const std::string o = w->describe(r);
      if (o.find("stopped") != std::string::npos || o.find("gone") != std::string::npos)
        d += "; rank " + std::to_string(r) + " is " + o;
    }
    return d;
  }

 private:
  request send(int peer, std::uint32_t tag, const void* data, std::size_t bytes, bool in_place) {
    far_.check(peer, tag, bytes, "send");
    request r;
    r.peer_ = peer;
    if (const int local = local_of(peer); local >= 0) r.q_ = routes_->near->isend(local, tag, data, bytes, in_place);
    else r.q_ = far_.isend(peer, tag, data, bytes);
    return r;
  }

  // A message to this rank itself goes through MPI: shared memory has rings between pairs only.
  int local_of(int peer) const {
    return routes_->near && peer != rank() ? routes_->local_of[static_cast<std::size_t>(peer)] : -1;
  }

  // An errc::aborted while a local rank's failed flag is up came over a channel every rank
  // hears (that rank's abort message and flag): this endpoint is marked failed without a message
  // of its own, so the executor's abort() sends none. (A message withdrawn with no flag up, a
  // send given up alone, leaves the endpoint as it was.)
  template <class F>
  auto settled(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const error& e) {
      if (e.code() != errc::aborted || !routes_->near) throw;
      if (!routes_->near->any_peer_failed() && !far_.aborted()) await_cause(e);
      if (routes_->near->any_peer_failed()) far_.mark_failed(e.peer(), e.detail());
      throw;
    }
  }

  // A peer on this node withdrew its message with no flag up: its call failed because it was
  // told of a failure in another group of the family (it raises no flag of its own, being told),
  // or it is about to say why. The cause is on its way (the origin's abort message over MPI, or
  // the peer's flag) and is the error worth reporting, so look for it a short while: a bare
  // "withdrew" names neither the failed rank nor its words. Throws the cause when one comes.
  void await_cause(const error& withdrawn) {
    const char* op = withdrawn.op().c_str();
    const auto until = clock::now() + cause_grace;
    do {
      far_.poll_abort(op, withdrawn.peer(), true);  // throws the family's failure, marking this endpoint
      if (routes_->near->any_peer_failed()) {
        try {
          routes_->near->throw_if_peer_failed(op, withdrawn.peer());
        } catch (const error& flagged) {
          far_.mark_failed(flagged.peer(), flagged.detail());
          throw;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } while (clock::now() < until);
  }
  // How long a withdrawal waits for its cause: an error path only, and the cause was sent before
  // the withdrawal (executor: abort first, requests destroyed after), so it comes within
  // milliseconds even on a loaded machine.
  static constexpr std::chrono::milliseconds cause_grace{250};

  // What every wait for a receive does after a look that found it unfinished: is the sender's
  // process still there? A dead one cannot tell the group; this rank does it in its name. Not
  // asked for sends: over MPI a large send completes only when the receiver's acknowledgement is
  // seen, and a receiver that got everything may have exited by then (its death, if it is one,
  // is found by those who receive from it). A rank that told the group before it went (its
  // abort message, its failed flag) is reported with its own words.
  void throw_if_gone(const char* op, int peer) {
    peer_watch* const watch = routes_ ? routes_->watch.get() : nullptr;
    if (!watch || std::string_view(op) != "recv" || !watch->gone(peer)) return;
    far_.poll_abort(op, peer, true);
    if (routes_->near) settled([&] {
      routes_->near->throw_if_peer_failed(op, peer);
      return 0;
    });
    const std::string what = "rank " + std::to_string(peer) + " (process " + std::to_string(watch->pid(peer)) +
                             " on the node of rank " + std::to_string(rank()) +
                             ") is gone: it exited or was killed without telling the group";
    // Not through the rings' flags: those would name this rank as the one that failed. The
    // abort message reaches the local ranks too, within a ring waiter's capped sleep.
    far_.abort(what, peer);
    far_.mark_failed(peer, what);
    throw error(errc::aborted, op, rank(), peer, what);
  }
  // What a wait on one kind does between its looks for the other kind, then the check above.
  struct progress_near {
    routed* self;
    const char* op;
    int peer;
    void operator()() const {
      if (self->routes_ && self->routes_->near) self->routes_->near->progress();
      self->throw_if_gone(op, peer);
    }
  };
  struct match_far {
    routed* self;
    const char* op;
    int peer;
    void operator()() const {
      if (self->routes_->remote) self->far_.match_all();
      self->far_.poll_abort(op, peer);  // a rank off this node (or any, over MPI) told the group it failed
      self->throw_if_gone(op, peer);
    }
  };
  template <class Q>
  static const char* op_of(const Q& q) {
    return q.is_recv() ? "recv" : "send";
  }
  progress_near move_near(const char* op, int peer) { return {this, op, peer}; }
  match_far move_far(const char* op, int peer) { return {this, op, peer}; }
  // With peers that MPI carries, a ring's waiter sleeps at most as long as MPI's would; with
  // processes to watch, no longer than watch_sleep, so that a dead one is noticed within it.
  static constexpr std::chrono::milliseconds watch_sleep{50};
  std::chrono::nanoseconds far_sleep() const {
    if (routes_->remote) return std::chrono::nanoseconds(mpi_p2p::max_sleep);
    return std::min<std::chrono::nanoseconds>(shm::endpoint::idle_sleep, watch_sleep);
  }

  mpi_p2p far_;
  std::shared_ptr<detail::routes> routes_;
  mpi_options opt_;
};

static_assert(transport<routed>);

}  // namespace lockstep::transport
