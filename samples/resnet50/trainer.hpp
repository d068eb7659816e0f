// samples/resnet50/trainer.hpp: synchronous data-parallel training of ResNet-50 over lockstep, the
// recipe of Ying et al. 2018 at the scale of this machine; what lockstep-train-resnet50 runs, kept
// in headers so the tests can run it too.
//
// Purpose: every system of the paper, on the work its users do. Each replica (a thread, or an MPI
// process) runs the same loop:
//   batch <- its shard of the step's global batch (samples/common/image_folder.hpp: JPEG folder,
//            fused decode-and-crop, cache, prefetch; or --synthetic)
//   forward, batch-norm statistics over its group of G replicas (all 53 batch norms)
//   backward; each bucket of gradients (the classifier, each bottleneck, the stem) starts its
//   all-reduce the moment it is written, with the update of its tensors (LARS or SGD, and the bf16
//   copy under --precision bf16) fused into the all-reduce as its epilogue (optim::begin_step)
// and after every epoch averages the batch-norm running statistics over all replicas, measures
// top-1 / top-5 on val/ (each replica its shard), and rank 0 writes the CSV row, the checkpoint
// (atomically) and the plot. The shared pieces (flags, checkpoint files, metrics, policies, BN
// groups) are samples/common's, as the Fashion sample uses them.
// Limits: checkpoints at epoch ends only (--stop-after ends an invocation there); --steps ends a
// run early without one (the throughput benchmark). With --synthetic there is no validation
// (the CSV's val columns are nan).
#pragma once

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim/param_set.hpp>
#include <lockstep/optim/schedule.hpp>

#include "../common/checkpoint.hpp"
#include "../common/image_folder.hpp"
#include "../common/loop.hpp"
#include "../common/metrics.hpp"
#include "model_layout.hpp"

