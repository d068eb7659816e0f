// samples/fashion_cnn/replica_cpu.hpp: one replica of lockstep-train-fashion on the CPU: the
// oneDNN model (model.hpp), its gradients averaged and applied by lockstep's bucketed fused step
// (optim::begin_step). The loop that drives it is trainer.hpp's train_replica.
//
// Per step: forward; backward, and the moment a bucket of gradients (one per block) is written,
// its all-reduce starts with the update of that bucket's tensors (SGD or LARS) as its epilogue, so
// the classifier's gradients travel and its weights are updated while the convolutions' gradients
// are computed (backward never reads a block's weights again once its bucket is written); wait for
// the buckets. The collective averages (averaging::in_collective), which is the arithmetic of
// all_reduce(average) followed by optim::update with grad_scale 1, so checkpoints are bit for bit
// those of the trainer before the fused step. The step itself is samples/common/replica.hpp's,
// shared with the ResNet-50 sample.
#pragma once

#include <algorithm>
#include <span>
#include <vector>

#include "../common/replica.hpp"
#include "model.hpp"
#include "replica_hybrid.hpp"
#include "trainer.hpp"

namespace fashion {

template <class Group, class Topo, class Codec, class Opt>
class cpu_replica {
 public:
  static constexpr bool has_residuals = sample::bucketed_step<Group, Topo, Codec, Opt>::has_residuals;

  cpu_replica(Group& world, const options& o, Topo topo, Codec& codec, Opt opt)
      : m_(model_create(model_config(o), o.seed)), sync_(world, topo, codec, opt, tensor_descs(m_.L), m_.L.buckets) {
    sample::set_replica_threads(o.threads, world.size());
  }

  float train_step(const sample::batch& b, int B, const bn_group& bng, float lr) {
    const float loss = model_forward(m_, b.images.data(), b.labels.data(), B, bng, true);
    // Gradient sync and update, the one call site: each bucket is averaged over all replicas and
    // applied as soon as backward has written it.
    sync_.run(m_.params, m_.grads, {}, lr, [&](auto ready) { model_backward(m_, bng, ready); });
    return loss;
  }

  float evaluate(const float* images, const int* labels, int n, const bn_group& bng, int* correct) {
    return model_forward(m_, images, labels, n, bng, false, correct);
  }

  std::span<float> running() { return m_.running; }
  std::vector<float> params() const { return m_.params; }
  std::vector<float> momentum() const { return sync_.momentum_copy(); }
  std::vector<float> residuals() { return sync_.residuals(m_.grads); }

  void restore(const checkpoint& c, int rank, int R, const std::string& path) {
    check_checkpoint_sizes(c, m_.params.size(), m_.running.size(), sync_.momentum().size(), path);
    m_.params = c.params;
    m_.running = c.running;
    std::copy(c.momentum.begin(), c.momentum.end(), sync_.momentum().begin());
    if constexpr (has_residuals)
      sync_.restore_residuals(m_.grads, checkpoint_residuals(c, m_.params.size(), rank, R, path));
  }

 private:
  model m_;
  sample::bucketed_step<Group, Topo, Codec, Opt> sync_;  // the buckets are m_.L.buckets, model_backward's indices
};

// One replica of a run on the CPU, the policies named by the flags.
template <class Group>
void train_dispatch(Group& world, const options& o, const shared_data& data, run_result& result) {
  sample::check_same_flags(world, flag_fingerprints(o));
  with_policies(o, [&](auto topo, auto& codec, auto opt) {
    using C = std::remove_reference_t<decltype(codec)>;
    if (o.parallel == "data") {
      cpu_replica<Group, decltype(topo), C, decltype(opt)> rep(world, o, topo, codec, opt);
      train_replica(world, o, data, rep, result);
    } else {
      hybrid_replica<Group, decltype(topo), C, decltype(opt)> rep(world, o, topo, codec, opt);
      train_replica(world, o, data, rep, result);
    }
  });
}

// A whole run with o.ranks replicas as threads of this process.
inline run_result train_inproc(const options& o) {
  validate(o);
  std::filesystem::create_directories(o.out);
  const shared_data data = load_data(o);
  run_result result;
  lockstep::run_inproc(o.ranks, [&](auto& g) { train_dispatch(g, o, data, result); });
  return result;
}

}  // namespace fashion
