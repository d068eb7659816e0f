// samples/fashion_cnn/trainer.hpp: synchronous data-parallel training of the Fashion-MNIST CNN
// over lockstep: what lockstep-train-fashion and lockstep-train-fashion-cuda run, kept in headers
// so the tests can run it too.
//
// Purpose: show the library doing the work of a real trainer. Each replica (a thread, or an MPI
// process) runs the same loop:
//   batch <- its shard of the step's global batch (pipeline.hpp, prepared in the background)
//   forward, batch-norm statistics over its group of G replicas (a group made by split)
//   backward; each bucket of gradients (one per block) starts its all-reduce the moment it is
//   written, so the classifier's gradients travel while the convolutions' are computed
//   the update (SGD or LARS) with the warmup + polynomial-decay rate: on the CPU each bucket's,
//   as its all-reduce's epilogue (optim::begin_step); on the GPU once the buckets are done
// (the step itself is the backend's: replica_cpu.hpp on oneDNN, replica_cuda.cuh on cuDNN)
// and after every epoch averages the batch-norm running statistics over all replicas, measures
// test accuracy (each replica a slice of the test set), and rank 0 writes the CSV row, the
// checkpoint (atomically) and the plot.
// Limits: one process holds the whole data set (each replica thread shares it); checkpoints are
// taken at epoch ends only. With --error-feedback the checkpoint also holds every replica's
// quantisation residuals (gathered to rank 0), so --resume is bit-for-bit with it too.
#pragma once

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/param_set.hpp>
#include <lockstep/optim/schedule.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/state.hpp>
#include <lockstep/optim/update.hpp>

#include "../common/checkpoint.hpp"
#include "../common/idx.hpp"
#include "../common/loop.hpp"
#include "../common/metrics.hpp"
#include "../common/pipeline.hpp"
#include "model_layout.hpp"