namespace resnet {

// Every flag of lockstep-train-resnet50 (see usage() in flags.hpp for their meaning).
struct options {
  std::string data;  // ImageNet-layout folder; empty with --synthetic
  std::string out = "resnet50-out";
  bool synthetic = false;
  int classes = 1000;  // --synthetic only; a folder's classes come from train/
  long long synthetic_images = 1281167;
  int size = 224;
  int epochs = 90;
  int batch = 32;  // global: ranks x per-replica batch
  int ranks = 1;
  int threads = 0;  // oneDNN / OpenMP threads per replica; 0: hardware threads / replicas
  int decode_threads = 1;
  bool cache = false;
  bool skip_bad = false;
  double crop_scale = 0.08;  // smallest area of RandomResizedCrop's training crop, as a fraction of the image
  double crop_pct = 0.875;   // validation's centre crop: this share of the shorter side (not a training flag)
  bool evaluate = false;     // validate OUT/checkpoint.bin and stop
  std::string precision = "fp32";  // fp32 | bf16
  std::string recipe = "none";     // none | mlperf
  std::string topology = "ring";
  std::string codec = "fp32";
  std::size_t codec_block = 256;
  bool error_feedback = false;
  std::string optimizer = "sgd";  // sgd | lars
  double lr = 0;                  // peak; 0: the optimizer's (or recipe's) default
  double warmup_epochs = 5;
  double end_lr = 1e-4;
  double power = 2.0;
  float momentum = 0.9f;
  float weight_decay = 1e-4f;
  float lars_trust = 0.001f;
  float label_smoothing = 0.1f;
  int bn_group = 1;
  bool zero_init_residual = false;
  std::uint64_t seed = 1;
  bool resume = false;
  long long steps = 0;  // stop after N steps of this run (0: all)
  int stop_after = 0;   // end this invocation after N epochs, checkpoint written
  long long val_limit = 0;  // evaluate on the first N val images only (0: all)
  int val_every = 1;        // validate after every N-th epoch and after the last
  int print_every = 10;
  bool quiet = false;
};

// --recipe mlperf: the MLPerf ResNet-50 reference's LARS (trust 0.001, eps 0, momentum 0.9, weight
// decay 2e-4 from the rules' set 1e-4 * 2^k, batch norm and biases exempt from both), linear warmup
// then polynomial decay of power 2 to 1e-4, label smoothing 0.1, and the base rate by global
// batch: < 16K -> 10, < 32K -> 25, >= 32K -> 31.2 with 25 warmup epochs (5 below 32K). Flags given
// after --recipe override it.
inline void apply_mlperf_recipe(options& o) {
  o.recipe = "mlperf";
  o.optimizer = "lars";
  o.lars_trust = 0.001f;
  o.momentum = 0.9f;
  o.weight_decay = 2e-4f;
  o.end_lr = 1e-4;
  o.power = 2.0;
  o.label_smoothing = 0.1f;
  o.warmup_epochs = o.batch >= 32768 ? 25 : 5;
}
inline double mlperf_base_lr(int global_batch) {
  return global_batch < 16384 ? 10.0 : global_batch < 32768 ? 25.0 : 31.2;
}

// The peak learning rate: --lr, else the recipe's, else SGD's linear scaling rule (0.1 per 256
// images, Goyal et al. 2017) or LARS' 10 per the MLPerf table.
inline double peak_lr(const options& o) {
  if (o.lr > 0) return o.lr;
  // The recipe sets LARS; an --optimizer sgd after it keeps SGD's rule (10 would diverge at once).
  if (o.optimizer == "lars") return mlperf_base_lr(o.batch);
  return 0.1 * o.batch / 256.0;
}

inline config model_config(const options& o, int classes) {
  config cfg;
  cfg.classes = classes;
  cfg.size = o.size;
  cfg.zero_init_residual = o.zero_init_residual;
  cfg.label_smoothing = o.label_smoothing;
  return cfg;
}

inline std::vector<lockstep::optim::tensor_desc> tensor_descs(const layout& L) {
  std::vector<lockstep::optim::tensor_desc> tensors;
  for (const auto& t : L.tensors) tensors.push_back({t.offset, t.size, t.plain});
  return tensors;
}

// What a run measured; rank 0's view.
struct epoch_record {
  int epoch;
  long long step;
  double seconds, images_per_s, lr, train_loss, val_loss, top1, top5;
};
struct run_result {
  std::vector<epoch_record> epochs;
  std::string checkpoint, csv, plot;
  double images_per_s = 0;  // of the steps after the first of this invocation
  long long steps = 0;
  float last_loss = 0;
  bool evaluated = false;  // --evaluate: epochs holds the checkpoint's validation only
};

// ----------------------------------------------------------------------------------------------
// Checkpoints: samples/common/checkpoint.hpp's file (written atomically, CRC-32 at its end), format
// "LSRN5002"; "LSRN5001" (the same without the CRC) still loads. Model words: head[6] classes,
// head[7] --size, head[9] precision (0 fp32, 1 bf16); head[8] the residuals' size.
// The same file for every backend. residuals: error-feedback state of every replica (rank by rank,
// per bucket in layout order), empty without --error-feedback.

inline const sample::checkpoint_format checkpoint_format{"LSRN5002", "LSRN5001", "a lockstep ResNet-50 checkpoint", 8, nullptr, nullptr};

inline std::uint64_t options_fingerprint(const options& o) {
  std::ostringstream s;
  s << o.batch << ' ' << o.ranks << ' ' << o.topology << ' ' << o.codec << ' ' << o.codec_block << ' '
    << o.error_feedback << ' ' << o.optimizer << ' ' << peak_lr(o) << ' ' << o.warmup_epochs << ' ' << o.end_lr << ' '
    << o.power << ' ' << o.momentum << ' ' << o.weight_decay << ' ' << o.lars_trust << ' ' << o.label_smoothing << ' '
    << o.bn_group << ' ' << o.epochs << ' ' << o.size << ' ' << o.precision << ' ' << o.zero_init_residual << ' '
    << o.synthetic << ' ' << o.synthetic_images;
  if (o.crop_scale != 0.08) s << ' ' << o.crop_scale;  // added later: the default keeps older fingerprints
  return sample::fingerprint(s.str());
}

using checkpoint = sample::checkpoint;

// What every rank must agree on before the run (sample::check_same_flags), each named in the error.
inline std::vector<std::pair<std::string, std::uint64_t>> flag_fingerprints(const options& o) {
  auto fp = [](const std::string& s) { return sample::fingerprint(s); };
  return {{"--seed", fp(std::to_string(o.seed))},
          {"--classes", fp(o.synthetic ? std::to_string(o.classes) : std::string())},
          {"training flags (batch, size, precision, bn-group, topology, codec, optimizer, schedule, ...)",
           options_fingerprint(o)}};
}

inline void save_checkpoint(const std::string& path, const options& o, int classes, const checkpoint& c) {
  const sample::checkpoint_head model{0, 0, 0, 0, 0, 0, static_cast<std::uint32_t>(classes), static_cast<std::uint32_t>(o.size), 0,
                                      o.precision == "bf16" ? 1u : 0u};
  sample::write_checkpoint(path, checkpoint_format, model, o.seed, options_fingerprint(o), c);
}

// The checkpoint at `path`, checked against this run's flags; a file of the previous format is
// said so on `log` (when not null).
inline checkpoint load_checkpoint(const std::string& path, const options& o, int classes, std::FILE* log = nullptr) {
  sample::checkpoint_file f = sample::read_checkpoint(path, checkpoint_format, log);
  if (f.head[6] != static_cast<std::uint32_t>(classes) || f.head[7] != static_cast<std::uint32_t>(o.size))
    throw std::runtime_error(path + ": written for " + std::to_string(f.head[6]) + " classes at --size " +
                             std::to_string(f.head[7]) + ", this run has " + std::to_string(classes) + " at " +
                             std::to_string(o.size));
  if (f.seed != o.seed || f.fingerprint != options_fingerprint(o))
    throw std::runtime_error(path + ": written with other training flags (seed, batch, ranks, precision, codec, "
                                    "optimizer, schedule, epochs ...); resume with the flags of the original run");
  return std::move(f.data);
}

inline void write_plot(const std::string& dir, bool run_gnuplot) {
  sample::write_plot(dir,
                     {{"loss", "epoch", {{"1:6", "train"}, {"1:7", "val"}}},
                      {"val accuracy (%)", "epoch", {{"1:(100*$8)", "top-1"}, {"1:(100*$9)", "top-5"}}}},
                     run_gnuplot);
}

// ----------------------------------------------------------------------------------------------
// One replica's training loop, for every backend. A Replica holds the model, the gradient
// synchronisation and the optimizer state of one replica (replica_cpu.hpp, replica_cuda.cuh). It provides
//   float train_step(const float* images, const int* labels, int B, const bn_group&, float lr)
//   float evaluate(const float* images, const int* labels, int B, int valid, const bn_group&, int* top1, int* top5)
//   std::span<float> running(); std::vector<float> params(), momentum(), residuals()
//   void restore(const checkpoint&, int rank, int R, const std::string& path)
//   static constexpr bool has_residuals

inline sample::image_pipeline_options pipeline_options(const options& o, bool train, int rank, int R) {
  sample::image_pipeline_options p;
  p.dir = o.data;
  p.train = train;
  p.size = o.size;
  p.batch = o.batch / R;
  p.rank = rank;
  p.replicas = R;
  p.seed = o.seed;
  p.cache = o.cache;
  p.threads = o.decode_threads;
  p.skip_bad = o.skip_bad;
  p.scale_min = o.crop_scale;
  p.crop_pct = o.crop_pct;
  p.synthetic = o.synthetic;
  p.synthetic_classes = o.classes;
  p.synthetic_images = static_cast<std::size_t>(o.synthetic_images);
  return p;
}

// DATA has train/ but no val/: --evaluate has nothing to read; training goes on without
// validation, said once, so that a misnamed folder (valid/) is not read as "nan%" epochs.
inline void no_val_folder(const std::string& data, bool evaluate, bool say) {
  if (evaluate) throw sample::data_error(data + "/val: missing; --evaluate validates the checkpoint on it");
  if (say) std::printf("%s/val: missing, so no validation (its columns read nan)\n", data.c_str());
}

template <class Group, class Replica>
void train_replica(Group& world, const options& o, sample::image_pipeline& train, sample::image_pipeline* val,
                   Replica& rep, run_result& result) {
  const int rank = world.rank(), R = world.size(), B = o.batch / R;
  const bool leader = rank == 0;
  const int classes = o.synthetic ? o.classes : train.classes();
  const sample::replica_bn_group<Group> bn(world, o.bn_group);
  const sample::bn_group& bng = bn.bn;

  const int steps_per_epoch = static_cast<int>(train.steps_per_epoch());
  const long long total_steps = static_cast<long long>(steps_per_epoch) * o.epochs;
  const lockstep::optim::warmup_poly schedule{peak_lr(o), o.warmup_epochs * steps_per_epoch,
                                              static_cast<double>(total_steps), o.end_lr, o.power};

  const std::string ckpt_path = o.out + "/checkpoint.bin", csv_path = o.out + "/metrics.csv";
  int first_epoch = 0;
  long long step = 0;
  if (o.resume || o.evaluate) {
    const checkpoint c = load_checkpoint(ckpt_path, o, classes, leader ? stderr : nullptr);
    sample::check_progress(ckpt_path, c, o.epochs, steps_per_epoch);
    rep.restore(c, rank, R, ckpt_path);
    first_epoch = c.epochs_done;
    step = c.global_step;
    if (leader && !o.quiet && !o.evaluate) std::printf("resuming %s after epoch %d (step %lld)\n", ckpt_path.c_str(), first_epoch, step);
  } else if (leader) {
    sample::csv_start(csv_path, "epoch,step,images,seconds,lr,train_loss,val_loss,top1,top5,images_per_s");
  }
  if (leader) result.checkpoint = ckpt_path, result.csv = csv_path, result.plot = o.out + "/metrics.png";

  std::vector<float> images(static_cast<std::size_t>(B) * 3 * o.size * o.size);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(B));
  sample::progress_meter progress(total_steps, static_cast<long long>(first_epoch) * steps_per_epoch, o.batch);
  using clock = std::chrono::steady_clock;
  clock::time_point t_bench{};
  long long bench_steps = 0;
  const long long first_step = step;

