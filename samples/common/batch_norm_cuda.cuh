// samples/common/batch_norm_cuda.cuh: the GPU half of batch norm over a group of replicas
// (batch_norm.hpp), shared by both samples' CUDA backends: the per-channel reductions and the trip
// of the statistics through the host, where the group merges them as on the CPU.
//
// Both layouts are one indexing: element j (of n) of channel k lies at
//   (j / HW) K HW + k HW + j % HW
// which is NCHW with planes of HW cells, and NHWC (n rows of K channels) with HW = 1.
// Reductions are one CUDA block per channel, accumulated in double (CUB block reduction). For a
// fixed block size (bn_threads) the order of additions is fixed, so the sums are deterministic (run
// to run, replica to replica); they are not bit-equal to the CPU backend's, which adds in other
// chunks.
// The statistics go to the host, are merged there across the group (bn_merge_stats) and come
// back: 2K + 1 floats each way, one stream synchronisation per batch norm; backward's two sums
// likewise when the group has more than one replica.
// Limits: a block per channel reads its channel's elements with stride K under NHWC (uncoalesced):
// clear but slow. The fix, not done, is a two-stage reduction (coalesced partial sums over chunks of
// rows, then the partials of each channel in a fixed order), deterministic still.
#pragma once

#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <cstddef>
#include <vector>

#include "batch_norm.hpp"
#include "cuda_context.cuh"

namespace sample::gpu {

constexpr int bn_threads = 256;

__device__ inline std::size_t channel_index(std::size_t j, int k, int K, int HW) {
  return (j / HW) * static_cast<std::size_t>(K) * HW + static_cast<std::size_t>(k) * HW + j % HW;
}

// stats (2K): mean then M2 of each channel over its n elements.
static __global__ void bn_moments_kernel(float* stats, const float* inp, std::size_t n, int K, int HW) {
  using reduce = cub::BlockReduce<double, bn_threads>;
  __shared__ typename reduce::TempStorage tmp;
  __shared__ double mean_s;
  const int k = blockIdx.x;
  double s = 0;
  for (std::size_t j = threadIdx.x; j < n; j += bn_threads) s += inp[channel_index(j, k, K, HW)];
  s = reduce(tmp).Sum(s);
  if (threadIdx.x == 0) mean_s = s / static_cast<double>(n);
  __syncthreads();
  const float mf = static_cast<float>(mean_s);
  double m2 = 0;
  for (std::size_t j = threadIdx.x; j < n; j += bn_threads) {
    const float d = inp[channel_index(j, k, K, HW)] - mf;
    m2 += d * d;
  }
  m2 = reduce(tmp).Sum(m2);
  if (threadIdx.x == 0) stats[k] = static_cast<float>(mean_s), stats[K + k] = static_cast<float>(m2);
}

// The terms one element adds to its channel's two sums.
struct channel_terms {
  float u, v;
};

// sums (2K): sum of u then sum of v over each channel's n elements, where f(i, k) (i the element's
// index, k its channel) returns the element's terms (and may write per-element outputs).
template <class F>
__global__ void channel_sums_kernel(float* sums, std::size_t n, int K, int HW, F f) {
  using reduce = cub::BlockReduce<double, bn_threads>;
  __shared__ typename reduce::TempStorage tmp;
  const int k = blockIdx.x;
  double su = 0, sv = 0;
  for (std::size_t j = threadIdx.x; j < n; j += bn_threads) {
    const channel_terms t = f(channel_index(j, k, K, HW), k);
    su += t.u;
    sv += t.v;
  }
  su = reduce(tmp).Sum(su);
  __syncthreads();  // the temporary storage is reused
  sv = reduce(tmp).Sum(sv);
  if (threadIdx.x == 0) sums[k] = static_cast<float>(su), sums[K + k] = static_cast<float>(sv);
}

template <class F>
void channel_sums(float* sums, std::size_t n, int K, int HW, F f) {
  channel_sums_kernel<<<K, bn_threads, 0, cuda_ctx().stream>>>(sums, n, K, HW, f);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

// Batch norm's statistics on the device: mean_rstd (2K, device) = the group's mean then rstd of
// each channel of inp (n elements each); count (host) the group's element count; the running
// statistics (host) updated. Without training, the running statistics' mean and rstd. scratch: 2K
// device floats.
inline void bn_statistics(float* mean_rstd, float* count, float* running_mean, float* running_var, const float* inp,
                          std::size_t n, int K, int HW, const bn_group& group, bool training, float* scratch,
                          float momentum, float eps) {
  std::vector<float> host(2 * static_cast<std::size_t>(K));  // mean then rstd
  if (training) {
    bn_moments_kernel<<<K, bn_threads, 0, cuda_ctx().stream>>>(scratch, inp, n, K, HW);
    LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
    std::vector<float> stats(1 + 2 * static_cast<std::size_t>(K));  // (n, mean[K], M2[K]) of this replica
    stats[0] = static_cast<float>(n);
    to_host(stats.data() + 1, scratch, 2 * static_cast<std::size_t>(K));
    std::vector<float> all = stats;
    if (group.size > 1) {
      all.resize(stats.size() * static_cast<std::size_t>(group.size));
      group.all_gather(stats, all);
    }
    bn_merge_stats(host.data(), host.data() + K, count, running_mean, running_var, all, group.size, K, momentum, eps);
  } else {
    for (int k = 0; k < K; ++k) host[k] = running_mean[k], host[K + k] = 1.0f / std::sqrt(running_var[k] + eps);
  }
  to_device(mean_rstd, host.data(), host.size());
}

// After channel_sums made backward's sums (2K, device: sum dy then sum dy xhat over this replica):
// dbeta and dgamma get this replica's sums, and `sums` becomes the group's.
inline void bn_group_sums(float* dgamma, float* dbeta, float* sums, int K, const bn_group& group) {
  auto s = cuda_ctx().stream;
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(dbeta, sums, K * sizeof(float), cudaMemcpyDeviceToDevice, s));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(dgamma, sums + K, K * sizeof(float), cudaMemcpyDeviceToDevice, s));
  if (group.size > 1) {
    std::vector<float> host(2 * static_cast<std::size_t>(K));
    to_host(host.data(), sums, host.size());
    group.sum(host);
    to_device(sums, host.data(), host.size());
  }
}

}  // namespace sample::gpu
