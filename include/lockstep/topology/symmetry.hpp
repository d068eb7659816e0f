// lockstep/topology/symmetry.hpp: the symmetry a topology may declare, so that code walking every
// rank's schedule (the simulator) can walk one rank's instead.
//
// A translation symmetry on an R x C grid: rank r sits at (i, j) = (r / C, r % C), and moving by
// rank m = (a, b) takes (i, j) to (i + a mod R, j + b mod C). A topology that returns one from
// symmetry(size) promises: for every rank m and every step k, rank m's step k is rank 0's step k
// with both peers moved by m, and the same span sizes, action and phase. A ring is the 1 x N
// grid, torus2d its R x C. The promise is a hint, not a proof: the simulator still compares the
// schedules it relies on (sim/simulator.hpp, run_symmetric).
#pragma once

#include <concepts>

#include "concept.hpp"

namespace lockstep::topology {

struct grid_symmetry {
  int rows = 1;
  int cols = 1;

  // Rank x moved by rank m; -1 (no peer) stays -1.
  constexpr int move(int x, int m) const noexcept {
    if (x < 0) return x;
    return ((x / cols + m / cols) % rows) * cols + (x % cols + m % cols) % cols;
  }
  friend constexpr bool operator==(grid_symmetry, grid_symmetry) = default;
};

// The optional member: t.symmetry(size) for a group of `size` ranks (rows * cols == size).
template <class T>
concept symmetric_topology = topology<T> && requires(const T& t, int size) {
  { t.symmetry(size) } -> std::same_as<grid_symmetry>;
};

}  // namespace lockstep::topology
