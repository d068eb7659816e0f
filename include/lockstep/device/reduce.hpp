// lockstep/device/reduce.hpp: the block-level reduction the codec and optimizer kernels share.
//
// One value per thread reduced inside one CUDA block with cub::BlockReduce, the result handed to
// every thread of the block through shared memory. Call it from all threads of the block (it
// synchronises). The codec kernels take the max of codec::magnitude_bits (blockwise.hpp: integer
// order is float order there, as in the host's blockwise::absmax), the optimizer's the fp64 sums of
// squares.
#pragma once

#include "config.hpp"

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>
#include <cuda/std/functional>

namespace lockstep::device {

template <class T, int Threads>
struct block_reduce {
  using reduce_t = cub::BlockReduce<T, Threads>;
  struct storage {
    typename reduce_t::TempStorage tmp;
    T result;
  };
  template <class Op>
  __device__ static T all(storage& s, T mine, Op op) {
    const T v = reduce_t(s.tmp).Reduce(mine, op);
    if (threadIdx.x == 0) s.result = v;
    __syncthreads();
    const T out = s.result;
    __syncthreads();  // s may be reused by the caller's next round
    return out;
  }
};

}  // namespace lockstep::device
