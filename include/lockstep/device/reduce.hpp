// lockstep/device/reduce.hpp: block-level reductions the codec and optimizer kernels share.
//
// Both reduce inside one CUDA block with cub::BlockReduce and hand the result to every thread of
// the block through shared memory. Call them from all threads of the block (they synchronise).
#pragma once

#include "config.hpp"

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>

#include <cstdint>

namespace lockstep::device {

// max |x| of the values the threads contributed, as the bit pattern of a non-negative float
// (integer order is float order there, as in the host's blockwise::absmax); every thread gets it.
template <int Threads>
struct block_absmax {
  using reduce_t = cub::BlockReduce<std::uint32_t, Threads>;
  struct storage {
    typename reduce_t::TempStorage tmp;
    std::uint32_t result;
  };
  __device__ static std::uint32_t bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }
  __device__ static std::uint32_t reduce(storage& s, std::uint32_t mine) {
    const std::uint32_t m = reduce_t(s.tmp).Reduce(mine, ::cuda::maximum<>{});
    if (threadIdx.x == 0) s.result = m;
    __syncthreads();
    const std::uint32_t out = s.result;
    __syncthreads();  // s may be reused by the caller's next round
    return out;
  }
  // The scale blockwise codecs write: NaN when the block holds a NaN or an Inf.
  __device__ static float scale(std::uint32_t m) {
    return m >= 0x7f800000u ? __uint_as_float(0x7fc00000u) : __uint_as_float(m);
  }
};

// Sum over the block in fp64 (the optimizer's per-block sums of squares); every thread gets it.
template <int Threads>
struct block_sum {
  using reduce_t = cub::BlockReduce<double, Threads>;
  struct storage {
    typename reduce_t::TempStorage tmp;
    double result;
  };
  __device__ static double reduce(storage& s, double mine) {
    const double v = reduce_t(s.tmp).Sum(mine);
    if (threadIdx.x == 0) s.result = v;
    __syncthreads();
    const double out = s.result;
    __syncthreads();
    return out;
  }
};

}  // namespace lockstep::device
