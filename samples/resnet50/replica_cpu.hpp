// samples/resnet50/replica_cpu.hpp: one replica of lockstep-train-resnet50 on the CPU: the oneDNN
// model (model.hpp), its gradients averaged and applied by lockstep's bucketed fused step
// (optim::begin_step), as the Fashion sample's replica_cpu.hpp does. The loop that drives it is
// trainer.hpp's train_replica.
//
// Per step: forward; backward, and the moment a bucket (the classifier, a bottleneck, the stem) is
// written its all-reduce starts with the update of that bucket's tensors as its epilogue, which
// also writes the bf16 copy the convolutions read under --precision bf16 (backward never reads a
// bucket's weights again once it is written); wait for the buckets (samples/common/replica.hpp,
// shared with the Fashion sample).
#pragma once

#include <dnnl.h>

#include <algorithm>
#include <span>
#include <vector>

#include "../common/replica.hpp"
#include "model.hpp"
#include "trainer.hpp"

namespace resnet {

// The ISA oneDNN dispatches to on this CPU (its kernels for bf16 need avx512_core_bf16 or amx to
// run natively; below that it emulates bf16 on AVX-512 or falls back to reference code).
inline const char* dnnl_isa_name() {
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx512_mic: return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    default: return "other";
  }
}

// T: float (--precision fp32) or bf16_t (--precision bf16).
template <class Group, class Topo, class Codec, class Opt, class T>
class cpu_replica {
 public:
  static constexpr bool has_residuals = sample::bucketed_step<Group, Topo, Codec, Opt>::has_residuals;

  cpu_replica(Group& world, const options& o, int classes, Topo topo, Codec& codec, Opt opt)
      : m_(model_create<T>(model_config(o, classes), o.seed)),
        sync_(world, topo, codec, opt, tensor_descs(m_.L), m_.L.buckets) {
    sample::set_replica_threads(o.threads, world.size());
  }

  float train_step(const float* images, const int* labels, int B, const bn_group& bng, float lr) {
    const float loss = model_forward(m_, images, labels, B, bng, true);
    std::span<std::uint16_t> bf;
    if constexpr (!std::is_same_v<T, float>) bf = m_.params_bf16;
    sync_.run(m_.params, m_.grads, bf, lr, [&](auto ready) { model_backward(m_, bng, ready); });
    return loss;
  }

  // Forward with the running statistics over a batch of B; loss and hits of its first `valid` rows.
  float evaluate(const float* images, const int* labels, int B, int valid, const bn_group& bng, int* top1, int* top5) {
    std::vector<int> y(labels, labels + B);
    for (int& v : y) v = std::max(v, 0);  // padding rows: any class, they are not counted
    model_forward(m_, images, y.data(), B, bng, false);
    *top5 = sample::topk_hits(m_.logits.data(), y.data(), valid, m_.cfg.classes, 5);
    return sample::softmax_xent_forward(m_.probs.data(), top1, m_.logits.data(), y.data(), valid, m_.cfg.classes, 0.0f);
  }

  model<T>& net() { return m_; }
  std::span<float> running() { return m_.running; }
  std::vector<float> params() const { return m_.params; }
  std::vector<float> momentum() const { return sync_.momentum_copy(); }
  std::vector<float> residuals() { return sync_.residuals(m_.grads); }

  void restore(const checkpoint& c, int rank, int R, const std::string& path) {
    if (c.params.size() != m_.params.size() || c.running.size() != m_.running.size() ||
        c.momentum.size() != sync_.momentum().size())
      throw std::runtime_error(path + ": sizes do not match this model and optimizer");
    m_.params = c.params;
    m_.running = c.running;
    model_sync_bf16(m_);
    std::copy(c.momentum.begin(), c.momentum.end(), sync_.momentum().begin());
    if constexpr (has_residuals)
      sync_.restore_residuals(m_.grads, sample::checkpoint_residuals(c.residuals, m_.params.size(), rank, R, path));
  }

 private:
  model<T> m_;
  sample::bucketed_step<Group, Topo, Codec, Opt> sync_;  // the buckets are m_.L.buckets, model_backward's indices
};

// One replica of a run on the CPU: its pipelines, and the policies and precision the flags name.
template <class Group>
void train_dispatch(Group& world, const options& o, run_result& result) {
  sample::check_same_flags(world, flag_fingerprints(o));  // before any collective that depends on them
  const int rank = world.rank(), R = world.size();
  sample::image_pipeline train(pipeline_options(o, true, rank, R));
  std::unique_ptr<sample::image_pipeline> val;
  if (!o.synthetic && std::filesystem::exists(o.data + "/val"))
    val = std::make_unique<sample::image_pipeline>(pipeline_options(o, false, rank, R));
  else if (!o.synthetic) no_val_folder(o.data, o.evaluate, rank == 0 && !o.quiet);
  const int classes = o.synthetic ? o.classes : train.classes();
  if (rank == 0 && !o.quiet)
    std::printf("%s: %d classes, %zu training images, %zu steps per epoch; oneDNN ISA %s\n",
                o.synthetic ? "synthetic data" : o.data.c_str(), classes, train.images(), train.steps_per_epoch(),
                dnnl_isa_name());
  sample::with_policies(o, [&](auto topo, auto& codec, auto opt) {
    auto go = [&](auto precision) {
      using T = decltype(precision);
      cpu_replica<Group, decltype(topo), std::remove_reference_t<decltype(codec)>, decltype(opt), T> rep(
          world, o, classes, topo, codec, opt);
      train_replica(world, o, train, val.get(), rep, result);
    };
    if (o.precision == "bf16") go(bf16_t{});
    else go(float{});
  });
}

// A whole run with o.ranks replicas as threads of this process.
inline run_result train_inproc(const options& o) {
  validate(o);
  std::filesystem::create_directories(o.out);
  run_result result;
  lockstep::run_inproc(o.ranks, [&](auto& g) { train_dispatch(g, o, result); });
  return result;
}

}  // namespace resnet
