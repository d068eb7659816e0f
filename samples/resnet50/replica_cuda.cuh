// samples/resnet50/replica_cuda.cuh: one replica of lockstep-train-resnet50-cuda on a GPU: the cuDNN
// model (model_cuda.cuh), its gradients averaged and applied by lockstep's bucketed fused step
// (optim::begin_step with a device::plan: samples/common/replica_cuda.cuh, shared with the Fashion
// sample). The loop that drives it is trainer.hpp's train_replica, the CPU trainer's.
//
// Two streams per replica, as in PyTorch's DDP: the moment backward has enqueued a bucket's
// gradients (the classifier, a bottleneck, the stem), the bucket's all-reduce is enqueued on the
// device group's stream with the update of its tensors (SGD or LARS, and under --precision bf16 the
// bf16 copy the convolutions read) as its epilogue, while the model stream computes the layers
// before it. Batch-norm statistics, validation sums and checkpoints go through the host group, as
// on the CPU.
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

#include <lockstep/transport/inproc_device.hpp>

#include "../common/replica_cuda.cuh"
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
      : m_(gpu::model_create<T>(model_config(o, classes), o.seed)),
        step_(dg, topo, codec, opt, tensor_descs(m_.L), m_.L.buckets, m_.L.total) {}

  float train_step(const float* images, const int* labels, int B, const sample::bn_group& bng, float lr) {
    step_.after_update(gpu::stream());  // the forward reads the parameters the last update wrote
    const float loss = gpu::model_forward(m_, images, labels, B, bng, true);
    bf16_t* bf = nullptr;
    if constexpr (!std::is_same_v<T, float>) bf = m_.params_bf16.data();
    step_.run({m_.params.data(), m_.L.total}, {m_.grads.data(), m_.L.total}, bf, lr,
              [&](auto ready) { gpu::model_backward(m_, bng, ready); });
    return loss;
  }

  // Forward with the running statistics over a batch of B; loss and hits of its first `valid` rows,
  // from the logits on the host (the CPU backend's code).
  float evaluate(const float* images, const int* labels, int B, int valid, const sample::bn_group& bng, int* top1,
                 int* top5) {
    std::vector<int> y(labels, labels + B);
    for (int& v : y) v = std::max(v, 0);  // padding rows: any class, they are not counted
    step_.after_update(gpu::stream());
    gpu::model_logits(m_, images, y.data(), B, bng, false);
    const int NC = m_.cfg.classes;
    std::vector<float> logits = step_.download(m_.logits.data(), static_cast<std::size_t>(B) * NC);
    std::vector<float> probs(logits.size());
    *top5 = sample::topk_hits(logits.data(), y.data(), valid, NC, 5);
    return sample::softmax_xent_forward(probs.data(), top1, logits.data(), y.data(), valid, NC, 0.0f);
  }

  gpu::model<T>& net() { return m_; }
  std::span<float> running() { return m_.running; }
  std::vector<float> params() { return step_.download(m_.params.data(), m_.L.total); }
  std::vector<float> momentum() { return step_.momentum(); }
  std::vector<float> residuals() { return step_.residuals(m_.grads.data()); }

  void restore(const checkpoint& c, int rank, int R, const std::string& path) {
    if (c.params.size() != m_.L.total || c.running.size() != m_.running.size() ||
        c.momentum.size() != step_.momentum_size())
      throw std::runtime_error(path + ": sizes do not match this model and optimizer");
    gpu::model_set_params(m_, c.params);
    m_.running = c.running;
    step_.set_momentum(c.momentum);
    if constexpr (has_residuals)
      step_.restore_residuals(m_.grads.data(),
                              sample::checkpoint_residuals(c.residuals, m_.L.total, rank, R, path));
  }

 private:
  gpu::model<T> m_;
  sample::gpu::device_bucketed_step<DeviceGroup, Topo, Codec, Opt> step_;  // after m_: waits before m_ goes
};

// One replica of a run on a GPU, the policies and precision named by the flags: its pipelines, the
// host group `host` for batch norm, validation and checkpoints, the device group `dg` for gradients.
template <class HostGroup, class DeviceGroup>
void train_dispatch_cuda(HostGroup& host, DeviceGroup& dg, const options& o, run_result& result) {
  sample::check_same_flags(host, flag_fingerprints(o));  // before any collective that depends on them
  const int rank = host.rank(), R = host.size();
  sample::image_pipeline train(pipeline_options(o, true, rank, R));
  std::unique_ptr<sample::image_pipeline> val;
  if (!o.synthetic && std::filesystem::exists(o.data + "/val"))
    val = std::make_unique<sample::image_pipeline>(pipeline_options(o, false, rank, R));
  else if (!o.synthetic) no_val_folder(o.data, o.evaluate, rank == 0 && !o.quiet);
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
