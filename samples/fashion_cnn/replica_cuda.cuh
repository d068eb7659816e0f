// samples/fashion_cnn/replica_cuda.cuh: one replica of lockstep-train-fashion on a GPU: the cuDNN
// model (model_cuda.cuh), its gradients averaged and applied by lockstep's bucketed fused step
// (optim::begin_step with a device::plan: samples/common/replica_cuda.cuh, shared with the ResNet-50
// sample). The loop that drives it is trainer.hpp's train_replica.
//
// Two streams per replica, as in PyTorch's DDP: the moment backward has enqueued a bucket's
// gradients, the bucket's all-reduce, whose epilogue enqueues the update, is enqueued on the device
// group's stream, so it runs while the model stream computes the blocks before it. The next
// forward waits for the updates (an event), not the host. Batch-norm statistics and the test sums
// go through the host group, as on the CPU.
// Limits: replicas as threads on one GPU (inproc_device), or one replica per MPI process and GPU
// (NCCL, train_fashion_cuda.cu); checkpoints at epoch ends only, as on the CPU.
#pragma once

#include <span>
#include <string>
#include <vector>

#include <lockstep/transport/inproc_device.hpp>

#include "../common/replica_cuda.cuh"
#include "model_cuda.cuh"
#include "replica_hybrid_cuda.cuh"
#include "trainer.hpp"

namespace fashion {

template <class DeviceGroup, class Topo, class Codec, class Opt>
class gpu_replica {
 public:
  static constexpr bool has_residuals = lockstep::codec::feedback_codec<Codec>;

  gpu_replica(DeviceGroup& dg, const options& o, Topo topo, Codec& codec, Opt opt)
      : m_(gpu::model_create(model_config(o), o.seed)),
        step_(dg, topo, codec, opt, tensor_descs(m_.L), m_.L.buckets, m_.L.total) {}

  float train_step(const sample::batch& b, int B, const bn_group& bng, float lr) {
    step_.after_update(gpu::cuda_ctx().stream);  // the forward reads the parameters the last update wrote
    const float loss = gpu::model_forward(m_, b.images.data(), b.labels.data(), B, bng, true);
    step_.run({m_.params.data(), m_.L.total}, {m_.grads.data(), m_.L.total}, nullptr, lr,
              [&](auto ready) { gpu::model_backward(m_, bng, ready); });
    return loss;
  }

  float evaluate(const float* images, const int* labels, int n, const bn_group& bng, int* correct) {
    step_.after_update(gpu::cuda_ctx().stream);
    return gpu::model_forward(m_, images, labels, n, bng, false, correct);
  }

  std::span<float> running() { return m_.running; }
  std::vector<float> params() { return step_.download(m_.params.data(), m_.L.total); }
  std::vector<float> momentum() { return step_.momentum(); }
  std::vector<float> residuals() { return step_.residuals(m_.grads.data()); }

  void restore(const checkpoint& c, int rank, int R, const std::string& path) {
    check_checkpoint_sizes(c, m_.L.total, m_.running.size(), step_.momentum_size(), path);
    gpu::model_set_params(m_, c.params);
    m_.running = c.running;
    step_.set_momentum(c.momentum);
    if constexpr (has_residuals)
      step_.restore_residuals(m_.grads.data(), checkpoint_residuals(c, m_.L.total, rank, R, path));
  }

 private:
  gpu::model m_;
  sample::gpu::device_bucketed_step<DeviceGroup, Topo, Codec, Opt> step_;  // after m_: waits before m_ goes
};

// One replica of a run on a GPU, the policies named by the flags: host group `host` for batch norm
// and the test sums, device group `dg` for the gradients (and, with --parallel hybrid-a|b|c, the
// split layers' activations: replica_hybrid_cuda.cuh).
template <class HostGroup, class DeviceGroup>
void train_dispatch_cuda(HostGroup& host, DeviceGroup& dg, const options& o, const shared_data& data,
                         run_result& result) {
  sample::check_same_flags(host, flag_fingerprints(o));  // over the host group: it has headers
  with_policies(o, [&](auto topo, auto& codec, auto opt) {
    using C = std::remove_reference_t<decltype(codec)>;
    auto run = [&](auto& rep) {
      try {
        train_replica(host, o, data, rep, result);
      } catch (const std::exception& e) {
        // Before the replica's buffers go: the peers may be waiting on the device transport (or
        // reading this replica's memory), which the host group's abort does not reach.
        dg.transport().abort(std::string("replica ") + std::to_string(host.rank()) + " failed: " + e.what());
        throw;
      }
    };
    if (o.parallel == "data") {
      gpu_replica<DeviceGroup, decltype(topo), C, decltype(opt)> rep(dg, o, topo, codec, opt);
      run(rep);
    } else {
      gpu_hybrid_replica<DeviceGroup, decltype(topo), C, decltype(opt)> rep(dg, o, topo, codec, opt);
      run(rep);
    }
  });
}

// A whole run with o.ranks replicas as threads of this process, all on the current GPU: a host
// group per replica for batch norm and the test sums, a device group (inproc_device) for the
// gradients. A failing replica aborts both worlds, so the others leave their waits at once.
// The host world's abort comes from run_inproc, the device world's from train_dispatch_cuda.
inline run_result train_inproc_cuda(const options& o) {
  validate(o);
  std::filesystem::create_directories(o.out);
  const shared_data data = load_data(o);
  run_result result;
  auto device_world = lockstep::transport::inproc_device::make_world(o.ranks);
  int dev = 0;
  LOCKSTEP_SAMPLE_CHECK(cudaGetDevice(&dev));
  lockstep::run_inproc(o.ranks, [&](auto& host) {
    LOCKSTEP_SAMPLE_CHECK(cudaSetDevice(dev));
    lockstep::device::stream comm;  // before the group: the group frees its scratch on it
    lockstep::group<lockstep::transport::inproc_device> dg(
        lockstep::transport::inproc_device(device_world, host.rank(), comm.get()));
    train_dispatch_cuda(host, dg, o, data, result);
  });
  return result;
}

}  // namespace fashion
