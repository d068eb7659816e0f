// lockstep/transport/peer_watch.hpp: whether the processes behind a group's ranks on this node are
// still there, so that a wait for a peer that was killed (SIGKILL, a crash, _exit) fails at once
// instead of at the group's timeout, and a timeout can say that its peer is stopped.
//
// The mpi transport (routed.hpp) learns its node-local peers' process ids at set-up, with or
// without shared memory, and a wait for one of them asks gone(peer) between its looks. Where the
// kernel has pidfd_open (Linux 5.3) each peer is a pidfd, readable once the process has exited
// (a zombie included) and immune to pid reuse; elsewhere kill(pid, 0) and /proc/<pid>/stat say
// the same, minus that immunity. Peers in another PID namespace, or on another node, are not
// watched: for them the group's timeout remains the guard.
//
// Only the peer a wait waits for is asked about: a rank that finished its part of the last call
// and exited is no failure of the calls that no longer need it.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "concept.hpp"

namespace lockstep::transport {

class peer_watch {
 public:
  // Asked at most this often per peer: a poll() each, far below a wait's own costs.
  static constexpr std::chrono::milliseconds interval{2};

  // Watches ranks 0..size-1, none of them yet.
  explicit peer_watch(int size) : slots_(static_cast<std::size_t>(size)) {}
  peer_watch(const peer_watch&) = delete;
  peer_watch& operator=(const peer_watch&) = delete;
  ~peer_watch() {
    for (auto& s : slots_)
      if (s.fd >= 0) close(s.fd);
  }

  // Watches `rank`, process `pid` of this PID namespace.
  void add(int rank, pid_t pid) {
    if (rank < 0 || rank >= static_cast<int>(slots_.size()) || pid <= 0) return;
    auto& s = slots_[static_cast<std::size_t>(rank)];
    s.pid = pid;
#ifdef SYS_pidfd_open
    s.fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#endif
    ++watched_;
  }
  int watched() const noexcept { return watched_; }
  pid_t pid(int rank) const {
    return rank >= 0 && rank < static_cast<int>(slots_.size()) ? slots_[static_cast<std::size_t>(rank)].pid : 0;
  }

  // True once `rank`'s process is known to have exited; false for a peer not watched. Called
  // between a wait's looks: an exit is reported by the call after the one that first saw it, so
  // that a message the peer finished just before it exited is found by the look in between.
  bool gone(int rank) {
    if (rank < 0 || rank >= static_cast<int>(slots_.size())) return false;
    auto& s = slots_[static_cast<std::size_t>(rank)];
    if (s.pid <= 0) return false;
    if (s.gone.load(std::memory_order_relaxed)) return true;
    if (s.seen.load(std::memory_order_relaxed)) {
      s.gone.store(true, std::memory_order_relaxed);
      return true;
    }
    const auto now = clock::now().time_since_epoch().count();
    if (now < s.next.load(std::memory_order_relaxed)) return false;
    s.next.store(now + std::chrono::duration_cast<clock::duration>(interval).count(), std::memory_order_relaxed);
    bool dead = false;
    if (s.fd >= 0) {
      pollfd p{s.fd, POLLIN, 0};
      dead = poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR));
    } else {
      dead = (kill(s.pid, 0) != 0 && errno == ESRCH) || state_of(s.pid) == 'Z';
    }
    if (dead) s.seen.store(true, std::memory_order_relaxed);
    return false;
  }

  // What this node can tell about `rank`'s process, for an error message: "process 1234 on this
  // node, stopped (SIGSTOP, or a debugger)"; empty for a peer not watched.
  std::string describe(int rank) {
    const pid_t p = pid(rank);
    if (p <= 0) return {};
    std::string s = "process " + std::to_string(p) + " on this node";
    if (slots_[static_cast<std::size_t>(rank)].seen.load(std::memory_order_relaxed)) return s + ", gone";
    switch (state_of(p)) {
      case 'T': return s + ", stopped (SIGSTOP or SIGTSTP)";
      case 't': return s + ", stopped by a debugger";
      case 'Z': case 'X': return s + ", gone";
      case 'R': return s + ", running";
      case 'S': return s + ", sleeping";
      case 'D': return s + ", in uninterruptible sleep (I/O)";
      default: return s;
    }
  }

 private:
  struct slot {
    pid_t pid = 0;
    int fd = -1;
    std::atomic<bool> seen{false};  // found exited once
    std::atomic<bool> gone{false};  // and reported
    std::atomic<clock::rep> next{0};
  };

  // The state letter of /proc/<pid>/stat (after the parenthesised name); 0 when unreadable.
  static char state_of(pid_t pid) {
    const std::string path = "/proc/" + std::to_string(pid) + "/stat";
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (!f) return 0;
    char buf[512];
    const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const std::string line(buf, n);
    const auto close_paren = line.rfind(')');
    return close_paren != std::string::npos && close_paren + 2 < line.size() ? line[close_paren + 2] : 0;
  }

  std::vector<slot> slots_;
  int watched_ = 0;
};

}  // namespace lockstep::transport
