// samples/common/replica_cuda.cuh: what the sample trainers' GPU replicas (Fashion CNN, ResNet-50)
// share of a training step: lockstep's bucketed fused step on device buffers (optim::begin_step
// with a device::plan), ordered between two streams, and the optimizer state and error-feedback
// residuals it keeps, for checkpoints. The GPU twin of replica.hpp's bucketed_step.
//
// Two streams per replica, as in PyTorch's DDP: the model computes on its own stream (cuda_ctx()),
// the device group communicates on its stream. The moment backward has enqueued a bucket's
// gradients, an event orders the group's stream after them and the bucket's all-reduce is enqueued
// there with the update of its tensors (SGD or LARS, and the bf16 copy of the weights where there
// is one) as its epilogue, while the model stream computes the layers before it. The next forward
// waits for the updates by event (after_update), not the host.
//
//   sample::gpu::device_bucketed_step<DG, Topo, Codec, Opt> step(dg, topo, codec, opt, tensors, buckets, total);
//   step.after_update(cuda_ctx().stream);  forward(...);
//   step.run(weights, grads, bf16_or_null, lr, [&](auto ready) { model_backward(m, bng, ready); });
//
// The collective averages (averaging::in_collective), as on the CPU. Declare it after the model in
// a replica: its destructor waits for both streams before the model's buffers go.
// Limits: one flat block; backward must report every bucket, in the same order on every replica.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <lockstep/device/optim.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/device/step.hpp>
#include <lockstep/optim/bucket.hpp>
#include <lockstep/optim/param_set.hpp>
#include <lockstep/optim/step.hpp>

#include "cuda_context.cuh"

namespace sample::gpu {

template <class DeviceGroup, class Topo, class Codec, class Opt>
class device_bucketed_step {
 public:
  static constexpr bool has_residuals = lockstep::codec::feedback_codec<Codec>;

  // tensors: the block's tensors (offset, size, plain); buckets: [first, last) element ranges, in
  // the index order backward reports them by; total: the block's elements.
  device_bucketed_step(DeviceGroup& dg, Topo topo, Codec& codec, Opt opt,
                       std::vector<lockstep::optim::tensor_desc> tensors,
                       const std::vector<std::pair<std::size_t, std::size_t>>& buckets, std::size_t total)
      : dg_(dg),
        topo_(topo),
        codec_(codec),
        opt_(opt),
        total_(total),
        ps_(std::move(tensors)),
        table_(ps_, dg.stream()),
        v_(opt.uses_momentum() ? total : 0, dg.stream()),
        ready_(buckets.size()) {
    for (auto [first, last] : buckets) buckets_.push_back({first, last});
    if (v_.size()) LOCKSTEP_SAMPLE_CHECK(cudaMemsetAsync(v_.data(), 0, v_.size() * sizeof(float), dg.stream()));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(dg.stream()));
  }
  device_bucketed_step(const device_bucketed_step&) = delete;
  device_bucketed_step& operator=(const device_bucketed_step&) = delete;

  // The group's stream (the update, the collectives) and, on inproc_device, peers' streams may
  // still use the model's buffers: wait for both streams. Best effort: this also runs while an
  // exception unwinds.
  ~device_bucketed_step() {
    const cudaStream_t compute = cuda_ctx().stream;
    cudaStreamWaitEvent(compute, updated_.get(), 0);
    cudaStreamSynchronize(dg_.stream());
    cudaStreamSynchronize(compute);
  }

  // Work enqueued on s after this sees the last update's weights.
  void after_update(cudaStream_t s) { LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(s, updated_.get(), 0)); }

  // One step's gradient sync and update, the one call site: backward(ready) enqueues every gradient
  // into `grads` on the compute stream (cuda_ctx().stream), calling ready(k) the moment bucket k is
  // enqueued; each bucket is averaged over all replicas and applied to `weights` (and
  // `weights_bf16` unless null) as soon as its gradients are written. Errors and timeouts of the
  // step surface here.
  template <class Backward>
  void run(std::span<float> weights, std::span<float> grads, std::uint16_t* weights_bf16, float lr,
           Backward&& backward) {
    const cudaStream_t compute = cuda_ctx().stream, comm = dg_.stream();
    const lockstep::device::plan<Opt> p{.opt = opt_, .table = table_, .weights = weights, .grads = grads,
                                        .momentum = v_.size() ? v_.data() : nullptr, .weights_bf16 = weights_bf16,
                                        .average = lockstep::optim::averaging::in_collective};
    auto s = lockstep::optim::begin_step(dg_, topo_, codec_, p, buckets_, lr);
    backward([&](int k) {
      ready_[static_cast<std::size_t>(k)].record(compute);
      LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(comm, ready_[static_cast<std::size_t>(k)].get(), 0));
      s.bucket_ready(static_cast<std::size_t>(k));
    });
    s.wait();
    updated_.record(comm);
  }

  // n floats of device memory on the host, after the last update.
  std::vector<float> download(const float* d, std::size_t n) {
    std::vector<float> h(n);
    const cudaStream_t s = cuda_ctx().stream;
    after_update(s);
    if (n) LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
    return h;
  }

  std::size_t momentum_size() const { return v_.size(); }
  std::vector<float> momentum() { return download(v_.data(), v_.size()); }
  void set_momentum(const std::vector<float>& h) {
    if (v_.size())
      LOCKSTEP_SAMPLE_CHECK(
          cudaMemcpyAsync(v_.data(), h.data(), v_.size() * sizeof(float), cudaMemcpyHostToDevice, dg_.stream()));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(dg_.stream()));
  }

  // This replica's error-feedback residuals, bucket by bucket in the codec's checkpoint form (empty
  // without error feedback); `grads` (device) names the buckets' element ranges.
  std::vector<float> residuals(const float* grads) {
    std::vector<float> mine;
    if constexpr (has_residuals) {
      mine.resize(Codec::state_floats(total_));
      float* out = mine.data();
      for (const auto& b : buckets_) {
        codec_.save(std::span<const float>(grads + b.first, b.last - b.first), out, dg_.space());
        out += Codec::state_floats(b.last - b.first);
      }
      LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(dg_.stream()));
    }
    return mine;
  }

  // The inverse of residuals(): r points at this replica's share of a checkpoint's residuals.
  void restore_residuals(const float* grads, const float* r) {
    if constexpr (has_residuals) {
      for (const auto& b : buckets_) {
        codec_.load(std::span<const float>(grads + b.first, b.last - b.first), r, dg_.space());
        r += Codec::state_floats(b.last - b.first);
      }
      LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(dg_.stream()));
    }
  }

 private:
  DeviceGroup& dg_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  std::size_t total_;  // elements of the block
  lockstep::optim::param_set ps_;
  lockstep::device::param_table table_;
  lockstep::device::buffer<float> v_;             // momentum, on the device
  std::vector<lockstep::optim::bucket> buckets_;  // (bucket) in backward's index order
  std::vector<lockstep::device::event> ready_;    // per bucket: its gradients are written
  lockstep::device::event updated_;               // the last update is done
};

}  // namespace sample::gpu
