// samples/fashion_cnn/replica_hybrid_cuda.cuh: one replica of lockstep-train-fashion-cuda in hybrid
// parallelism (--parallel hybrid-a|b|c, --fc H1,H2): replica_hybrid.hpp on a GPU. The conv blocks,
// fc2's bias and the classifier are data-parallel (lockstep's bucketed fused step with a
// device::plan over the prefix [0, dp_end), as replica_cuda.cuh over the whole block); fc1 and fc2
// are model-parallel (head_hybrid.hpp with gpu::backend): rank k holds its slices in device memory,
// computes their gradients over every rank's rows and updates them on the model's stream (below) —
// those weights are never all-reduced.
//
// Streams as in replica_cuda.cuh: the model and the split layers' products on the model's stream
// (cuda_ctx()), the collectives (buckets and the split layers' rounds) on the device group's.
// The slices' block, in device memory:
//   mp: w1_k (F, n_k) | b1_k (n_k) | w2_k (n_k, H2)     (n_k = chunk_range(H1, R, k))
// At each epoch end the slices (and their momentum) are all-gathered over the device group
// (all_gather_v, per-rank counts) into the whole model, so evaluation runs the whole head on this
// GPU and checkpoints hold the same model, in the same format, as a data-parallel run.
// Gradient scale: a slice's gradient sums every rank's rows of per-replica mean losses, so the
// update scales it by 1/R, which is what data-parallel averaging gives.
// The slices' update is optim::split_update's on the device (split_update_cuda.cuh): with LARS
// each trust ratio is the whole tensor's, from every rank's slices, so hybrid LARS trains the
// data-parallel LARS model here too.
// Limits: no error feedback.
#pragma once

#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <lockstep/device/optim.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/device/step.hpp>
#include <lockstep/optim/step.hpp>

#include "head_hybrid.hpp"
#include "model_cuda.cuh"
#include "split_update_cuda.cuh"
#include "trainer.hpp"

namespace fashion {

template <class DeviceGroup, class Topo, class Codec, class Opt>
class gpu_hybrid_replica {
 public:
  static constexpr bool has_residuals = false;

