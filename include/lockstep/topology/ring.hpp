// lockstep/topology/ring.hpp: the bandwidth-optimal ring. Rank r sends to r+1 and receives from
// r-1; reduce-scatter and all-gather take size-1 steps each, each step moving 1/size of the buffer.
// Cost: 2(N-1) alpha + 2(N-1)/N S beta.
#pragma once

#include <string>

#include "../core/error.hpp"
#include "schedule.hpp"
#include "symmetry.hpp"

namespace lockstep::topology {

struct ring {
  std::string name() const { return "ring"; }
  void validate(int size, int rank = -1) const {
    if (size < 1) throw error(errc::invalid_argument, "ring", rank, -1, "group size " + std::to_string(size));
  }
  // Rank m's steps are rank 0's with every peer moved m places along the ring.
  grid_symmetry symmetry(int size) const { return {1, size}; }
  schedule reduce_scatter(int rank, int size) const {
    schedule s{rank, size, static_cast<std::uint32_t>(size), {}, {static_cast<std::uint32_t>(rank), 1}};
    ring_reduce_scatter(s, size, rank, [](int p) { return p; }, 0, 1);
    return s;
  }
  schedule all_gather(int rank, int size) const {
    schedule s{rank, size, static_cast<std::uint32_t>(size), {}, {static_cast<std::uint32_t>(rank), 1}};
    ring_all_gather(s, size, rank, [](int p) { return p; }, 0, 1);
    return s;
  }
};

}  // namespace lockstep::topology
