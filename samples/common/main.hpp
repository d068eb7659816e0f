// samples/common/main.hpp: main() of a sample trainer, shared: under mpirun (a build with MPI,
// LOCKSTEP_SAMPLE_MPI) each process is one replica and --ranks becomes the job's size; otherwise
// the trainer's own run with its replicas as threads. A bad flag found late (std::invalid_argument)
// ends as the flag parser's errors do (status 2, "see --help"); any other error prints the
// program's name and the message and returns 1.
//
//   return sample::trainer_main("lockstep-train-x", argc, argv, o,
//                               [&](auto& world) { ... one replica of an MPI job ... },
//                               [&] { ... o.ranks replicas as threads ... });
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>

#include "flags.hpp"

#if LOCKSTEP_SAMPLE_MPI
#include <lockstep/lockstep.hpp>
#include <lockstep/transport/mpi.hpp>
#endif

namespace sample {

// Whether this process was started by mpirun (Open MPI's or a PMI launcher's environment).
inline bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"); }

template <class Options, class OnWorld, class InProcess>
int trainer_main(const char* program, int argc, char** argv, Options& o, OnWorld&& on_world, InProcess&& in_process) {
  try {
#if LOCKSTEP_SAMPLE_MPI
    if (under_mpirun()) {
      lockstep::transport::mpi_session session(&argc, &argv);
      lockstep::group<lockstep::transport::mpi> world(lockstep::transport::mpi(MPI_COMM_WORLD));
      o.ranks = world.size();
      try {
        on_world(world);
      } catch (const std::exception& e) {
        // Tell the other ranks before this one leaves: a rank that failed before any collective (a
        // bad data file or flag seen by this rank alone) left the others waiting in their first
        // one, the flag check, with nothing printed, while this rank sat in MPI_Finalize. Now they
        // stop with errc::aborted naming this rank and its message, and every rank returns.
        world.abort(e.what());
        if (dynamic_cast<const std::invalid_argument*>(&e))
          std::fprintf(stderr, "%s: rank %d: %s (see --help)\n", program, world.rank(), e.what());
        else
          std::fprintf(stderr, "%s: rank %d: %s\n", program, world.rank(), e.what());
        return dynamic_cast<const std::invalid_argument*>(&e) ? 2 : 1;
      }
      return 0;
    }
#else
    (void)on_world;
#endif
    in_process();
  } catch (const std::invalid_argument& e) {
    die(program, e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
  return 0;
}

}  // namespace sample
