// lockstep/device/config.hpp: what every kernel header checks first, and the launch policies.
//
// Headers that define kernels need nvcc: under a host compiler they stop with a sentence saying so
// (Thrust's rule: a backend without an algorithm fails to compile and says why) instead of a page
// of errors about __global__. Host-only device code (runtime.hpp) compiles anywhere.
//
// Layers, CUB's way:
//   element  codec/*.hpp, optim/*.hpp    LOCKSTEP_HD math, shared with the host loops
//   thread   the loops inside kernels     one value at a time, __fmul_rn/__fadd_rn where the
//                                         host rounds each operation on its own
//   block    reduce.hpp                   absmax and sums of squares over one block (block_reduce)
//   device   codec.hpp, optim.hpp         grid-stride kernels and their launch from the host
//   stream   space.hpp (cuda_space)       collective/executor.hpp's schedule enqueued on a stream
#pragma once

#if !defined(__CUDACC__)
#error "this lockstep/device header defines CUDA kernels: compile it with nvcc (a .cu file); host-only code may include lockstep/device/runtime.hpp"
#endif

#include <algorithm>
#include <cstddef>

#include "runtime.hpp"

namespace lockstep::device {

// Launch shapes (how they were chosen, what should move them: docs/design.md, "Device launch shapes").
struct codec_policy {
  static constexpr int block_threads = 128;  // one CUDA block per codec block of 512 values: 4 each
  static constexpr int blocks_per_sm = 16;   // 16 x 128 threads = 2048, a full SM on sm_80 and sm_90
};
struct elementwise_policy {
  static constexpr int block_threads = 256;
  static constexpr int blocks_per_sm = 8;
};
struct optim_policy {
  static constexpr int block_threads = 256;  // a param_set block of 4096 values: 16 per thread
};

// A grid of at most `per_sm` blocks per SM: kernels loop grid-stride, so every block builds its
// shared tables once and then streams.
inline unsigned grid_for(std::size_t work_items, int per_sm) {
  static thread_local int sms = 0;
  if (!sms) sms = sm_count();
  const std::size_t cap = static_cast<std::size_t>(sms) * static_cast<std::size_t>(per_sm);
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min(work_items, cap)));
}

inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

namespace kernels {
// f(i) for every i < n, grid-stride. F is a plain struct (pointers and scalars) whose operator()
// (std::size_t), callable on the device, is one element's work: the elementwise codecs', the
// average's (codec/elementwise.hpp, core/space.hpp: the host loops' own).
template <class F>
__global__ void elementwise(F f, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    f(i);
}
}  // namespace kernels

// Enqueues f(0) .. f(n - 1) on s; `what` names the launch in a failure.
template <class F>
void for_each_index(std::size_t n, const F& f, cudaStream_t s, const char* what) {
  using P = elementwise_policy;
  if (!n) return;
  kernels::elementwise<<<grid_for((n + P::block_threads - 1) / P::block_threads, P::blocks_per_sm), P::block_threads, 0, s>>>(f, n);
  check_launch(what);
}

}  // namespace lockstep::device