namespace fashion {

// Every flag of lockstep-train-fashion (see usage() in train_fashion.cpp for their meaning).
struct options {
  std::string data = sample::default_fashion_mnist_dir;
  std::string out = "fashion-out";
  int epochs = 4;
  int batch = 256;  // global: ranks x per-replica batch
  int ranks = 1;
  int threads = 0;  // oneDNN threads per replica; 0: hardware threads / replicas
  std::string topology = "ring";  // ring | torus2d | torus2d:RxC
  std::string codec = "fp32";     // fp32 | bf16 | int8 | dyntree8
  std::size_t codec_block = 256;
  bool error_feedback = false;
  std::string optimizer = "sgd";  // sgd | lars
  double lr = 0;  // peak rate; 0: the optimizer's default (peak_lr)
  double warmup_epochs = 0.5;
  double end_lr = 1e-4;
  double power = 2.0;
  float momentum = 0.9f;
  float weight_decay = 5e-4f;
  float lars_trust = 0.02f;
  float label_smoothing = 0.1f;
  int bn_group = 1;
  std::array<int, nblocks> channels{32, 64, 128};
  std::array<int, 2> fc{0, 0};              // --fc H1,H2: the AlexNet-like head; 0,0: none
  std::string parallel = "data";            // data | hybrid-a | hybrid-b | hybrid-c (replica_hybrid.hpp)
  std::string activation_codec = "fp32";    // hybrid runs: activations on the wire
  std::uint64_t seed = 1;
  bool augment = true;
  bool resume = false;
  int train_limit = 0;  // use only the first N training / test images (0: all)
  int test_limit = 0;
  int print_every = 20;
  int stop_after = 0;   // end this invocation after N epochs, as if interrupted (0: run to --epochs)
  bool quiet = false;   // no progress lines, no plot (tests)
};

// The peak learning rate: --lr, or the optimizer's default. SGD's is 0.02: the classifier sees
// 2048 unnormalised features, so its logits move by about lr x 1000 x the logit gradient per step,
// and at 0.05 or 0.1 the loss climbs during warmup (measured: 2.3 -> 5.4 at 0.1 over 30 steps).
// LARS scales each tensor's step to its norm (trust 0.02), so 0.2 is the demo's rate.
inline double peak_lr(const options& o) {
  if (o.lr > 0) return o.lr;
  return o.optimizer == "lars" ? 0.2 : 0.02;
}

// What a run measured; rank 0's view, filled in at each epoch end.
struct epoch_record {
  int epoch;
  long long step;
  double seconds, images_per_s, lr, train_loss, test_loss, test_acc;
};
struct run_result {
  std::vector<epoch_record> epochs;
  std::string checkpoint, csv, plot;
};

// ----------------------------------------------------------------------------------------------
// Checkpoints: samples/common/checkpoint.hpp's file (written atomically, CRC-32 at its end), format
// "LSCKPT03"; "LSCKPT02" (the same without the CRC) still loads. Model words: head[6..8] channels,
// head[9] the residuals' size.
// residuals: error-feedback state, empty without --error-feedback; otherwise, rank by rank, for each
// gradient bucket in layout order, phase 0 (reduce-scatter sends) then phase 1 (all-gather encodes)
// of that bucket's elements: ranks x 2 x params floats.

inline const sample::checkpoint_format checkpoint_format{
    "LSCKPT03", "LSCKPT02", "a lockstep checkpoint", 9, "LSCKPT01",
    "checkpoint of an older lockstep-train-fashion (format 01); start a new run"};

inline std::uint64_t options_fingerprint(const options& o) {
  // The flags that change what a step computes; resuming under other values is refused.
  std::ostringstream s;
  s << o.batch << ' ' << o.ranks << ' ' << o.topology << ' ' << o.codec << ' ' << o.codec_block << ' '
    << o.error_feedback << ' ' << o.optimizer << ' ' << peak_lr(o) << ' ' << o.warmup_epochs << ' ' << o.end_lr << ' '
    << o.power << ' ' << o.momentum << ' ' << o.weight_decay << ' ' << o.lars_trust << ' ' << o.label_smoothing
    << ' ' << o.bn_group << ' ' << o.augment << ' ' << o.train_limit << ' ' << o.epochs;
  // The head's shape changes the model; --parallel and --activation-codec do not change its format,
  // so a hybrid run may resume as data-parallel and back.
  if (o.fc[0] > 0) s << " fc " << o.fc[0] << ',' << o.fc[1];
  return sample::fingerprint(s.str());
}

using checkpoint = sample::checkpoint;

// What every rank must agree on before the run (sample::check_same_flags): the flags that shape
// the model and the collectives, each named in the error.
inline std::vector<std::pair<std::string, std::uint64_t>> flag_fingerprints(const options& o) {
  auto fp = [](const std::string& s) { return sample::fingerprint(s); };
  return {{"--parallel", fp(o.parallel)},
          {"--activation-codec", fp(o.parallel == "data" ? "" : o.activation_codec)},  // data: none on the wire
          {"--fc", fp(std::to_string(o.fc[0]) + "," + std::to_string(o.fc[1]))},
          {"--channels", fp(std::to_string(o.channels[0]) + "," + std::to_string(o.channels[1]) + "," + std::to_string(o.channels[2]))},
          {"--seed", fp(std::to_string(o.seed))},
          {"training flags (batch, topology, codec, optimizer, schedule, epochs, ...)", options_fingerprint(o)}};
}

inline void save_checkpoint(const std::string& path, const options& o, const checkpoint& c) {
  const sample::checkpoint_head model{0, 0, 0, 0, 0, 0, static_cast<std::uint32_t>(o.channels[0]),
                                      static_cast<std::uint32_t>(o.channels[1]), static_cast<std::uint32_t>(o.channels[2]), 0};
  sample::write_checkpoint(path, checkpoint_format, model, o.seed, options_fingerprint(o), c);
}

// The checkpoint at `path`, checked against this run's flags; a file of the previous format is
// said so on `log` (when not null).
inline checkpoint load_checkpoint(const std::string& path, const options& o, std::FILE* log = nullptr) {
  sample::checkpoint_file f = sample::read_checkpoint(path, checkpoint_format, log);
  if (f.head[6] != static_cast<std::uint32_t>(o.channels[0]) || f.head[7] != static_cast<std::uint32_t>(o.channels[1]) ||
      f.head[8] != static_cast<std::uint32_t>(o.channels[2]))
    throw std::runtime_error(path + ": written for other --channels");
  if (f.seed != o.seed || f.fingerprint != options_fingerprint(o))
    throw std::runtime_error(path + ": written with other training flags (seed, batch, ranks, codec, optimizer, "
                                    "schedule, epochs ...); resume with the flags of the original run");
  return std::move(f.data);
}

// ----------------------------------------------------------------------------------------------
// Metrics: a CSV row per epoch and a gnuplot script that draws loss and accuracy from it.

inline void write_plot(const std::string& dir, bool run_gnuplot) {
  sample::write_plot(dir,
                     {{"loss", "epoch", {{"1:6", "train"}, {"1:7", "test"}}},
                      {"test accuracy (%)", "epoch", {{"1:(100*$8)", "test"}}}},
                     run_gnuplot);
}

// ----------------------------------------------------------------------------------------------
// One replica's training loop, written once for both backends. A Replica holds the model, the
// gradient synchronisation and the optimizer state of one replica: cpu_replica (replica_cpu.hpp,
// oneDNN, host collectives) or gpu_replica (replica_cuda.cuh, cuDNN, device collectives). It provides
//   float train_step(const sample::batch&, int B, const bn_group&, float lr)   forward, backward with
//         each bucket's gradients averaged over all replicas as soon as they are written, update;
//         returns this replica's mean loss
//   float evaluate(images, labels, n, const bn_group&, int* correct)           forward with running stats
//   std::span<float> running()                                                 BN running statistics (host)
//   std::vector<float> params(), momentum(), residuals()                       host copies for the checkpoint
//   void restore(const checkpoint&, int rank, int R, const std::string& path)  the inverse
//   static constexpr bool has_residuals                                        error feedback in use
// Group is the host group of the replicas: batch-norm groups, test sums and checkpoint gathers.

struct shared_data {
  sample::image_set train, test;
};

inline config model_config(const options& o) {
  config cfg;
  cfg.channels = o.channels;
  cfg.label_smoothing = o.label_smoothing;
  cfg.fc = o.fc;
  return cfg;
}

inline std::vector<lockstep::optim::tensor_desc> tensor_descs(const layout& L) {
  std::vector<lockstep::optim::tensor_desc> tensors;
  for (const auto& t : L.tensors) tensors.push_back({t.offset, t.size, t.plain});
  return tensors;
}

// A checkpoint's arrays against this replica's sizes; throws naming the file.
inline void check_checkpoint_sizes(const checkpoint& c, std::size_t params, std::size_t running, std::size_t momentum,
                                   const std::string& path) {
  if (c.params.size() != params || c.running.size() != running || c.momentum.size() != momentum)
    throw std::runtime_error(path + ": sizes do not match this model and optimizer");
}

// This rank's error-feedback residuals in a checkpoint (2 x params floats: per bucket, phase 0
// then phase 1), or a clear error when the checkpoint has none for this many replicas.
inline const float* checkpoint_residuals(const checkpoint& c, std::size_t params, int rank, int R,
                                         const std::string& path) {
  return sample::checkpoint_residuals(c.residuals, params, rank, R, path);
}

template <class Group, class Replica>
void train_replica(Group& world, const options& o, const shared_data& data, Replica& rep, run_result& result) {
  const int rank = world.rank(), R = world.size(), B = o.batch / R;
  const bool leader = rank == 0;

  // Batch-norm groups: consecutive ranks, G at a time.
  const sample::replica_bn_group<Group> bn(world, o.bn_group);
  const bn_group& bng = bn.bn;

  const int steps_per_epoch = data.train.n / o.batch;  // the last incomplete global batch is dropped
  const long long total_steps = static_cast<long long>(steps_per_epoch) * o.epochs;
  const lockstep::optim::warmup_poly schedule{peak_lr(o), o.warmup_epochs * steps_per_epoch,
                                              static_cast<double>(total_steps), o.end_lr, o.power};

  const std::string ckpt_path = o.out + "/checkpoint.bin", csv_path = o.out + "/metrics.csv";
  int first_epoch = 0;
  long long step = 0;
  if (o.resume) {
    const checkpoint c = load_checkpoint(ckpt_path, o, leader ? stderr : nullptr);
    sample::check_progress(ckpt_path, c, o.epochs, steps_per_epoch);
    rep.restore(c, rank, R, ckpt_path);
    first_epoch = c.epochs_done;
    step = c.global_step;
    if (leader && !o.quiet) std::printf("resuming %s after epoch %d (step %lld)\n", ckpt_path.c_str(), first_epoch, step);
  } else if (leader) {
    sample::csv_start(csv_path, "epoch,step,images,seconds,lr,train_loss,test_loss,test_acc,images_per_s");
  }
  if (leader) result.checkpoint = ckpt_path, result.csv = csv_path, result.plot = o.out + "/metrics.png";

  sample::batch_loader loader(data.train, B, rank, R, o.seed, {o.augment, 2, true}, first_epoch);
  using clock = std::chrono::steady_clock;
  sample::progress_meter progress(total_steps, static_cast<long long>(first_epoch) * steps_per_epoch, o.batch);

  const int last_epoch = o.stop_after > 0 ? std::min(o.epochs, first_epoch + o.stop_after) : o.epochs;
  for (int epoch = first_epoch; epoch < last_epoch; ++epoch) {
    const auto t_epoch = clock::now();
    double loss_sum = 0;
    for (int s = 0; s < steps_per_epoch; ++s, ++step) {
      const sample::batch& b = loader.next();
      const float lr = static_cast<float>(schedule(static_cast<double>(step)));
      const float loss = rep.train_step(b, B, bng, lr);

      loss_sum += loss;
      progress.add(loss);
      if (leader && !o.quiet && (progress.window() == o.print_every || s + 1 == steps_per_epoch))
        progress.print(epoch + 1, o.epochs, s + 1, steps_per_epoch, step, lr);
    }
    const double epoch_s = std::chrono::duration<double>(clock::now() - t_epoch).count();
    if constexpr (requires { rep.end_epoch(); }) rep.end_epoch();  // hybrid: gather the split layers

    // Every replica ends the epoch with the same model: the running statistics of different BN
    // groups differ, so average them (parameters are already equal).
    lockstep::all_reduce(world, rep.running(), lockstep::reduce_op::average);

    // Test accuracy: replica r evaluates its slice of the test set, the sums are added up.
    const int n_test = o.test_limit > 0 ? std::min(o.test_limit, data.test.n) : data.test.n;
    const int lo = static_cast<int>(static_cast<long long>(n_test) * rank / R);
    const int hi = static_cast<int>(static_cast<long long>(n_test) * (rank + 1) / R);
    const int HW = data.test.rows * data.test.cols, chunk = 500;
    std::vector<float> images(static_cast<std::size_t>(chunk) * HW);
    std::vector<int> labels(static_cast<std::size_t>(chunk));
    float sums[3] = {0, 0, static_cast<float>(loss_sum)};  // correct, test loss sum, train loss sum
    for (int i = lo; i < hi; i += chunk) {
      const int n = std::min(chunk, hi - i);
      for (int k = 0; k < n; ++k) {
        sample::prepare_image(images.data() + static_cast<std::size_t>(k) * HW, data.test, i + k, {false, 0, false}, 0);
        labels[static_cast<std::size_t>(k)] = data.test.labels[static_cast<std::size_t>(i + k)];
      }
      int correct = 0;
      sums[1] += rep.evaluate(images.data(), labels.data(), n, bng, &correct) * n;
      sums[0] += static_cast<float>(correct);
    }
    lockstep::all_reduce(world, std::span<float>(sums, 3));

    // Error-feedback residuals of every replica, gathered for rank 0's checkpoint.
    std::vector<float> residuals;
    if constexpr (Replica::has_residuals) {
      const std::vector<float> mine = rep.residuals();
      residuals = sample::gather_all(world, std::span<const float>(mine));
    }

    if (leader) {
      epoch_record rec{epoch + 1, step, progress.seconds(),
                       steps_per_epoch * static_cast<double>(o.batch) / epoch_s,
                       schedule(static_cast<double>(step)), sums[2] / (static_cast<double>(R) * steps_per_epoch),
                       sums[1] / n_test, sums[0] / n_test};
      result.epochs.push_back(rec);
      sample::csv_row(csv_path, rec.epoch, rec.step, rec.step * o.batch, rec.seconds, rec.lr, rec.train_loss,
                      rec.test_loss, rec.test_acc, rec.images_per_s);
      const std::span<float> run = rep.running();
      checkpoint c{epoch + 1, step, rep.params(), std::vector<float>(run.begin(), run.end()), rep.momentum(),
                   std::move(residuals)};
      save_checkpoint(ckpt_path, o, c);
      if (!o.quiet) {
        std::printf("epoch %d: test accuracy %.2f%%  test loss %.4f  train loss %.4f  %.0f img/s  (%.0f s)\n",
                    rec.epoch, 100.0 * rec.test_acc, rec.test_loss, rec.train_loss, rec.images_per_s, rec.seconds);
        write_plot(o.out, true);
      }
    }
    lockstep::barrier(world);  // nobody starts the next epoch while rank 0 may still be writing
  }
}

// ----------------------------------------------------------------------------------------------
// Picks the policy types named by the flags and calls f(topology, codec&, optimizer) with them.

template <class F>
void with_policies(const options& o, F&& f) {
  sample::with_policies(o, std::forward<F>(f));
}

// Checks the flags that a replica cannot check alone; throws with a message naming the flag.
inline void validate(const options& o) {
  auto bad = [](const std::string& s) { throw std::invalid_argument(s); };
  sample::validate_parallel_flags(o);
  if (o.epochs < 1) bad("--epochs must be at least 1");
  if (o.lr < 0) bad("--lr must be positive (0: the optimizer's default)");
  if (o.label_smoothing < 0 || o.label_smoothing >= 1) bad("--label-smoothing must be in [0, 1)");
  if ((o.fc[0] > 0) != (o.fc[1] > 0) || o.fc[0] < 0 || o.fc[1] < 0) bad("--fc wants two positive widths H1,H2");
  if (o.parallel != "data" && o.parallel != "hybrid-a" && o.parallel != "hybrid-b" && o.parallel != "hybrid-c")
    bad("--parallel must be data, hybrid-a, hybrid-b or hybrid-c");
  if (o.activation_codec != "fp32" && o.activation_codec != "bf16" && o.activation_codec != "int8" &&
      o.activation_codec != "dyntree8")
    bad("--activation-codec must be fp32, bf16, int8 or dyntree8");
  if (o.parallel != "data") {
    if (o.fc[0] <= 0) bad("--parallel " + o.parallel + " splits the FC head: give --fc H1,H2");
    if (o.fc[0] < o.ranks) bad("--fc " + std::to_string(o.fc[0]) + ",...: each of the " + std::to_string(o.ranks) +
                               " ranks needs at least one of fc1's columns");
    if (o.error_feedback) bad("--parallel " + o.parallel + " does not support --error-feedback");
  }
}

// Loads the data set once for this process, keeping the first N images where the flags say so.
inline shared_data load_data(const options& o) {
  shared_data d{sample::load_idx_pair(o.data, "train"), sample::load_idx_pair(o.data, "t10k")};
  // The model reads side x side pixels an image: other shapes would be read past their end.
  const int side = config{}.side;
  for (const auto& [s, prefix] : {std::pair{&d.train, "train"}, std::pair{&d.test, "t10k"}})
    if (s->rows != side || s->cols != side)
      throw sample::data_error(o.data + "/" + prefix + "-images-idx3-ubyte.gz: images are " + std::to_string(s->rows) +
                               "x" + std::to_string(s->cols) + "; the model reads " + std::to_string(side) + "x" +
                               std::to_string(side) + " (Fashion-MNIST)");
  auto limit = [](sample::image_set& s, int n) {
    if (n <= 0 || n >= s.n) return;
    s.n = n;
    s.pixels.resize(static_cast<std::size_t>(n) * s.rows * s.cols);
    s.labels.resize(static_cast<std::size_t>(n));
  };
  limit(d.train, o.train_limit);
  limit(d.test, o.test_limit);
  if (d.train.n < o.batch)
    throw std::invalid_argument("--batch " + std::to_string(o.batch) + " exceeds the " + std::to_string(d.train.n) +
                                " training images");
  return d;
}

}  // namespace fashion
