// lockstep/topology/torus2d.hpp: the 2-D torus of Ying et al. 2018 over an R x C grid.
//
// Rank r sits at row i = r / C, column j = r % C. The buffer is cut into R*C chunks, grouped into
// R parts of C chunks (part i = chunks [i*C, i*C + C)).
//   1. reduce-scatter along each column (ring of R): rank (i, j) ends owning part i, summed over
//      its column;
//   2. reduce-scatter along each row (ring of C) inside part i: rank (i, j) ends owning chunk
//      i*C + j = r, summed over everything;
//   3. all-gather along each row, 4. all-gather along each column.
// The paper names the first dimension "rows"; which axis goes first is a transpose. Going columns
// first makes every span contiguous and leaves rank r owning chunk r, as reduce_scatter promises.
// Cost: 2(R+C-2) alpha + 2(N-1)/N S beta, the ring's bandwidth term with about 4 sqrt(N) steps.
#pragma once

#include <string>
#include <utility>

#include "../core/error.hpp"
#include "schedule.hpp"
#include "symmetry.hpp"

namespace lockstep::topology {

struct torus2d {
  int rows = 0;  // 0 and 0: the most square factorisation of the group size, rows <= cols
  int cols = 0;

  // rows x cols for `size` ranks; throws when a given shape does not match (naming `rank`, the
  // caller, where it is one).
  std::pair<int, int> shape(int size, int rank = -1) const {
    validate(size, rank);
    if (rows != 0 || cols != 0) return {rows, cols};
    int r = 1;
    for (int d = 1; d * d <= size; ++d)
      if (size % d == 0) r = d;
    return {r, size / r};
  }
  void validate(int size, int rank = -1) const {
    if (size < 1) throw error(errc::invalid_argument, "torus2d", rank, -1, "group size " + std::to_string(size));
    if (rows == 0 && cols == 0) return;
    if (rows < 1 || cols < 1 || static_cast<long long>(rows) * cols != size)
      throw error(errc::invalid_argument, "torus2d", rank, -1,
                  "shape " + std::to_string(rows) + "x" + std::to_string(cols) +
                      " does not match a group of " + std::to_string(size) + " ranks");
  }
  // Rank (a, b)'s steps are rank 0's with every peer moved a rows and b columns: both rings of
  // every rank run the same steps over the same spans.
  grid_symmetry symmetry(int size) const {
    const auto [r, c] = shape(size);
    return {r, c};
  }
  std::string name() const { return "torus2d"; }

  // The lambdas capture C by copy, by name: clang before 16 cannot capture a structured binding.
  schedule reduce_scatter(int rank, int size) const {
    const auto [R, C] = shape(size, rank);
    const int i = rank / C, j = rank % C;
    schedule s{rank, size, static_cast<std::uint32_t>(size), {}, {static_cast<std::uint32_t>(rank), 1}};
    ring_reduce_scatter(s, R, i, [C = C, j](int p) { return p * C + j; }, 0, static_cast<std::uint32_t>(C));
    ring_reduce_scatter(s, C, j, [C = C, i](int q) { return i * C + q; }, static_cast<std::uint32_t>(i * C), 1);
    return s;
  }
  schedule all_gather(int rank, int size) const {
    const auto [R, C] = shape(size, rank);
    const int i = rank / C, j = rank % C;
    schedule s{rank, size, static_cast<std::uint32_t>(size), {}, {static_cast<std::uint32_t>(rank), 1}};
    ring_all_gather(s, C, j, [C = C, i](int q) { return i * C + q; }, static_cast<std::uint32_t>(i * C), 1);
    ring_all_gather(s, R, i, [C = C, j](int p) { return p * C + j; }, 0, static_cast<std::uint32_t>(C));
    return s;
  }
};

}  // namespace lockstep::topology