  // Adds this replica's shard of val/ to sums (top-1 hits, top-5 hits, loss sum, images).
  auto validate_shard = [&](float* sums) {
    val->start_epoch(0);
    long long seen = 0;
    while (val->next(images.data(), labels.data())) {
      int valid = 0;
      while (valid < B && labels[static_cast<std::size_t>(valid)] >= 0) ++valid;
      if (o.val_limit > 0) valid = static_cast<int>(std::min<long long>(valid, std::max(0LL, o.val_limit / R - seen)));
      if (valid == 0) continue;
      int t1 = 0, t5 = 0;
      sums[2] += rep.evaluate(images.data(), labels.data(), B, valid, bng, &t1, &t5) * valid;
      sums[0] += static_cast<float>(t1), sums[1] += static_cast<float>(t5), sums[3] += static_cast<float>(valid);
      seen += valid;
    }
  };

  if (o.evaluate) {  // --evaluate: the checkpoint's model on val/, nothing trained or written
    float sums[5] = {0, 0, 0, 0, 0};
    validate_shard(sums);
    lockstep::all_reduce(world, std::span<float>(sums, 5));
    if (leader) {
      const double n = sums[3] > 0 ? sums[3] : NAN;
      result.evaluated = true;
      result.epochs.push_back({first_epoch, step, 0, 0, schedule(static_cast<double>(step)), NAN, sums[2] / n,
                               sums[0] / n, sums[1] / n});
      if (!o.quiet)
        std::printf("evaluated %s (after epoch %d) on %.0f val images, crop-pct %g: top-1 %.2f%%  top-5 %.2f%%  "
                    "loss %.4f\n",
                    ckpt_path.c_str(), first_epoch, sums[3], o.crop_pct, 100.0 * sums[0] / n, 100.0 * sums[1] / n,
                    sums[2] / n);
    }
    return;
  }

