// samples/resnet50/replica_cuda.cuh: one replica of lockstep-train-resnet50-cuda on a GPU: the cuDNN
// model (model_cuda.cuh), its gradients averaged and applied by lockstep's bucketed fused step
// (optim::begin_step with a device::plan), as the Fashion sample's replica_cuda.cuh does. The loop
// that drives it is trainer.hpp's train_replica, the CPU trainer's.
//
// Two streams per replica, as in PyTorch's DDP: the model computes on its own stream
// (sample::gpu::cuda_ctx()), the device group communicates on its stream. The moment backward has
// enqueued a bucket's gradients (the classifier, a bottleneck, the stem), an event orders the
// group's stream after them and the bucket's all-reduce is enqueued there with the update of its
// tensors (SGD or LARS, and under --precision bf16 the bf16 copy the convolutions read) as its
// epilogue, while the model stream computes the layers before it. The next forward waits for the
// updates (an event), not the host. Batch-norm statistics, validation sums and checkpoints go
// through the host group, as on the CPU.
// Limits: replicas as threads on one GPU (inproc_device), or one replica per MPI process and GPU
// (NCCL, train_resnet50_cuda.cu); checkpoints at epoch ends only.
#pragma once

#include <algorithm>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <lockstep/device/optim.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/device/step.hpp>
#include <lockstep/optim/step.hpp>
#include <lockstep/transport/inproc_device.hpp>

#include "../common/softmax_xent.hpp"
#include "model_cuda.cuh"
#include "trainer.hpp"

namespace resnet {

// T: float (--precision fp32) or bf16_t (--precision bf16).
template <class DeviceGroup, class Topo, class Codec, class Opt, class T>
class gpu_replica {
 public:
  static constexpr bool has_residuals = lockstep::codec::feedback_codec<Codec>;

  gpu_replica(DeviceGroup& dg, const options& o, int classes, Topo topo, Codec& codec, Opt opt)
      : dg_(dg),
        topo_(topo),
        codec_(codec),
        opt_(opt),
        m_(gpu::model_create<T>(model_config(o, classes), o.seed)),
        ps_(tensor_descs(m_.L)),
        table_(ps_, dg.stream()),
        v_(opt.uses_momentum() ? m_.L.total : 0, dg.stream()),
        ready_(m_.L.buckets.size()) {
    for (auto [first, last] : m_.L.buckets) buckets_.push_back({first, last});
    if (v_.size()) LOCKSTEP_SAMPLE_CHECK(cudaMemsetAsync(v_.data(), 0, v_.size() * sizeof(float), dg.stream()));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(dg.stream()));
  }
  gpu_replica(const gpu_replica&) = delete;
  gpu_replica& operator=(const gpu_replica&) = delete;

  // The group's stream (the update, the collectives) and, on inproc_device, peers' streams may
  // still use the model's buffers: wait for both streams first. Best effort: this also runs while
  // an exception unwinds.
  ~gpu_replica() {
    const cudaStream_t compute = gpu::stream();
    cudaStreamWaitEvent(compute, updated_.get(), 0);
    cudaStreamSynchronize(dg_.stream());
    cudaStreamSynchronize(compute);
  }

