// lockstep/transport/poll.hpp: the bounded wait of a polling transport (mpi_p2p, shm's endpoint):
// look; after a look that found nothing, run the checks a wait owes (another rank's abort, a dead
// peer, the caller's idle work), give up once the deadline has passed, and back off: a few bare
// looks (a message in flight lands within them), a few yields, then the transport's own pause
// (mpi: a short sleep; shm: a futex sleep on its doorbell) until the next look.
//
//   detail::poll_until(deadline, {spin_polls, yield_polls},
//                      look,      // () -> bool: done (may throw the request's own failure)
//                      between,   // (): after every look that found nothing (may throw)
//                      pause)     // (clock::time_point now): once spins and yields are spent
//   -> true when a look found it done, false when the deadline passed first
//
// The deadline is checked only after `between`, so a message that had arrived by then is taken by
// the next look, never reported as a timeout; and never before the first look, so a wait on a
// request that is already done succeeds even with a deadline in the past.
//
// Not for c10d's transport (python/lockstep_torch): a Gloo work has no non-blocking test and a
// timed-out Gloo wait closes the whole context, so its wait is one blocking call bounded by the
// time left, not a poll.
#pragma once

#include <thread>

#include "concept.hpp"

namespace lockstep::transport::detail {

struct backoff {
  int spin_polls = 0;   // looks with nothing in between
  int yield_polls = 0;  // then looks after a yield each
};

template <class Look, class Between, class Pause>
bool poll_until(clock::time_point deadline, backoff b, Look&& look, Between&& between, Pause&& pause) {
  for (int polls = 0;; ++polls) {
    if (look()) return true;
    between();
    const clock::time_point now = clock::now();
    if (now >= deadline) return false;
    if (polls < b.spin_polls) continue;
    if (polls < b.spin_polls + b.yield_polls) {
      std::this_thread::yield();
      continue;
    }
    pause(now);
  }
}

}  // namespace lockstep::transport::detail
