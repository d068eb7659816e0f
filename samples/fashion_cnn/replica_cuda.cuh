// samples/fashion_cnn/replica_cuda.cuh: one replica of lockstep-train-fashion on a GPU: the cuDNN
// model (model_cuda.cuh), its gradients averaged and applied by lockstep's bucketed fused step
// (optim::begin_step with a device::plan). The loop that drives it is trainer.hpp's train_replica.
//
// Two streams per replica, as in PyTorch's DDP: the model computes on its own stream (cuda_ctx());
// the device group communicates on its stream. The moment backward has enqueued a bucket's
// gradients, an event orders the group's stream after them and the bucket's all-reduce, whose
// epilogue enqueues the update, is enqueued there, so it runs while the model stream computes the
// blocks before it. The next forward waits for the updates (an event), not the host. Batch-norm statistics and the test sums go through the host group, as on the CPU.
// Limits: replicas as threads on one GPU (inproc_device), or one replica per MPI process and GPU
// (NCCL, train_fashion_cuda.cu); checkpoints at epoch ends only, as on the CPU.
#pragma once

#include <span>
#include <string>
#include <vector>

#include <lockstep/device/space.hpp>
#include <lockstep/device/optim.hpp>
#include <lockstep/device/step.hpp>
#include <lockstep/optim/step.hpp>
#include <lockstep/transport/inproc_device.hpp>

#include "model_cuda.cuh"
#include "replica_hybrid_cuda.cuh"
#include "trainer.hpp"

namespace fashion {

template <class DeviceGroup, class Topo, class Codec, class Opt>
class gpu_replica {
 public:
  static constexpr bool has_residuals = lockstep::codec::feedback_codec<Codec>;

  gpu_replica(DeviceGroup& dg, const options& o, Topo topo, Codec& codec, Opt opt)
      : dg_(dg),
        topo_(topo),
        codec_(codec),
        opt_(opt),
        m_(gpu::model_create(model_config(o), o.seed)),
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

  // The model's buffers are freed in order on the compute stream, but the group's stream (the
  // update, the collectives) and, on inproc_device, peers' streams may still use them: wait for
  // both streams first. Best effort: this also runs while an exception unwinds.
  ~gpu_replica() {
    const cudaStream_t compute = gpu::cuda_ctx().stream;
    cudaStreamWaitEvent(compute, updated_.get(), 0);
    cudaStreamSynchronize(dg_.stream());
    cudaStreamSynchronize(compute);
  }

  float train_step(const sample::batch& b, int B, const bn_group& bng, float lr) {
    const cudaStream_t compute = gpu::cuda_ctx().stream, comm = dg_.stream();
    after_update(compute);  // the forward reads the parameters the last update wrote
    const float loss = gpu::model_forward(m_, b.images.data(), b.labels.data(), B, bng, true);
    // Gradient sync and update, the one call site: each bucket is averaged over all replicas and
    // applied as soon as backward has written it (its all-reduce waits for the gradients' event).
    const lockstep::device::plan<Opt> p{.opt = opt_, .table = table_, .weights = {m_.params.data(), m_.L.total},
                                        .grads = {m_.grads.data(), m_.L.total},
                                        .momentum = v_.size() ? v_.data() : nullptr,
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

  float evaluate(const float* images, const int* labels, int n, const bn_group& bng, int* correct) {
    after_update(gpu::cuda_ctx().stream);
    return gpu::model_forward(m_, images, labels, n, bng, false, correct);
  }

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
    check_checkpoint_sizes(c, m_.L.total, m_.running.size(), v_.size(), path);
    gpu::model_set_params(m_, c.params);
    m_.running = c.running;
    const cudaStream_t comm = dg_.stream();
    if (v_.size())
      LOCKSTEP_SAMPLE_CHECK(
          cudaMemcpyAsync(v_.data(), c.momentum.data(), v_.size() * sizeof(float), cudaMemcpyHostToDevice, comm));
    if constexpr (has_residuals) {
      const float* r = checkpoint_residuals(c, m_.L.total, rank, R, path);
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
    const cudaStream_t s = gpu::cuda_ctx().stream;
    after_update(s);
    if (n) LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
    return h;
  }

  DeviceGroup& dg_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  gpu::model m_;
  lockstep::optim::param_set ps_;
  lockstep::device::param_table table_;
  gpu::dbuf<float> v_;  // momentum, on the device
  std::vector<lockstep::optim::bucket> buckets_;  // (bucket) the model's, in the order backward writes them
  std::vector<lockstep::device::event> ready_;  // per bucket: its gradients are written
  lockstep::device::event updated_;             // the last update is done
};

// One replica of a run on a GPU, the policies named by the flags: host group `host` for batch norm
// and the test sums, device group `dg` for the gradients (and, with --parallel hybrid-a|b|c, the
// split layers' activations: replica_hybrid_cuda.cuh).
template <class HostGroup, class DeviceGroup>
void train_dispatch_cuda(HostGroup& host, DeviceGroup& dg, const options& o, const shared_data& data,
                         run_result& result) {
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
