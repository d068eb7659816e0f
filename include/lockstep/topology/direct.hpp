// lockstep/topology/direct.hpp: every rank talks to every peer directly (MPI's pairwise exchange).
//
// reduce_scatter: in step k = 1..N-1 rank r sends chunk r+k (its own values, never a partial sum)
// to rank r+k and receives chunk r from rank r-k, adding it into its own. all_gather: in step k
// rank r sends its final chunk r to rank r+k and receives chunk r-k from rank r-k (indices mod N).
// Cost: 2(N-1) alpha + 2(N-1)/N S beta, as a ring: the same messages, to other peers.
//
// What it buys is the shape of the reduction, not the wire: chunk r is summed on rank r from
// the N copies as they were, so nothing one rank sends waits on anything it receives. The
// executor sees that (pipeline::fan_in_end, run_fan_in in collective/executor.hpp) and, on a host group, posts the
// N-1 sends at once and adds the N-1 arriving copies in one pass over each segment: over inproc,
// read in place in the peers' buffers, 64 MiB on 4 ranks moves (N+1)/N of the buffer through
// memory in the reduce-scatter instead of a ring's 3(N-1)/N (80 against 144 MiB per rank).
// Lossy codecs quantise each rank's own values once and the owner's sum once, as every topology.
// The simulator runs that fan-in as the executor does (sim/simulator.hpp: the sends at once, one
// pass over the copies). topology::automatic weighs it against the others only where its
// calibration measured direct faster (automatic::direct_sizes: near 1 or 4 MiB, or every call of
// the bulk tier).
#pragma once

#include <cstdint>
#include <string>

#include "../core/error.hpp"
#include "schedule.hpp"
#include "symmetry.hpp"

namespace lockstep::topology {

struct direct {
  std::string name() const { return "direct"; }
  void validate(int size, int rank = -1) const {
    if (size < 1) throw error(errc::invalid_argument, "direct", rank, -1, "group size " + std::to_string(size));
  }
  // Rank m's steps are rank 0's with every peer moved m places, as on a ring.
  grid_symmetry symmetry(int size) const { return {1, size}; }

  schedule reduce_scatter(int rank, int size) const {
    validate(size, rank);
    schedule s = start(rank, size);
    for (int k = 1; k < size; ++k) {
      const int to = (rank + k) % size, from = (rank - k + size) % size;
      s.steps.push_back({to, one(to), from, one(rank), action::reduce, phase::reduce_scatter});
    }
    return s;
  }
  schedule all_gather(int rank, int size) const {
    validate(size, rank);
    schedule s = start(rank, size);
    for (int k = 1; k < size; ++k) {
      const int to = (rank + k) % size, from = (rank - k + size) % size;
      s.steps.push_back({to, one(rank), from, one(from), action::copy, phase::all_gather});
    }
    return s;
  }

 private:
  static constexpr chunk_span one(int c) noexcept { return {static_cast<std::uint32_t>(c), 1}; }
  static schedule start(int rank, int size) { return {rank, size, static_cast<std::uint32_t>(size), {}, one(rank)}; }
};

}  // namespace lockstep::topology
