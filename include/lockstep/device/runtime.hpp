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
#include <memory>
#include <string>
#include <type_traits>

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
  if (cudaGetDeviceCount(&n) == cudaSuccess) return n;
  (void)cudaGetLastError();  // clear the sticky "no device" error for later calls
  return 0;
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
  stream() {
    cudaStream_t s = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    s_.reset(s);
  }
  cudaStream_t get() const noexcept { return s_.get(); }
  operator cudaStream_t() const noexcept { return get(); }
  void synchronize() const { LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(get())); }

 private:
  struct destroy {  // completes pending work first, asynchronously
    void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
  };
  std::unique_ptr<std::remove_pointer_t<cudaStream_t>, destroy> s_;
};

// An event without timing: the cheap kind, used only to order streams and to poll for completion.
class event {
 public:
  explicit event(unsigned flags = cudaEventDisableTiming) {
    cudaEvent_t e = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    e_.reset(e);
  }
  cudaEvent_t get() const noexcept { return e_.get(); }
  void record(cudaStream_t s) { LOCKSTEP_CUDA_CHECK(cudaEventRecord(get(), s)); }
  // true once all work captured by the last record() has finished; never blocks.
  bool ready() const {
    const cudaError_t r = cudaEventQuery(get());
    if (r == cudaErrorNotReady) return false;
    check(r, "cudaEventQuery");
    return true;
  }

 private:
  struct destroy {
    void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
  };
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, destroy> e_;
};

// Device memory of `n` elements of T, allocated and freed in stream order (cudaMallocAsync), so
// growing a scratch buffer never needs a host synchronisation.
template <class T>
class buffer {
 public:
  buffer() = default;
  buffer(std::size_t n, cudaStream_t s) : p_(nullptr, free_on{s}), n_(n) {
    T* p = nullptr;
    if (n) LOCKSTEP_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p), n * sizeof(T), s));
    p_.reset(p);
  }
  T* data() const noexcept { return p_.get(); }
  std::size_t size() const noexcept { return p_ ? n_ : 0; }  // 0 once moved from

 private:
  struct free_on {
    cudaStream_t s = nullptr;
    void operator()(T* p) const noexcept { cudaFreeAsync(p, s); }
  };
  std::unique_ptr<T, free_on> p_;
  std::size_t n_ = 0;
};

}  // namespace lockstep::device