  const int last_epoch = o.stop_after > 0 ? std::min(o.epochs, first_epoch + o.stop_after) : o.epochs;
  for (int epoch = first_epoch; epoch < last_epoch; ++epoch) {
    const auto t_epoch = clock::now();
    double loss_sum = 0;
    int done = 0;
    bool stop = false;
    train.start_epoch(epoch);
    for (int s = 0; s < steps_per_epoch; ++s, ++step) {
      if (!train.next(images.data(), labels.data()))
        throw std::runtime_error("the input pipeline ended epoch " + std::to_string(epoch) + " early");
      const float lr = static_cast<float>(schedule(static_cast<double>(step)));
      const float loss = rep.train_step(images.data(), labels.data(), B, bng, lr);
      if (!std::isfinite(loss))
        throw std::runtime_error("rank " + std::to_string(rank) + ": the loss is " + std::to_string(loss) +
                                 " at step " + std::to_string(step) + " (learning rate too high?)");
      loss_sum += loss, ++done;
      result.last_loss = loss;
      if (step == first_step) t_bench = clock::now();  // the first step builds the primitives: not timed
      else ++bench_steps;
      progress.add(loss);
      if (leader && !o.quiet && (progress.window() == o.print_every || s + 1 == steps_per_epoch))
        progress.print(epoch + 1, o.epochs, s + 1, steps_per_epoch, step, lr);
      if (o.steps > 0 && step + 1 - first_step >= o.steps) {
        stop = true;
        ++step;
        break;
      }
    }
    const double bench_s = std::chrono::duration<double>(clock::now() - t_bench).count();
    if (bench_steps > 0) result.images_per_s = static_cast<double>(bench_steps) * o.batch / bench_s;
    result.steps = step - first_step;
    if (stop) {
      if (leader && !o.quiet)
        std::printf("%lld steps: %.2f images/s (global batch %d, steps after the first)\n", result.steps,
                    result.images_per_s, o.batch);
      break;
    }
    const double epoch_s = std::chrono::duration<double>(clock::now() - t_epoch).count();

    // Every replica ends the epoch with the same model: the running statistics of different BN
    // groups differ, so average them (parameters are already equal).
    lockstep::all_reduce(world, rep.running(), lockstep::reduce_op::average);

    // Validation: each replica its shard of val/ (padding entries have label -1).
    float sums[5] = {0, 0, 0, 0, static_cast<float>(loss_sum)};  // top1, top5, val loss sum, images, train loss sum
    if (val && ((epoch + 1) % o.val_every == 0 || epoch + 1 == o.epochs)) validate_shard(sums);
    lockstep::all_reduce(world, std::span<float>(sums, 5));

    std::vector<float> residuals;
    if constexpr (Replica::has_residuals) {
      const std::vector<float> mine = rep.residuals();
      residuals = sample::gather_all(world, std::span<const float>(mine));
    }
    if (leader) {
      const double n = sums[3] > 0 ? sums[3] : NAN;
      epoch_record rec{epoch + 1, step, progress.seconds(), done * static_cast<double>(o.batch) / epoch_s,
                       schedule(static_cast<double>(step)), sums[4] / (static_cast<double>(R) * done), sums[2] / n,
                       sums[0] / n, sums[1] / n};
      result.epochs.push_back(rec);
      sample::csv_row(csv_path, rec.epoch, rec.step, rec.step * o.batch, rec.seconds, rec.lr, rec.train_loss,
                      rec.val_loss, rec.top1, rec.top5, rec.images_per_s);
      const std::span<float> run = rep.running();
      checkpoint c{epoch + 1, step, rep.params(), std::vector<float>(run.begin(), run.end()), rep.momentum(),
                   std::move(residuals)};
      save_checkpoint(ckpt_path, o, classes, c);
      if (!o.quiet) {
        std::printf("epoch %d: val top-1 %.2f%%  top-5 %.2f%%  val loss %.4f  train loss %.4f  %.1f img/s  (%.0f s)\n",
                    rec.epoch, 100.0 * rec.top1, 100.0 * rec.top5, rec.val_loss, rec.train_loss, rec.images_per_s,
                    rec.seconds);
        if (sums[3] > 0 && !std::isfinite(rec.val_loss))
          std::printf("note: the val loss is not finite: the model overflows with batch norm's running statistics "
                      "(tiny batches per batch-norm group make them lag weights that batch statistics kept in range)\n");
        write_plot(o.out, true);
      }
    }
    lockstep::barrier(world);  // nobody starts the next epoch while rank 0 may still be writing
  }
}

