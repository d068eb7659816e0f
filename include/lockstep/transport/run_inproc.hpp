// lockstep/transport/run_inproc.hpp: run N ranks as threads of this process.
//
// run_inproc(n, f) builds a world of n in-process ranks, calls f(group) on a thread per rank, and
// rethrows the first real failure once every thread has ended. A rank that throws aborts the
// world, so the others leave their waits at once (with errc::aborted) instead of at the timeout.
#pragma once

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "../collective/group.hpp"
#include "inproc.hpp"

namespace lockstep {

template <class F>
void run_inproc(int n, F&& f, group_options opt = {}) {
  auto world = transport::inproc::make_world(n);
  std::mutex m;
  std::exception_ptr first, first_aborted;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        group<transport::inproc> g(transport::inproc(world, r), opt);
        f(g);
      } catch (const error& e) {
        world->abort(r, e.what());
        std::lock_guard lk(m);
        auto& slot = e.code() == errc::aborted ? first_aborted : first;
        if (!slot) slot = std::current_exception();
      } catch (const std::exception& e) {
        world->abort(r, e.what());
        std::lock_guard lk(m);
        if (!first) first = std::current_exception();
      } catch (...) {
        world->abort(r, "unknown exception");
        std::lock_guard lk(m);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  if (first_aborted) std::rethrow_exception(first_aborted);
}

}  // namespace lockstep
