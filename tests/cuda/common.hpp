// Shared by the GPU tests: device copies of host vectors and seeded inputs with the awkward cases
// (zero blocks, a block holding NaN or Inf) the codecs must keep visible.
#pragma once

#include <cstring>
#include <random>
#include <vector>

#include <lockstep/device/runtime.hpp>

namespace lockstep::test {

#if defined(__CUDACC__)
__device__ inline unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

template <class T>
device::buffer<T> to_device(const std::vector<T>& v, cudaStream_t s) {
  device::buffer<T> d(v.size(), s);
  if (!v.empty()) LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, std::size_t n, cudaStream_t s) {
  std::vector<T> v(n);
  if (n) LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, s));
  LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

// Normal values over several decades; with `specials`, a zero run, a NaN and an Inf placed so that
// they land in different codec blocks of 512, and a block of values near FLT_MAX.
inline std::vector<float> inputs(std::size_t n, std::uint32_t seed, bool specials = true) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-12, 4);
  std::vector<float> v(n);
  for (auto& x : v) x = std::ldexp(d(g), e(g));
  if (specials && n > 4096) {
    for (std::size_t i = 1024; i < 1536; ++i) v[i] = 0.0f;
    v[2100] = std::numeric_limits<float>::quiet_NaN();
    v[3000] = std::numeric_limits<float>::infinity();
  }
  if (specials && n > 5120) {  // block 8 near FLT_MAX: absmax above 2^126, the encoders' stepped-down path
    std::uniform_int_distribution<int> big(118, 124);
    for (std::size_t i = 4096; i < 4608; ++i) v[i] = std::ldexp(d(g), big(g));
    v[4100] = 3.0e38f;
  }
  return v;
}

// Bitwise equality, NaN included (the codecs' NaN payloads are part of the contract).
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b, std::size_t* where = nullptr) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      if (where) *where = i;
      return false;
    }
  return true;
}

#if defined(__CUDACC__)
namespace kernels {
// Keeps a stream busy for about `ns` nanoseconds: work enqueued behind it is certainly not done
// when the enqueueing call returns, unless that call waited for the GPU.
__global__ void spin(unsigned long long ns) {
  const unsigned long long t0 = globaltimer();
  while (globaltimer() - t0 < ns) {
  }
}
}  // namespace kernels
#endif

}  // namespace lockstep::test
