// lockstep/core/deadline.hpp: "now + timeout" that cannot overflow.
//
// steady_clock counts nanoseconds in 64 bits, so now() + d wraps into the past for d beyond about
// 292 years less the clock's epoch offset (a timeout of 1e10 s already does): every wait would then
// time out at once. A timeout that large means "no deadline": it is held at a century from now.
// Not at the clock's end: code beneath may turn the time left back into a duration and add it to
// its own now() (Gloo's waits take milliseconds and do), which must not overflow either.
#pragma once

#include <chrono>

namespace lockstep {

// The longest wait a deadline stands for: a century, "never" for any program.
inline constexpr std::chrono::seconds longest_wait{std::chrono::hours(24) * 36525};

template <class Rep, class Period>
std::chrono::steady_clock::time_point deadline_after(std::chrono::duration<Rep, Period> d) {
  using clock = std::chrono::steady_clock;
  // Compared in seconds as doubles: d may be in any unit and any size, finite or not.
  const double s = std::chrono::duration<double>(d).count();
  if (!(s < std::chrono::duration<double>(longest_wait).count()))  // NaN too: no deadline
    return clock::now() + std::chrono::duration_cast<clock::duration>(longest_wait);
  if (!(s > 0)) return clock::now();  // over already (a huge negative count would overflow the cast)
  return clock::now() + std::chrono::duration_cast<clock::duration>(d);
}

}  // namespace lockstep