  float train_step(const float* images, const int* labels, int B, const sample::bn_group& bng, float lr) {
    const cudaStream_t compute = gpu::stream(), comm = dg_.stream();
    after_update(compute);  // the forward reads the parameters the last update wrote
    const float loss = gpu::model_forward(m_, images, labels, B, bng, true);
    // Gradient sync and update, the one call site: each bucket is averaged over all replicas and
    // applied as soon as backward has written it (its all-reduce waits for the gradients' event).
    bf16_t* bf = nullptr;
    if constexpr (!std::is_same_v<T, float>) bf = m_.params_bf16.data();
    const lockstep::device::plan<Opt> p{.opt = opt_, .table = table_, .weights = {m_.params.data(), m_.L.total},
                                        .grads = {m_.grads.data(), m_.L.total},
                                        .momentum = v_.size() ? v_.data() : nullptr, .weights_bf16 = bf,
                                        .average = lockstep::optim::averaging::in_collective};
    auto s = lockstep::optim::begin_step(dg_, topo_, codec_, p, buckets_, lr);
    gpu::model_backward(m_, bng, [&](int k) {
      ready_[static_cast<std::size_t>(k)].record(compute);
      LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(comm, ready_[static_cast<std::size_t>(k)].get(), 0));
      s.bucket_ready(static_cast<std::size_t>(k));
    });
    s.wait();  // errors and timeouts of this step surface here
    updated_.record(comm);
    return loss;
  }

  // Forward with the running statistics over a batch of B; loss and hits of its first `valid` rows,
  // from the logits on the host (the CPU backend's code).
  float evaluate(const float* images, const int* labels, int B, int valid, const sample::bn_group& bng, int* top1, int* top5) {
    std::vector<int> y(labels, labels + B);
    for (int& v : y) v = std::max(v, 0);  // padding rows: any class, they are not counted
    after_update(gpu::stream());
    gpu::model_logits(m_, images, y.data(), B, bng, false);
    const int NC = m_.cfg.classes;
    std::vector<float> logits = download(m_.logits.data(), static_cast<std::size_t>(B) * NC);
    std::vector<float> probs(logits.size());
    *top5 = sample::topk_hits(logits.data(), y.data(), valid, NC, 5);
    return sample::softmax_xent_forward(probs.data(), top1, logits.data(), y.data(), valid, NC, 0.0f);
  }

  gpu::model<T>& net() { return m_; }
  std::span<float> running() { return m_.running; }
  std::vector<float> params() { return download(m_.params.data(), m_.L.total); }
  std::vector<float> momentum() { return download(v_.data(), v_.size()); }

  // Per bucket, the codec's own checkpoint share of its error-feedback residuals (device memory).
  std::vector<float> residuals() {
    std::vector<float> mine;
    if constexpr (has_residuals) {
      mine.resize(Codec::state_floats(m_.L.total));
      float* out = mine.data();
      for (auto [first, last] : m_.L.buckets) {
        codec_.save(std::span<const float>(m_.grads.data() + first, last - first), out, dg_.space());
        out += Codec::state_floats(last - first);
      }
      LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(dg_.stream()));
    }
    return mine;
  }

  void restore(const checkpoint& c, int rank, int R, const std::string& path) {
    if (c.params.size() != m_.L.total || c.running.size() != m_.running.size() || c.momentum.size() != v_.size())
      throw std::runtime_error(path + ": sizes do not match this model and optimizer");
    gpu::model_set_params(m_, c.params);
    m_.running = c.running;
    const cudaStream_t comm = dg_.stream();
    if (v_.size())
      LOCKSTEP_SAMPLE_CHECK(
          cudaMemcpyAsync(v_.data(), c.momentum.data(), v_.size() * sizeof(float), cudaMemcpyHostToDevice, comm));
    if constexpr (has_residuals) {
      const float* r = sample::checkpoint_residuals(c.residuals, m_.L.total, rank, R, path);
      for (auto [first, last] : m_.L.buckets) {
        codec_.load(std::span<const float>(m_.grads.data() + first, last - first), r, dg_.space());
        r += Codec::state_floats(last - first);
      }
    }
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(comm));
  }

 private:
  void after_update(cudaStream_t s) { LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(s, updated_.get(), 0)); }

  std::vector<float> download(const float* d, std::size_t n) {
    std::vector<float> h(n);
    const cudaStream_t s = gpu::stream();
    after_update(s);
    if (n) LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
    return h;
  }

  DeviceGroup& dg_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  gpu::model<T> m_;
  lockstep::optim::param_set ps_;
  lockstep::device::param_table table_;
  gpu::dbuf<float> v_;                            // momentum, on the device
  std::vector<lockstep::optim::bucket> buckets_;  // (bucket) the model's, in backward's index order
  std::vector<lockstep::device::event> ready_;    // per bucket: its gradients are written
  lockstep::device::event updated_;               // the last update is done
};

// One replica of a run on a GPU, the policies and precision named by the flags: its pipelines, the
// host group `host` for batch norm, validation and checkpoints, the device group `dg` for gradients.
template <class HostGroup, class DeviceGroup>
void train_dispatch_cuda(HostGroup& host, DeviceGroup& dg, const options& o, run_result& result) {
  const int rank = host.rank(), R = host.size();
  sample::image_pipeline train(pipeline_options(o, true, rank, R));
  std::unique_ptr<sample::image_pipeline> val;
  if (!o.synthetic && std::filesystem::exists(o.data + "/val"))
    val = std::make_unique<sample::image_pipeline>(pipeline_options(o, false, rank, R));
  const int classes = o.synthetic ? o.classes : train.classes();
  if (rank == 0 && !o.quiet)
    std::printf("%s: %d classes, %zu training images, %zu steps per epoch\n",
                o.synthetic ? "synthetic data" : o.data.c_str(), classes, train.images(), train.steps_per_epoch());
  sample::with_policies(o, [&](auto topo, auto& codec, auto opt) {
    auto go = [&](auto precision) {
      using T = decltype(precision);
      gpu_replica<DeviceGroup, decltype(topo), std::remove_reference_t<decltype(codec)>, decltype(opt), T> rep(
          dg, o, classes, topo, codec, opt);
      try {
        train_replica(host, o, train, val.get(), rep, result);
      } catch (const std::exception& e) {
        // Before the replica's buffers go: the peers may be waiting on the device transport (or
        // reading this replica's memory), which the host group's abort does not reach.
        dg.transport().abort(std::string("replica ") + std::to_string(rank) + " failed: " + e.what());
        throw;
      }
    };
    if (o.precision == "bf16") go(bf16_t{});
    else go(float{});
  });
}

// A whole run with o.ranks replicas as threads of this process, all on the current GPU: a host
// group per replica for batch norm and validation, a device group (inproc_device) for the
// gradients. A failing replica aborts both worlds (run_inproc the host's, train_dispatch_cuda the
// device's), so the others leave their waits at once.
inline run_result train_inproc_cuda(const options& o) {
  validate(o);
  std::filesystem::create_directories(o.out);
  run_result result;
  auto device_world = lockstep::transport::inproc_device::make_world(o.ranks);
  int dev = 0;
  LOCKSTEP_SAMPLE_CHECK(cudaGetDevice(&dev));
  lockstep::run_inproc(o.ranks, [&](auto& host) {
    LOCKSTEP_SAMPLE_CHECK(cudaSetDevice(dev));
    lockstep::device::stream comm;  // before the group: the group frees its scratch on it
    lockstep::group<lockstep::transport::inproc_device> dg(
        lockstep::transport::inproc_device(device_world, host.rank(), comm.get()));
    train_dispatch_cuda(host, dg, o, result);
  });
  return result;
}

}  // namespace resnet
