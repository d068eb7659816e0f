// samples/common/softmax_xent_cuda.cuh: softmax cross-entropy with label smoothing on the GPU, for
// both samples' CUDA backends: the element math is softmax_xent_math.hpp's (shared with the CPU),
// one thread per row forward, per logit backward. The loss is summed on the host in row order, as
// on the CPU.
//
// Shape legend: B rows (images), NC classes.
#pragma once

#include <vector>

#include "cuda_context.cuh"
#include "softmax_xent_math.hpp"

namespace sample::gpu {

static __global__ void xent_forward_kernel(float* probs, double* row_loss, int* row_argmax, const float* logits,
                                           const int* labels, int B, int NC, float smoothing) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < B) row_loss[b] = xent_row(probs + b * NC, &row_argmax[b], logits + b * NC, labels[b], NC, smoothing);
}

static __global__ void xent_backward_kernel(float* dlogits, const float* probs, const int* labels, int B, int NC,
                                            float smoothing) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < B * NC; i += gridDim.x * blockDim.x)
    dlogits[i] = xent_grad(probs[i], i % NC, labels[i / NC], NC, smoothing, 1.0f / B);
}

// Returns the mean loss over the B rows and counts the argmax hits (correct, may be null).
// labels: device (B); host_labels: the same on the host. scratch: at least B doubles + B ints of
// device memory.
inline float softmax_xent_forward(float* probs,             // (B, NC) device
                                  int* correct,             // (1) host, or null
                                  const float* logits,      // (B, NC) device
                                  const int* labels,        // (B) device
                                  const int* host_labels,   // (B) host
                                  int B, int NC, float smoothing, void* scratch) {
  auto s = cuda_ctx().stream;
  auto* row_loss = static_cast<double*>(scratch);
  auto* row_argmax = reinterpret_cast<int*>(row_loss + B);
  xent_forward_kernel<<<(B + 127) / 128, 128, 0, s>>>(probs, row_loss, row_argmax, logits, labels, B, NC, smoothing);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
  std::vector<double> loss(static_cast<std::size_t>(B));
  std::vector<int> argmax(static_cast<std::size_t>(B));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(loss.data(), row_loss, B * sizeof(double), cudaMemcpyDeviceToHost, s));
  LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(argmax.data(), row_argmax, B * sizeof(int), cudaMemcpyDeviceToHost, s));
  LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
  double total = 0;
  int hits = 0;
  for (int b = 0; b < B; ++b) total += loss[b], hits += argmax[b] == host_labels[b];
  if (correct) *correct = hits;
  return static_cast<float>(total / B);
}

inline void softmax_xent_backward(float* dlogits,      // (B, NC) device, overwritten
                                  const float* probs,  // (B, NC) device, from forward
                                  const int* labels,   // (B) device
                                  int B, int NC, float smoothing) {
  xent_backward_kernel<<<grid_for(static_cast<std::size_t>(B) * NC), 256, 0, cuda_ctx().stream>>>(
      dlogits, probs, labels, B, NC, smoothing);
  LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
}

}  // namespace sample::gpu
