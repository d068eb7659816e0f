// samples/common/replica.hpp: what the sample trainers' CPU replicas share of a training step: the
// OpenMP threads of a replica, and lockstep's bucketed fused step over a flat parameter block
// (optim::begin_step): each bucket's all-reduce starts the moment backward reports it written,
// with the update of its tensors (SGD or LARS, and the bf16 copy when there is one) as its
// epilogue; and the error-feedback residuals the codec keeps per bucket, for checkpoints.
//
//   sample::bucketed_step<Group, Topo, Codec, Opt> sync(world, topo, codec, opt, tensors, buckets);
//   sync.run(params, grads, {}, lr, [&](auto ready) { model_backward(m, bng, ready); });
//
// The collective averages (averaging::in_collective): the arithmetic of all_reduce(average)
// followed by optim::update with grad_scale 1, so the trainers' checkpoints are bit for bit those
// of the per-step all-reduce they had before the fused step.
// Limits: one flat block; backward must report every bucket, in the same order on every replica.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim/bucket.hpp>
#include <lockstep/optim/param_set.hpp>
#include <lockstep/optim/plan.hpp>
#include <lockstep/optim/state.hpp>
#include <lockstep/optim/step.hpp>

namespace sample {

// --threads T per replica; 0: the hardware threads shared out over the replicas of this process.
inline void set_replica_threads(int threads, int replicas) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  omp_set_num_threads(threads > 0 ? threads : std::max(1, hw / std::max(1, replicas)));
}

template <class Group, class Topo, class Codec, class Opt>
class bucketed_step {
 public:
  static constexpr bool has_residuals = lockstep::codec::feedback_codec<Codec>;

  // tensors: the block's tensors (offset, size, plain); buckets: [first, last) element ranges, in
  // the index order backward reports them by.
  bucketed_step(Group& world, Topo topo, Codec& codec, Opt opt, std::vector<lockstep::optim::tensor_desc> tensors,
                const std::vector<std::pair<std::size_t, std::size_t>>& buckets)
      : world_(world), topo_(topo), codec_(codec), opt_(opt), ps_(std::move(tensors)), st_(ps_, opt_) {
    for (auto [first, last] : buckets) buckets_.push_back({first, last});
  }

  // One step: backward(ready) computes every gradient into `grads`, calling ready(k) the moment
  // bucket k is final; returns when every bucket is reduced and applied to `weights` (and
  // `weights_bf16` unless empty).
  template <class Backward>
  void run(std::span<float> weights, std::span<float> grads, std::span<std::uint16_t> weights_bf16, float lr,
           Backward&& backward) {
    const lockstep::optim::plan<Opt> p{.opt = opt_, .params = ps_, .st = st_, .weights = weights, .grads = grads,
                                       .weights_bf16 = weights_bf16,
                                       .average = lockstep::optim::averaging::in_collective};
    auto s = lockstep::optim::begin_step(world_, topo_, codec_, p, buckets_, lr);
    backward([&](int k) { s.bucket_ready(static_cast<std::size_t>(k)); });
    s.wait();
  }

  std::span<float> momentum() { return st_.momentum(); }
  std::vector<float> momentum_copy() const { return {st_.momentum().begin(), st_.momentum().end()}; }

  // This replica's error-feedback residuals, bucket by bucket in the codec's checkpoint form
  // (empty without error feedback); `grads` names the buckets' element ranges.
  std::vector<float> residuals(std::span<const float> grads) {
    std::vector<float> mine;
    if constexpr (has_residuals) {
      mine.resize(Codec::state_floats(grads.size()));
      float* out = mine.data();
      for (const auto& b : buckets_) {
        codec_.save(grads.subspan(b.first, b.last - b.first), out, world_.space());
        out += Codec::state_floats(b.last - b.first);
      }
    }
    return mine;
  }

  // The inverse of residuals(): r points at this replica's share of a checkpoint's residuals.
  void restore_residuals(std::span<const float> grads, const float* r) {
    if constexpr (has_residuals) {
      for (const auto& b : buckets_) {
        codec_.load(grads.subspan(b.first, b.last - b.first), r, world_.space());
        r += Codec::state_floats(b.last - b.first);
      }
    }
  }

 private:
  Group& world_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  lockstep::optim::param_set ps_;
  lockstep::optim::state st_;
  std::vector<lockstep::optim::bucket> buckets_;  // (bucket): the element ranges, in backward's index order
};

}  // namespace sample