  gpu_hybrid_replica(DeviceGroup& dg, const options& o, Topo topo, Codec& codec, Opt opt)
      : dg_(dg), topo_(topo), codec_(codec), opt_(opt), m_(gpu::model_create(model_config(o), o.seed)),
        dp_ps_(dp_tensors(m_.L)), dp_table_(dp_ps_, dg.stream()),
        F_(static_cast<std::size_t>(m_.L.features)), H1_(static_cast<std::size_t>(m_.cfg.fc[0])),
        H2_(static_cast<std::size_t>(m_.cfg.fc[1])),
        c0_(lockstep::chunk_range(H1_, dg.size(), dg.rank()).first),
        n_(lockstep::chunk_range(H1_, dg.size(), dg.rank()).second - c0_),
        mp_ps_({{0, F_ * n_, false}, {F_ * n_, n_, true}, {F_ * n_ + n_, n_ * H2_, false}}),  // n_ >= 1: validate()
        mp_update_(dg, opt, mp_ps_) {
    const cudaStream_t comm = dg.stream();
    const auto R = static_cast<std::size_t>(dg.size());
    for (std::size_t r = 0; r < R; ++r) {
      const auto [lo, hi] = lockstep::chunk_range(H1_, R, r);
      first_.push_back(lo), cols_.push_back(hi - lo);
    }
    const bool mom = opt.uses_momentum();
    dp_v_ = gpu::dbuf<float>(mom ? m_.L.dp_end : 0, comm);
    mp_w_ = gpu::dbuf<float>(mp_ps_.size(), comm);
    mp_g_ = gpu::dbuf<float>(mp_ps_.size(), comm);
    mp_v_ = gpu::dbuf<float>(mom ? mp_ps_.size() : 0, comm);
    whole_v_ = gpu::dbuf<float>(mom ? m_.L.total : 0, comm);
    packed_ = gpu::dbuf<float>(F_ * H1_, comm);
    zero(dp_v_), zero(mp_v_), zero(whole_v_);
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(gpu::cuda_ctx().stream));  // model_create's copies
    extract(m_.params.data(), mp_w_.data(), comm);
    for (std::size_t b = 0; b <= static_cast<std::size_t>(nblocks); ++b)  // the blocks and the head bucket
      dp_buckets_.push_back({m_.L.buckets[b].first, m_.L.buckets[b].second});
    ready_ = std::vector<lockstep::device::event>(dp_buckets_.size());
    head_ = make_hybrid_head<gpu::backend>(dg, o.parallel, o.activation_codec, o.codec_block, F_, H1_, H2_);
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(comm));
  }
  gpu_hybrid_replica(const gpu_hybrid_replica&) = delete;
  gpu_hybrid_replica& operator=(const gpu_hybrid_replica&) = delete;

  // As gpu_replica's: both streams drained before the buffers go. Best effort while unwinding.
  ~gpu_hybrid_replica() {
    const cudaStream_t compute = gpu::cuda_ctx().stream;
    cudaStreamWaitEvent(compute, updated_.get(), 0);
    cudaStreamSynchronize(dg_.stream());
    cudaStreamSynchronize(compute);
  }

  float train_step(const sample::batch& b, int B, const bn_group& bng, float lr) {
    const cudaStream_t compute = gpu::cuda_ctx().stream, comm = dg_.stream();
    after_update(compute);  // the forward reads the parameters the last update wrote
    const float* features = gpu::model_forward_features(m_, b.images.data(), b.labels.data(), B, bng, true);
    head_->forward(m_, features, w1(), b1(), w2());
    const float loss = gpu::model_loss(m_, true);

    const std::size_t dp_end = m_.L.dp_end;
    const lockstep::device::plan<Opt> p{.opt = opt_, .table = dp_table_, .weights = {m_.params.data(), dp_end},
                                        .grads = {m_.grads.data(), dp_end},
                                        .momentum = dp_v_.size() ? dp_v_.data() : nullptr,
                                        .average = lockstep::optim::averaging::in_collective};
    auto s = lockstep::optim::begin_step(dg_, topo_, codec_, p, dp_buckets_, lr);
    auto ready = [&](std::size_t k) {  // bucket k's gradients are enqueued on the model's stream
      ready_[k].record(compute);
      LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(comm, ready_[k].get(), 0));
      s.bucket_ready(k);
    };
    float* dlogits = m_.dact_b.data();
    gpu::softmax_xent_backward(dlogits, m_.probs.data(), m_.labels.data(), B, m_.cfg.classes, m_.cfg.label_smoothing);
    head_->backward(m_, dlogits, w1(), w2(), mp_g_.data(), mp_g_.data() + F_ * n_, mp_g_.data() + F_ * n_ + n_,
                    [&] { ready(static_cast<std::size_t>(nblocks)); });
    gpu::model_backward_features(m_, m_.d_features.data(), bng, [&](int k) { ready(static_cast<std::size_t>(k)); });
    // This rank's slices, on the model's stream after their gradients (the split layers' backward
    // leaves them complete in its order); the next forward reads them there. With LARS the norms'
    // all-gather follows the buckets already posted on the group's stream.
    lockstep::request norms = mp_update_(lr, 1.0f / static_cast<float>(dg_.size()), mp_w_.data(), mp_g_.data(),
                                         mp_v_.size() ? mp_v_.data() : nullptr, compute);
    s.wait();  // errors and timeouts of this step surface here
    norms.wait();
    updated_.record(comm);
    return loss;
  }

  // Every replica's slices into the whole model (and the momentum), for evaluation and checkpoints.
  void end_epoch() {
    const cudaStream_t compute = gpu::cuda_ctx().stream, comm = dg_.stream();
    sliced_.record(compute);  // the slices' last update
    LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(comm, sliced_.get(), 0));
    gather(mp_w_.data(), m_.params.data());
    if (whole_v_.size()) {
      LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(whole_v_.data(), dp_v_.data(), m_.L.dp_end * sizeof(float),
                                            cudaMemcpyDeviceToDevice, comm));
      gather(mp_v_.data(), whole_v_.data());
    }
    updated_.record(comm);  // evaluation and params() wait for the gathered model
  }

  float evaluate(const float* images, const int* labels, int n, const bn_group& bng, int* correct) {
    after_update(gpu::cuda_ctx().stream);
    return gpu::model_forward(m_, images, labels, n, bng, false, correct);  // the whole head, gathered by end_epoch
  }

  std::span<float> running() { return m_.running; }
  std::vector<float> params() { return download(m_.params.data(), m_.L.total); }
  std::vector<float> momentum() { return download(whole_v_.data(), whole_v_.size()); }
  std::vector<float> residuals() { return {}; }

  void restore(const checkpoint& c, int, int, const std::string& path) {
    check_checkpoint_sizes(c, m_.L.total, m_.running.size(), whole_v_.size(), path);
    const cudaStream_t comm = dg_.stream();
    gpu::model_set_params(m_, c.params);  // synchronous
    m_.running = c.running;
    extract(m_.params.data(), mp_w_.data(), comm);
    if (whole_v_.size()) {
      LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(whole_v_.data(), c.momentum.data(), whole_v_.size() * sizeof(float),
                                            cudaMemcpyHostToDevice, comm));
      LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(dp_v_.data(), whole_v_.data(), m_.L.dp_end * sizeof(float),
                                            cudaMemcpyDeviceToDevice, comm));
      extract(whole_v_.data(), mp_v_.data(), comm);
    }
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(comm));
  }

 private:
  // The data-parallel tensors: everything before dp_end.
  static std::vector<lockstep::optim::tensor_desc> dp_tensors(const layout& L) {
    std::vector<lockstep::optim::tensor_desc> t;
    for (const auto& ti : L.tensors)
      if (ti.offset < L.dp_end) t.push_back({ti.offset, ti.size, ti.plain});
    return t;
  }


  float* w1() { return mp_w_.data(); }
  float* b1() { return mp_w_.data() + F_ * n_; }
  float* w2() { return mp_w_.data() + F_ * n_ + n_; }
  std::size_t at(const char* name) const { return tensor_named(m_.L, name).offset; }

  void zero(gpu::dbuf<float>& b) {
    if (b.size()) LOCKSTEP_SAMPLE_CHECK(cudaMemsetAsync(b.data(), 0, b.size() * sizeof(float), dg_.stream()));
  }
  void after_update(cudaStream_t s) { LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(s, updated_.get(), 0)); }

  std::vector<float> download(const float* d, std::size_t n) {
    std::vector<float> h(n);
    const cudaStream_t s = gpu::cuda_ctx().stream;
    after_update(s);
    if (n) LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(s));
    return h;
  }

  // This rank's slices out of a whole-model block (weights or momentum, same layout), on s: fc1.w's
  // columns [c0, c0 + n) are a pitched copy, fc1.b's and fc2.w's rows contiguous.
  void extract(const float* whole, float* mp, cudaStream_t s) const {
    constexpr std::size_t f = sizeof(float);
    LOCKSTEP_SAMPLE_CHECK(cudaMemcpy2DAsync(mp, n_ * f, whole + at("fc1.w") + c0_, H1_ * f, n_ * f, F_,
                                            cudaMemcpyDeviceToDevice, s));
    LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(mp + F_ * n_, whole + at("fc1.b") + c0_, n_ * f, cudaMemcpyDeviceToDevice, s));
    LOCKSTEP_SAMPLE_CHECK(cudaMemcpyAsync(mp + F_ * n_ + n_, whole + at("fc2.w") + c0_ * H2_, n_ * H2_ * f,
                                          cudaMemcpyDeviceToDevice, s));
  }

  // Every rank's slices (mp, device) into a whole-model block (device), over the device group, on
  // its stream: b1 and w2 slices are contiguous there and are gathered in place; w1's columns are
  // gathered packed (rank by rank, each (F, n_r)), then put in their columns by pitched copies.
  void gather(const float* mp, float* whole) {
    const std::size_t R = cols_.size();
    constexpr std::size_t f = sizeof(float);
    const cudaStream_t comm = dg_.stream();
    lockstep::codec::fp32 c32;
    auto counts = [&](std::size_t per_col) {
      std::vector<std::size_t> v(R);
      for (std::size_t r = 0; r < R; ++r) v[r] = cols_[r] * per_col;
      return v;
    };
    const auto c_w1 = counts(F_), c_b1 = counts(1), c_w2 = counts(H2_);
    lockstep::all_gather_v(dg_, std::span<const float>(mp, F_ * n_), std::span<float>(packed_.data(), F_ * H1_),
                           std::span<const std::size_t>(c_w1), lockstep::topology::ring{}, c32);
    const float* from = packed_.data();
    for (std::size_t r = 0; r < R; ++r) {
      LOCKSTEP_SAMPLE_CHECK(cudaMemcpy2DAsync(whole + at("fc1.w") + first_[r], H1_ * f, from, cols_[r] * f,
                                              cols_[r] * f, F_, cudaMemcpyDeviceToDevice, comm));
      from += F_ * cols_[r];
    }
    lockstep::all_gather_v(dg_, std::span<const float>(mp + F_ * n_, n_), std::span<float>(whole + at("fc1.b"), H1_),
                           std::span<const std::size_t>(c_b1), lockstep::topology::ring{}, c32);
    lockstep::all_gather_v(dg_, std::span<const float>(mp + F_ * n_ + n_, n_ * H2_),
                           std::span<float>(whole + at("fc2.w"), H1_ * H2_), std::span<const std::size_t>(c_w2),
                           lockstep::topology::ring{}, c32);
  }

  DeviceGroup& dg_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  gpu::model m_;
  lockstep::optim::param_set dp_ps_;
  lockstep::device::param_table dp_table_;
  std::size_t F_, H1_, H2_, c0_, n_;  // n_ of H1's columns from c0_ are this rank's
  lockstep::optim::param_set mp_ps_;
  gpu::split_update<DeviceGroup, Opt> mp_update_;  // the slices' optimizer step (split_update_cuda.cuh)
  gpu::dbuf<float> dp_v_;              // (dp_end): the data-parallel tensors' momentum
  gpu::dbuf<float> mp_w_, mp_g_, mp_v_;  // this rank's slices, their gradients and momentum (layout above)
  gpu::dbuf<float> whole_v_;           // (L.total): the whole model's momentum, as of end_epoch
  gpu::dbuf<float> packed_;            // (F * H1): fc1.w's slices, rank by rank, during a gather
  std::vector<lockstep::optim::bucket> dp_buckets_;  // (bucket): the blocks, then the head
  std::vector<std::size_t> first_, cols_;          // (rank): each rank's share of H1
  std::vector<lockstep::device::event> ready_;     // per data-parallel bucket: its gradients are written
  lockstep::device::event updated_;                // the last update (or gather) on the group's stream is done
  lockstep::device::event sliced_;                 // the slices' last update on the model's stream
  std::unique_ptr<hybrid_head_base<gpu::backend>> head_;
};

}  // namespace fashion