// Checks the flags that a replica cannot check alone; throws naming the flag.
inline void validate(const options& o) {
  auto bad = [](const std::string& s) { throw std::invalid_argument(s); };
  sample::validate_parallel_flags(o);
  if (o.data.empty() && !o.synthetic) bad("--data DIR or --synthetic is needed");
  if (o.precision != "fp32" && o.precision != "bf16") bad("--precision must be fp32 or bf16");
  // torchvision's resnet50 takes any side. At 16 the last two stages already see 1x1 maps; a smaller
  // side takes the stages before them down to 1x1 too, which is no longer a ResNet at work.
  if (o.size < 16) bad("--size must be at least 16");
  // Batch statistics need two values per channel: the last stage's maps are 1x1 up to --size 32,
  // so a batch-norm group of one image there normalises every value to beta and writes a running
  // variance of 0 (torch refuses it: "Expected more than 1 value per channel when training").
  if (o.ranks >= 1 && o.batch >= o.ranks) {
    const int side = make_layout(config{.classes = 2, .size = o.size}).final_side;
    const long long values = static_cast<long long>(o.batch / o.ranks) * std::max(o.bn_group, 1) * side * side;
    if (values < 2)
      bad("--batch " + std::to_string(o.batch) + " over --ranks " + std::to_string(o.ranks) + " with --bn-group " +
          std::to_string(o.bn_group) + " at --size " + std::to_string(o.size) + " gives the last stage's batch norms " +
          std::to_string(values) + " value per channel (its maps are " + std::to_string(side) + "x" +
          std::to_string(side) + "): batch statistics need at least 2; raise --batch, --bn-group or --size");
  }
  if (o.epochs < 1) bad("--epochs must be at least 1");
  if (o.lr < 0) bad("--lr must be positive (0: the optimizer's default)");
  if (o.label_smoothing < 0 || o.label_smoothing >= 1) bad("--label-smoothing must be in [0, 1)");
  if (o.classes < 2) bad("--classes must be at least 2");
  if (!(o.crop_scale > 0 && o.crop_scale <= 1)) bad("--crop-scale must be in (0, 1]");
  if (!(o.crop_pct > 0 && o.crop_pct <= 1)) bad("--crop-pct must be in (0, 1]");
  if (o.evaluate && o.synthetic) bad("--evaluate needs --data (synthetic runs have no val/)");
  if (o.val_every < 1) bad("--val-every must be at least 1");
}

}  // namespace resnet
