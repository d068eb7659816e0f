// samples/fashion_cnn/replica_hybrid.hpp: one replica of lockstep-train-fashion in hybrid
// parallelism (--parallel hybrid-a|b|c, --fc H1,H2): the conv blocks, fc2's bias and the classifier
// data-parallel (their gradients averaged by lockstep's bucketed fused step, as in replica_cpu.hpp),
// fc1 and fc2 model-parallel (head_hybrid.hpp): rank k holds only its slices of them, computes their
// gradients over every rank's rows, and updates them locally — those weights are never all-reduced.
//
// The whole model keeps the layout of model_layout.hpp: the split tensors (fc1.w, fc1.b, fc2.w) lie
// after dp_end, so the data-parallel step runs over the prefix [0, dp_end) of the flat block, and
// the slices live in a small block of their own:
//   mp: w1_k (F, n_k) | b1_k (n_k) | w2_k (n_k, H2)     (n_k = chunk_range(H1, R, k))
// At each epoch end (end_epoch) the slices are all-gathered (all_gather_v, per-rank counts) into
// the whole model, so evaluation runs the whole head locally and checkpoints hold the same model,
// in the same format, as a data-parallel run: a hybrid run resumes as data-parallel and back.
// Gradient scale: a slice's gradient sums every rank's rows of per-replica mean losses, so the
// update scales it by 1/R, which is what data-parallel averaging gives.
// The slices' update is optim::split_update: with LARS, each trust ratio is the whole tensor's
// (the ranks' sums of squares all-gathered and added in rank order, the same bits on every rank),
// so hybrid LARS trains the data-parallel LARS model.
// Limits: no error feedback. replica_hybrid_cuda.cuh is this replica on a GPU (the same head
// orchestration, head_hybrid.hpp, with gpu::backend).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include <lockstep/optim/bucket.hpp>
#include <lockstep/optim/plan.hpp>
#include <lockstep/optim/split_update.hpp>
#include <lockstep/optim/step.hpp>

#include "../common/replica.hpp"
#include "head_hybrid.hpp"
#include "model.hpp"
#include "trainer.hpp"

namespace fashion {

template <class Group, class Topo, class Codec, class Opt>
class hybrid_replica {
 public:
  static constexpr bool has_residuals = false;

  hybrid_replica(Group& world, const options& o, Topo topo, Codec& codec, Opt opt)
      : world_(world), topo_(topo), codec_(codec), opt_(opt), m_(model_create(model_config(o), o.seed)),
        dp_ps_(dp_tensors(m_.L)), dp_st_(dp_ps_, opt_),
        F_(static_cast<std::size_t>(m_.L.features)), H1_(static_cast<std::size_t>(m_.cfg.fc[0])),
        H2_(static_cast<std::size_t>(m_.cfg.fc[1])),
        c0_(lockstep::chunk_range(H1_, world.size(), world.rank()).first),
        n_(lockstep::chunk_range(H1_, world.size(), world.rank()).second - c0_),
        mp_ps_({{0, F_ * n_, false}, {F_ * n_, n_, true}, {F_ * n_ + n_, n_ * H2_, false}}),  // n_ >= 1: validate()
        mp_st_(mp_ps_, opt_) {
    const auto R = static_cast<std::size_t>(world.size());
    for (std::size_t r = 0; r < R; ++r) {
      const auto [lo, hi] = lockstep::chunk_range(H1_, R, r);
      first_.push_back(lo), cols_.push_back(hi - lo);
    }
    mp_w_.assign(mp_ps_.size(), 0.0f);
    mp_g_.assign(mp_ps_.size(), 0.0f);
    extract(m_.params.data(), mp_w_.data());
    for (std::size_t b = 0; b <= static_cast<std::size_t>(nblocks); ++b)  // the blocks and the head bucket
      dp_buckets_.push_back({m_.L.buckets[b].first, m_.L.buckets[b].second});
    head_ = make_hybrid_head<cpu_backend>(world, o.parallel, o.activation_codec, o.codec_block, F_, H1_, H2_);
    sample::set_replica_threads(o.threads, world.size());
  }

  float train_step(const sample::batch& b, int B, const bn_group& bng, float lr) {
    const float* features = model_forward_features(m_, b.images.data(), b.labels.data(), B, bng, true);
    head_->forward(m_, features, w1(), b1(), w2());
    const float loss = model_loss(m_, true);

    const std::size_t dp_end = m_.L.dp_end;
    const lockstep::optim::plan<Opt> p{.opt = opt_, .params = dp_ps_, .st = dp_st_,
                                       .weights = std::span<float>(m_.params.data(), dp_end),
                                       .grads = std::span<float>(m_.grads.data(), dp_end),
                                       .average = lockstep::optim::averaging::in_collective};
    auto s = lockstep::optim::begin_step(world_, topo_, codec_, p, dp_buckets_, lr);
    float* dlogits = m_.dact_b.data();
    softmax_xent_backward(dlogits, m_.probs.data(), m_.labels.data(), B, m_.cfg.classes, m_.cfg.label_smoothing);
    head_->backward(m_, dlogits, w1(), w2(), mp_g_.data(), mp_g_.data() + F_ * n_, mp_g_.data() + F_ * n_ + n_,
                    [&] { s.bucket_ready(static_cast<std::size_t>(nblocks)); });
    model_backward_features(m_, m_.d_features.data(), bng, [&](int k) { s.bucket_ready(static_cast<std::size_t>(k)); });
    // This rank's slices: updated here, while the blocks' buckets may still travel (with LARS, the
    // slices' norms are all-gathered behind the buckets already posted).
    lockstep::optim::split_update(world_, opt_, mp_ps_, std::span<float>(mp_w_), std::span<const float>(mp_g_), mp_st_,
                                  {.lr = lr, .grad_scale = 1.0f / static_cast<float>(world_.size())});
    s.wait();
    return loss;
  }

