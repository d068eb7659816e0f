// lockstep/transport/run_inproc.hpp: run N ranks as threads of this process.
//
// run_inproc(n, f) builds a world of n in-process ranks, calls f(group) on a thread per rank, and
// rethrows the first real failure once every thread has ended. A rank that throws aborts the
// world, so the others leave their waits at once (with errc::aborted) instead of at the timeout.
#pragma once

#include "../collective/group.hpp"
#include "inproc.hpp"

namespace lockstep {

template <class F>
void run_inproc(int n, F&& f, group_options opt = {}) {
  auto world = transport::inproc::make_world(n);
  transport::detail::run_ranks(n, *world, [&](int r) {
    group<transport::inproc> g(transport::inproc(world, r), opt);
    f(g);
  });
}

}  // namespace lockstep
