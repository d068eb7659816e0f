// lockstep/optim/param_layout.hpp: a param_set's tensors and blocks as two flat arrays of plain
// structs, the form a kernel indexes (device/optim.hpp uploads them once, as device::param_table).
//
//   tensors  | t0 ............ | t1 ... | t2 ..................... |        // (tensor)
//   blocks   | b0 | b1 | b2    | b3     | b4 | b5 | b6 | b7        |        // (block)
//
// tensors[t] says where tensor t lies and which blocks are its own; blocks[b] says which buffer
// elements block b covers and which tensor holds it. Both come from the param_set's own accessors
// (first_block, block_range), so a kernel walking blocks[] sums exactly the host sweep's blocks.
// Host code only: nothing here needs a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "param_set.hpp"

namespace lockstep::optim {

struct param_layout {
  struct tensor {
    std::size_t offset, size;           // buffer elements [offset, offset + size)
    std::uint32_t first_block, blocks;  // its blocks: [first_block, first_block + blocks)
    bool exempt;                        // as tensor_desc::exempt
  };
  struct block {
    std::size_t lo, hi;     // buffer elements [lo, hi)
    std::uint32_t tensor;   // the tensor that holds it
  };

  explicit param_layout(const param_set& ps) {
    tensors.reserve(ps.tensor_count());
    blocks.reserve(ps.block_count());
    for (std::size_t t = 0; t < ps.tensor_count(); ++t) {
      tensors.push_back({ps[t].offset, ps[t].size, static_cast<std::uint32_t>(ps.first_block(t)),
                         static_cast<std::uint32_t>(ps.block_count(t)), ps[t].exempt});
      for (std::size_t b = 0; b < ps.block_count(t); ++b) {
        const auto [lo, hi] = ps.block_range(t, b);
        blocks.push_back({lo, hi, static_cast<std::uint32_t>(t)});
      }
    }
  }

  std::vector<tensor> tensors;  // (tensor)
  std::vector<block> blocks;    // (block)
};

// The blocks of tensors [a, b) of ps, as block indices [first, last): a kernel over exactly those
// tensors walks blocks[first .. last). Empty when a >= b.
inline std::pair<std::size_t, std::size_t> blocks_of(const param_set& ps, std::size_t a, std::size_t b) noexcept {
  if (a >= b) return {0, 0};
  return {ps.first_block(a), ps.first_block(b - 1) + ps.block_count(b - 1)};
}

}  // namespace lockstep::optim
