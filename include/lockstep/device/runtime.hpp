// lockstep/device/runtime.hpp: the CUDA runtime pieces every device header needs: error checks
// that throw lockstep::error, owning handles for streams, events and device memory, and the
// "is there a GPU at all" question tests and benches ask first.
//
// Host code only (cuda_runtime.h, no kernels): this header compiles under g++ as well as nvcc, so a
// program built by a host compiler can own device buffers and streams that lockstep's kernels
// (compiled elsewhere by nvcc) work on.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "../core/error.hpp"

namespace lockstep::device {

// Throws errc::transport naming the failed call: CUDA failures are failures of the machinery that
// moves the bytes, not of the caller's arguments.
inline void check(cudaError_t e, const char* what, int rank = -1, int peer = -1) {
  if (e != cudaSuccess)
    throw error(errc::transport, what, rank, peer, std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e));
}

#define LOCKSTEP_CUDA_CHECK(call) ::lockstep::device::check((call), #call)

// Devices this process can use; 0 when there is no GPU or no driver (never throws), so that a
// test can report "skipped" instead of failing on a machine without a GPU.
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error for later calls
    return 0;
  }
  return n;
}

// Streaming multiprocessors of the current device: grids of persistent blocks are sized from it.
inline int sm_count() {
  int dev = 0, n = 0;
  LOCKSTEP_CUDA_CHECK(cudaGetDevice(&dev));
  LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// A non-blocking stream: it never synchronises with the legacy default stream, so N ranks on one
// GPU really run side by side.
class stream {
 public:
  stream() { LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  stream& operator=(stream&& o) noexcept {
    std::swap(s_, o.s_);
    return *this;
  }
  ~stream() {
    if (s_) cudaStreamDestroy(s_);  // completes pending work first, asynchronously
  }
  cudaStream_t get() const noexcept { return s_; }
  operator cudaStream_t() const noexcept { return s_; }
  void synchronize() const { LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

// An event without timing: the cheap kind, used only to order streams and to poll for completion.
class event {
 public:
  explicit event(unsigned flags = cudaEventDisableTiming) { LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&e_, flags)); }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  ~event() {
    if (e_) cudaEventDestroy(e_);
  }
  cudaEvent_t get() const noexcept { return e_; }
  void record(cudaStream_t s) { LOCKSTEP_CUDA_CHECK(cudaEventRecord(e_, s)); }
  // true once all work captured by the last record() has finished; never blocks.
  bool ready() const {
    const cudaError_t r = cudaEventQuery(e_);
    if (r == cudaErrorNotReady) return false;
    check(r, "cudaEventQuery");
    return true;
  }

 private:
  cudaEvent_t e_ = nullptr;
};

// Device memory of `n` elements of T, allocated and freed in stream order (cudaMallocAsync), so
// growing a scratch buffer never needs a host synchronisation.
template <class T>
class buffer {
 public:
  buffer() = default;
  buffer(std::size_t n, cudaStream_t s) : n_(n), s_(s) {
    if (n) LOCKSTEP_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p_), n * sizeof(T), s));
  }
  buffer(buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), s_(o.s_) {}
  buffer& operator=(buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(s_, o.s_);
    return *this;
  }
  ~buffer() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  T* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  cudaStream_t stream() const noexcept { return s_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
  cudaStream_t s_ = nullptr;
};

}  // namespace lockstep::device
