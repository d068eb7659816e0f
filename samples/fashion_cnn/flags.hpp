// samples/fashion_cnn/flags.hpp: the flags of lockstep-train-fashion and lockstep-train-fashion-cuda
// (the same flags drive both backends): --help text, parsing with errors that name the flag, and
// the closing summary line.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../common/flags.hpp"
#include "trainer.hpp"

namespace fashion {

inline void usage(const char* program, const options& d) {
  std::printf(
      "usage: %s [flags]\n"
      "\n"
      "Trains a conv-BN-ReLU network on Fashion-MNIST with synchronous data parallelism.\n"
      "\n"
      "data and output\n"
      "  --data DIR            directory of the four *-ubyte.gz IDX files (default %s)\n"
      "  --out DIR             metrics.csv, metrics.png, metrics.gp and checkpoint.bin go here (default %s)\n"
      "  --resume              continue from DIR/checkpoint.bin with the same flags; bit-for-bit the run that\n"
      "                        was interrupted (error-feedback residuals are in the checkpoint too)\n"
      "  --stop-after N        end after N epochs of this invocation, checkpoint written; --resume goes on\n"
      "  --train-limit N       use only the first N training images (0 = all 60000; default 0)\n"
      "  --test-limit N        use only the first N test images (0 = all 10000; default 0)\n"
      "  --no-augment          no random crop (2-pixel padding) and no horizontal flip\n"
      "  --print-every N       progress line every N steps (default %d)\n"
      "\n"
      "model and loss\n"
      "  --channels A,B,C      channels of the three conv blocks (default %d,%d,%d)\n"
      "  --label-smoothing E   target (1-E) on the label and E/10 spread over all classes (default %g)\n"
      "  --bn-group G          batch-norm statistics over G consecutive replicas; 1 = local (default %d)\n"
      "  --fc H1,H2            AlexNet-like head: features -> FC H1 -> FC H2 -> classifier, ReLU between\n"
      "\n"
      "data parallelism\n"
      "  --ranks N             replicas as threads of this process (default %d); under mpirun: the job size\n"
      "  --threads T           oneDNN threads per replica (default: hardware threads / ranks, at least 1; CPU only)\n"
      "  --batch B             global batch, split evenly over the replicas (default %d)\n"
      "  --topology T          ring | torus2d (most square grid) | torus2d:RxC (default %s)\n"
      "  --codec C             gradients on the wire: fp32 | bf16 | int8 | dyntree8 (default %s)\n"
      "  --codec-block N       elements per absmax scale of int8 and dyntree8, gradients and activations (default %zu)\n"
      "  --error-feedback      keep each rank's quantisation residual and add it to the next step's gradient\n"
      "\n"
      "hybrid parallelism (Krizhevsky 2014; --fc; sgd or lars)\n"
      "  --parallel P          data | hybrid-a (gather all rows) | hybrid-b (rank by rank) | hybrid-c (1/K of\n"
      "                        every rank's rows per round): fc1 and fc2 split over the ranks, activations\n"
      "                        travel instead of their weights (default data)\n"
      "  --activation-codec C  activations and their gradients on the wire: fp32 | bf16 | int8 | dyntree8\n"
      "                        (hybrid runs only; --parallel data has none on the wire)\n"
      "                        (default fp32)\n"
      "\n"
      "optimizer and schedule (linear warmup from 0, then polynomial decay to --end-lr)\n"
      "  --optimizer O         sgd (momentum, torch form) | lars (trust ratio per tensor) (default %s)\n"
      "  --lr PEAK             peak learning rate after warmup (default 0.02 for sgd, 0.2 for lars)\n"
      "  --warmup-epochs W     epochs of linear warmup (default %g)\n"
      "  --end-lr L            learning rate at the last step (default %g)\n"
      "  --power P             exponent of the decay; 1 = linear (default %g)\n"
      "  --momentum M          (default %g)\n"
      "  --weight-decay D      not applied to batch-norm parameters and biases (default %g)\n"
      "  --lars-trust ETA      LARS trust coefficient (default %g)\n"
      "  --epochs E            (default %d)\n"
      "  --seed S              model initialisation, data order and augmentation (default %llu)\n"
      "  --help                this text\n",
      program, d.data.c_str(), d.out.c_str(), d.print_every, d.channels[0], d.channels[1], d.channels[2], d.label_smoothing,
      d.bn_group, d.ranks, d.batch, d.topology.c_str(), d.codec.c_str(), d.codec_block, d.optimizer.c_str(),
      d.warmup_epochs, d.end_lr, d.power, d.momentum, d.weight_decay, d.lars_trust, d.epochs,
      static_cast<unsigned long long>(d.seed));
}

using sample::die;

inline options parse_flags(int argc, char** argv) {
  sample::flag_parser p(argc, argv, "lockstep-train-fashion");
  options o;
  auto number = [&] { return p.number(); };
  auto value = [&] { return p.value(); };
  while (p.next()) {
    const std::string& a = p.flag();
    if (a == "--help" || a == "-h") usage(p.program(), o), std::exit(0);
    else if (a == "--data") o.data = value();
    else if (a == "--out") o.out = value();
    else if (a == "--resume") o.resume = true;
    else if (a == "--stop-after") o.stop_after = p.whole<int>();
    else if (a == "--train-limit") o.train_limit = p.whole<int>();
    else if (a == "--test-limit") o.test_limit = p.whole<int>();
    else if (a == "--no-augment") o.augment = false;
    else if (a == "--print-every") o.print_every = std::max(1, p.whole<int>());
    else if (a == "--channels") {
      const std::string v = value();
      if (std::sscanf(v.c_str(), "%d,%d,%d", &o.channels[0], &o.channels[1], &o.channels[2]) != 3 ||
          o.channels[0] < 1 || o.channels[1] < 1 || o.channels[2] < 1)
        p.fail("--channels wants three positive numbers A,B,C, got '" + v + "'");
    }
    else if (a == "--fc") {
      const std::string v = value();
      if (std::sscanf(v.c_str(), "%d,%d", &o.fc[0], &o.fc[1]) != 2 || o.fc[0] < 1 || o.fc[1] < 1)
        p.fail("--fc wants two positive widths H1,H2, got '" + v + "'");
    }
    else if (a == "--parallel") o.parallel = value();
    else if (a == "--activation-codec") o.activation_codec = value();
    else if (a == "--label-smoothing") o.label_smoothing = static_cast<float>(number());
    else if (a == "--bn-group") o.bn_group = p.whole<int>();
    else if (a == "--ranks") o.ranks = p.whole<int>();
    else if (a == "--threads") o.threads = p.whole<int>();
    else if (a == "--batch") o.batch = p.whole<int>();
    else if (a == "--topology") o.topology = value();
    else if (a == "--codec") o.codec = value();
    else if (a == "--codec-block") o.codec_block = p.whole<std::size_t>();
    else if (a == "--error-feedback") o.error_feedback = true;
    else if (a == "--optimizer") o.optimizer = value();
    else if (a == "--lr") o.lr = number();
    else if (a == "--warmup-epochs") o.warmup_epochs = number();
    else if (a == "--end-lr") o.end_lr = number();
    else if (a == "--power") o.power = number();
    else if (a == "--momentum") o.momentum = static_cast<float>(number());
    else if (a == "--weight-decay") o.weight_decay = static_cast<float>(number());
    else if (a == "--lars-trust") o.lars_trust = static_cast<float>(number());
    else if (a == "--epochs") o.epochs = p.whole<int>();
    else if (a == "--seed") o.seed = p.whole<std::uint64_t>();
    else p.unknown();
  }
  return o;
}

inline void print_summary(const run_result& r) {
  if (r.epochs.empty()) return;
  const auto& e = r.epochs.back();
  std::printf("final test accuracy %.2f%% after %d epochs; metrics %s, plot %s, checkpoint %s\n", 100.0 * e.test_acc,
              e.epoch, r.csv.c_str(), r.plot.c_str(), r.checkpoint.c_str());
}

}  // namespace fashion