  // Every replica's slices into the whole model (and the momentum), for evaluation and checkpoints.
  void end_epoch() {
    gather(mp_w_.data(), m_.params.data());
    momentum_.assign(m_.L.total, 0.0f);
    if (!dp_st_.momentum().empty()) {
      std::copy(dp_st_.momentum().begin(), dp_st_.momentum().end(), momentum_.begin());
      gather(mp_st_.momentum().data(), momentum_.data());
    } else {
      momentum_.clear();
    }
  }

  float evaluate(const float* images, const int* labels, int n, const bn_group& bng, int* correct) {
    return model_forward(m_, images, labels, n, bng, false, correct);  // the whole head, gathered by end_epoch
  }

  std::span<float> running() { return m_.running; }
  std::vector<float> params() const { return m_.params; }
  std::vector<float> momentum() const { return momentum_; }
  std::vector<float> residuals() { return {}; }

  void restore(const checkpoint& c, int, int, const std::string& path) {
    const std::size_t mom = dp_st_.momentum().empty() ? 0 : m_.L.total;
    check_checkpoint_sizes(c, m_.params.size(), m_.running.size(), mom, path);
    m_.params = c.params;
    m_.running = c.running;
    extract(m_.params.data(), mp_w_.data());
    if (mom) {
      std::copy(c.momentum.begin(), c.momentum.begin() + static_cast<std::ptrdiff_t>(m_.L.dp_end), dp_st_.momentum().begin());
      extract(c.momentum.data(), mp_st_.momentum().data());
    }
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

  // This rank's slices out of a whole-model block (weights or momentum, same layout).
  void extract(const float* whole, float* mp) const {
    const float* W1 = whole + tensor_named(m_.L, "fc1.w").offset;
    const float* b1 = whole + tensor_named(m_.L, "fc1.b").offset;
    const float* W2 = whole + tensor_named(m_.L, "fc2.w").offset;
    for (std::size_t f = 0; f < F_; ++f)
      for (std::size_t j = 0; j < n_; ++j) mp[f * n_ + j] = W1[f * H1_ + c0_ + j];
    std::copy(b1 + c0_, b1 + c0_ + n_, mp + F_ * n_);
    std::copy(W2 + c0_ * H2_, W2 + (c0_ + n_) * H2_, mp + F_ * n_ + n_);
  }

  // Every rank's slices into a whole-model block: b1 and w2 slices are contiguous there and are
  // gathered in place; w1's columns are gathered packed, then put in their columns.
  void gather(const float* mp, float* whole) {
    const std::size_t R = cols_.size();
    lockstep::codec::fp32 c32;
    auto counts = [&](std::size_t per_col) {
      std::vector<std::size_t> v(R);
      for (std::size_t r = 0; r < R; ++r) v[r] = cols_[r] * per_col;
      return v;
    };
    const auto c_w1 = counts(F_), c_b1 = counts(1), c_w2 = counts(H2_);
    std::vector<float> packed(F_ * H1_);
    lockstep::all_gather_v(world_, std::span<const float>(mp, F_ * n_), std::span<float>(packed),
                           std::span<const std::size_t>(c_w1), lockstep::topology::ring{}, c32);
    float* W1 = whole + tensor_named(m_.L, "fc1.w").offset;
    const float* at = packed.data();
    for (std::size_t r = 0; r < R; ++r) {
      for (std::size_t f = 0; f < F_; ++f)
        for (std::size_t j = 0; j < cols_[r]; ++j) W1[f * H1_ + first_[r] + j] = at[f * cols_[r] + j];
      at += F_ * cols_[r];
    }
    lockstep::all_gather_v(world_, std::span<const float>(mp + F_ * n_, n_),
                           std::span<float>(whole + tensor_named(m_.L, "fc1.b").offset, H1_), std::span<const std::size_t>(c_b1),
                           lockstep::topology::ring{}, c32);
    lockstep::all_gather_v(world_, std::span<const float>(mp + F_ * n_ + n_, n_ * H2_),
                           std::span<float>(whole + tensor_named(m_.L, "fc2.w").offset, H1_ * H2_),
                           std::span<const std::size_t>(c_w2), lockstep::topology::ring{}, c32);
  }

  Group& world_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  model m_;
  lockstep::optim::param_set dp_ps_;
  lockstep::optim::state dp_st_;
  std::size_t F_, H1_, H2_, c0_, n_;  // n_ of H1's columns from c0_ are this rank's
  lockstep::optim::param_set mp_ps_;
  lockstep::optim::state mp_st_;
  std::vector<lockstep::optim::bucket> dp_buckets_;  // (bucket): the blocks, then the head
  std::vector<std::size_t> first_, cols_;  // (rank): each rank's share of H1
  std::vector<float> mp_w_, mp_g_;  // this rank's slices and their gradients (layout above)
  std::vector<float> momentum_;     // the whole model's momentum, as of end_epoch
  std::unique_ptr<hybrid_head_base<cpu_backend>> head_;
};

}  // namespace fashion
