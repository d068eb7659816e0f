// samples/fashion_cnn/replica_cpu.hpp: one replica of lockstep-train-fashion on the CPU: the
// oneDNN model (model.hpp), its gradients averaged by lockstep's host collectives, and the update
// by optim::update. The loop that drives it is trainer.hpp's train_replica.
//
// Per step: forward; backward, and the moment a bucket of gradients (one per block) is written,
// its all_reduce_async starts, so the classifier's gradients travel while the convolutions' are
// computed; wait for the buckets; one optim::update pass (SGD or LARS) over the whole block.
#pragma once

#include <omp.h>

#include <algorithm>
#include <span>
#include <thread>
#include <vector>

#include "model.hpp"
#include "trainer.hpp"

namespace fashion {

template <class Group, class Topo, class Codec, class Opt>
class cpu_replica {
 public:
  static constexpr bool has_residuals = lockstep::codec::feedback_codec<Codec>;

  cpu_replica(Group& world, const options& o, Topo topo, Codec& codec, Opt opt)
      : world_(world),
        topo_(topo),
        codec_(codec),
        opt_(opt),
        m_(model_create(model_config(o), o.seed)),
        ps_(tensor_descs(m_.L)),
        st_(ps_, opt_),
        pending_(m_.L.buckets.size()) {
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    omp_set_num_threads(o.threads > 0 ? o.threads : std::max(1, hw / world.size()));
  }

  float train_step(const sample::batch& b, int B, const bn_group& bng, float lr) {
    const float loss = model_forward(m_, b.images.data(), b.labels.data(), B, bng, true);
    // Gradient sync, the one call site: each bucket is averaged over all replicas as soon as
    // backward has written it; the update waits for all of them.
    model_backward(m_, bng, [&](int k) {
      auto [first, last] = m_.L.buckets[static_cast<std::size_t>(k)];
      pending_[static_cast<std::size_t>(k)] = lockstep::all_reduce_async(
          world_, std::span<float>(m_.grads.data() + first, last - first), topo_, codec_, lockstep::reduce_op::average);
    });
    for (auto& r : pending_) r.wait();
    lockstep::optim::update(opt_, ps_, m_.params, m_.grads, st_, lockstep::optim::step_context{lr, 1.0f});
    return loss;
  }

  float evaluate(const float* images, const int* labels, int n, const bn_group& bng, int* correct) {
    return model_forward(m_, images, labels, n, bng, false, correct);
  }

  std::span<float> running() { return m_.running; }
  std::vector<float> params() const { return m_.params; }
  std::vector<float> momentum() const { return {st_.momentum().begin(), st_.momentum().end()}; }

  // Per bucket, the codec's own checkpoint share of its error-feedback residuals.
  std::vector<float> residuals() {
    std::vector<float> mine;
    if constexpr (has_residuals) {
      mine.resize(Codec::state_floats(m_.params.size()));
      float* out = mine.data();
      for (auto [first, last] : m_.L.buckets) {
        codec_.save(std::span<const float>(m_.grads.data() + first, last - first), out, world_.space());
        out += Codec::state_floats(last - first);
      }
    }
    return mine;
  }

  void restore(const checkpoint& c, int rank, int R, const std::string& path) {
    check_checkpoint_sizes(c, m_.params.size(), m_.running.size(), st_.momentum().size(), path);
    m_.params = c.params;
    m_.running = c.running;
    std::copy(c.momentum.begin(), c.momentum.end(), st_.momentum().begin());
    if constexpr (has_residuals) {
      const float* r = checkpoint_residuals(c, m_.params.size(), rank, R, path);
      for (auto [first, last] : m_.L.buckets) {
        codec_.load(std::span<const float>(m_.grads.data() + first, last - first), r, world_.space());
        r += Codec::state_floats(last - first);
      }
    }
  }

 private:
  Group& world_;
  Topo topo_;
  Codec& codec_;
  Opt opt_;
  model m_;
  lockstep::optim::param_set ps_;
  lockstep::optim::state st_;
  std::vector<lockstep::request> pending_;
};

// One replica of a run on the CPU, the policies named by the flags.
template <class Group>
void train_dispatch(Group& world, const options& o, const shared_data& data, run_result& result) {
  with_policies(o, [&](auto topo, auto& codec, auto opt) {
    cpu_replica<Group, decltype(topo), std::remove_reference_t<decltype(codec)>, decltype(opt)> rep(world, o, topo,
                                                                                                  codec, opt);
    train_replica(world, o, data, rep, result);
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
