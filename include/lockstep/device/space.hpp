// lockstep/device/space.hpp: the CUDA stream as an execution space (core/space.hpp): the executor's
// element work becomes kernels enqueued on one stream, and a call's completion is an event.
//
//   lockstep::group<transport::nccl> g(transport::nccl(comm, stream));   // space: cuda_space(stream)
//   auto r = lockstep::all_reduce_async(g, grads, topology::ring{}, codec);  // enqueues, returns
//
// The kernels are device/codec.hpp's (the host codecs' element math, bit for bit) and the average's
// division (space::detail::divide_by, the host's own); memory is cudaMallocAsync'd and freed in
// stream order. Nothing here waits for the GPU except drain(), which a failing call uses so that
// queued work is done before its error reaches code that frees the buffers that work uses.
#pragma once

#include "config.hpp"

#include <chrono>
#include <cstddef>
#include <thread>
#include <type_traits>

#include "../core/space.hpp"
#include "codec.hpp"
#include "runtime.hpp"

namespace lockstep::device {

class cuda_space {
 public:
  static constexpr bool ordered = true;
  using memory = buffer<std::byte>;
  using event = device::event;
  using handle_type = cudaStream_t;

  explicit cuda_space(cudaStream_t s) : s_(s) {}
  cudaStream_t handle() const noexcept { return s_; }
  static constexpr const char* name() noexcept { return "device"; }

  // Error feedback on the wire is its inner codec; the residual lives wherever the caller keeps it.
  template <codec::codec C>
  void encode(C& c, const float* x, std::size_t n, std::byte* wire, float* residual) const {
    if constexpr (requires { c.inner(); }) encode(c.inner(), x, n, wire, residual);
    else codec_kernels<std::remove_cvref_t<C>>::encode(c, x, n, wire, residual, s_);
  }
  template <codec::codec C>
  void decode(const C& c, const std::byte* wire, std::size_t n, float* out, bool add = false) const {
    if constexpr (requires { c.inner(); }) decode(c.inner(), wire, n, out, add);
    else codec_kernels<C>::decode(c, wire, n, out, add, s_);
  }
  template <codec::codec C>
  void decode_add(const C& c, const std::byte* wire, std::size_t n, float* acc) const { decode(c, wire, n, acc, true); }
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_), "cuda_space copy");
  }
  void zero(void* dst, std::size_t bytes) const {
    if (bytes) check(cudaMemsetAsync(dst, 0, bytes, s_), "cuda_space zero");
  }
  void divide(float* x, std::size_t n, float by) const { for_each_index(n, space::detail::divide_by{x, by}, s_, "average"); }
  memory allocate(std::size_t bytes) const { return memory(bytes, s_); }

  void record(event& e) const { e.record(s_); }
  void wait(const event& e) const { check(cudaStreamWaitEvent(s_, e.get(), 0), "cudaStreamWaitEvent"); }
  static bool ready(const event& e) { return e.ready(); }
  // Polled every 100 us to the deadline; the transport's abort, called first, unblocks a stalled stream.
  void drain(std::chrono::steady_clock::time_point until) const noexcept {
    while (cudaStreamQuery(s_) == cudaErrorNotReady && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }

 private:
  cudaStream_t s_;
};

static_assert(space::ordered_space<cuda_space>);

}  // namespace lockstep::device
