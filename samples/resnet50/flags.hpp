// samples/resnet50/flags.hpp: the flags of lockstep-train-resnet50: --help text and parsing
// (samples/common/flags.hpp: errors name the flag).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "../common/flags.hpp"
#include "trainer.hpp"

namespace resnet {

inline void usage(const char* program, const options& d) {
  std::printf(
      "usage: %s [flags]\n"
      "\n"
      "Trains ResNet-50 v1.5 with synchronous data parallelism (Ying et al. 2018's systems on lockstep).\n"
      "\n"
      "data and output\n"
      "  --data DIR            ImageNet layout: DIR/train/<class>/*.JPEG, DIR/val/<class>/*.JPEG\n"
      "  --synthetic           random images and labels, no files (throughput); --classes N (default %d),\n"
      "                        --synthetic-images N per epoch (default %lld)\n"
      "  --size S              input resolution, S x S (default %d)\n"
      "  --cache               keep the compressed files in memory after the first epoch\n"
      "  --decode-threads N    JPEG decode threads per replica (default %d)\n"
      "  --skip-bad-images     skip corrupt files (each named once on stderr) instead of stopping\n"
      "  --crop-scale MIN      training crops cover MIN..1 of the image's area (RandomResizedCrop's scale;\n"
      "                        default %g; small images and short runs want a larger MIN)\n"
      "  --crop-pct F          validation's centre crop keeps F of the shorter side (default %g, torchvision's\n"
      "                        Resize + CenterCrop; 1 = the whole image, for subjects that fill the frame)\n"
      "  --val-limit N         validate on the first N val images only (0 = all)\n"
      "  --val-every N         validate after every N-th epoch and after the last (default 1; others: nan)\n"
      "  --out DIR             metrics.csv, metrics.png, metrics.gp and checkpoint.bin go here (default %s)\n"
      "  --resume              continue from DIR/checkpoint.bin with the same flags, bit-for-bit\n"
      "  --evaluate            validate DIR/checkpoint.bin (the training run's flags) and stop; nothing written\n"
      "  --stop-after N        end after N epochs of this invocation, checkpoint written\n"
      "  --steps N             stop after N steps, no checkpoint; prints images/s (with --synthetic: the benchmark)\n"
      "  --print-every N       progress line every N steps (default %d)\n"
      "\n"
      "model and precision\n"
      "  --precision P         fp32 | bf16: convolutions and classifier in bf16 with fp32 accumulation, batch\n"
      "                        norm, loss and optimizer fp32, fp32 master weights (default %s)\n"
      "  --zero-init-residual  the last batch-norm scale of every bottleneck starts at 0\n"
      "  --label-smoothing E   (default %g)\n"
      "  --bn-group G          batch-norm statistics over G consecutive replicas; 1 = local (default %d)\n"
      "\n"
      "data parallelism\n"
      "  --ranks N             replicas as threads of this process (default %d); under mpirun: the job size\n"
      "  --threads T           oneDNN / OpenMP threads per replica (default: hardware threads / ranks)\n"
      "  --batch B             global batch, split evenly over the replicas (default %d)\n"
      "  --topology T          ring | torus2d | torus2d:RxC (default %s)\n"
      "  --codec C             gradients on the wire: fp32 | bf16 | int8 | dyntree8 (default %s)\n"
      "  --codec-block N       elements per absmax scale of int8 and dyntree8 (default %zu)\n"
      "  --error-feedback      keep each rank's quantisation residual for the next step\n"
      "\n"
      "optimizer and schedule (linear warmup from 0, then polynomial decay to --end-lr)\n"
      "  --recipe mlperf       the MLPerf reference: LARS trust 0.001, eps 0, momentum 0.9, weight decay 2e-4,\n"
      "                        BN and biases exempt, warmup then poly decay (power 2) to 1e-4, label smoothing\n"
      "                        0.1, base rate by global batch <16K: 10, <32K: 25, >=32K: 31.2 (warmup 25 epochs\n"
      "                        there, 5 below); flags after it override it\n"
      "  --optimizer O         sgd (momentum) | lars (default %s)\n"
      "  --lr PEAK             peak rate (default: lars the MLPerf table, sgd 0.1 x batch / 256)\n"
      "  --warmup-epochs W     (default %g)     --end-lr L (default %g)     --power P (default %g)\n"
      "  --momentum M          (default %g)     --weight-decay D (default %g; not on BN parameters and biases)\n"
      "  --lars-trust ETA      (default %g)\n"
      "  --epochs E            (default %d)\n"
      "  --seed S              initialisation, data order and augmentation (default %llu)\n"
      "  --help                this text\n",
      program, d.classes, d.synthetic_images, d.size, d.decode_threads, d.crop_scale, d.crop_pct, d.out.c_str(), d.print_every,
      d.precision.c_str(), d.label_smoothing, d.bn_group, d.ranks, d.batch, d.topology.c_str(), d.codec.c_str(),
      d.codec_block, d.optimizer.c_str(), d.warmup_epochs, d.end_lr, d.power, d.momentum, d.weight_decay,
      d.lars_trust, d.epochs, static_cast<unsigned long long>(d.seed));
}

inline options parse_flags(int argc, char** argv) {
  sample::flag_parser p(argc, argv, "lockstep-train-resnet50");
  options o;
  bool warmup_given = false;
  auto integer = [&] { return p.whole<int>(); };
  while (p.next()) {
    if (p.is("--help") || p.is("-h")) usage(p.program(), o), std::exit(0);
    else if (p.is("--data")) o.data = p.value();
    else if (p.is("--synthetic")) o.synthetic = true;
    else if (p.is("--classes")) o.classes = integer();
    else if (p.is("--synthetic-images")) o.synthetic_images = p.whole<long long>();
    else if (p.is("--size")) o.size = integer();
    else if (p.is("--cache")) o.cache = true;
    else if (p.is("--decode-threads")) o.decode_threads = std::max(1, integer());
    else if (p.is("--skip-bad-images")) o.skip_bad = true;
    else if (p.is("--crop-scale")) o.crop_scale = p.number();
    else if (p.is("--crop-pct")) o.crop_pct = p.number();
    else if (p.is("--evaluate")) o.evaluate = true;
    else if (p.is("--val-limit")) o.val_limit = p.whole<long long>();
    else if (p.is("--val-every")) o.val_every = integer();
    else if (p.is("--out")) o.out = p.value();
    else if (p.is("--resume")) o.resume = true;
    else if (p.is("--stop-after")) o.stop_after = integer();
    else if (p.is("--steps")) o.steps = p.whole<long long>();
    else if (p.is("--print-every")) o.print_every = std::max(1, integer());
    else if (p.is("--precision")) o.precision = p.value();
    else if (p.is("--zero-init-residual")) o.zero_init_residual = true;
    else if (p.is("--label-smoothing")) o.label_smoothing = static_cast<float>(p.number());
    else if (p.is("--bn-group")) o.bn_group = integer();
    else if (p.is("--ranks")) o.ranks = integer();
    else if (p.is("--threads")) o.threads = integer();
    else if (p.is("--batch")) o.batch = integer();
    else if (p.is("--topology")) o.topology = p.value();
    else if (p.is("--codec")) o.codec = p.value();
    else if (p.is("--codec-block")) o.codec_block = p.whole<std::size_t>();
    else if (p.is("--error-feedback")) o.error_feedback = true;
    else if (p.is("--recipe")) {
      const std::string r = p.value();
      if (r == "mlperf") apply_mlperf_recipe(o);
      else if (r != "none") p.fail("--recipe must be mlperf or none, got '" + r + "'");
    }
    else if (p.is("--optimizer")) o.optimizer = p.value();
    else if (p.is("--lr")) o.lr = p.number();
    else if (p.is("--warmup-epochs")) o.warmup_epochs = p.number(), warmup_given = true;
    else if (p.is("--end-lr")) o.end_lr = p.number();
    else if (p.is("--power")) o.power = p.number();
    else if (p.is("--momentum")) o.momentum = static_cast<float>(p.number());
    else if (p.is("--weight-decay")) o.weight_decay = static_cast<float>(p.number());
    else if (p.is("--lars-trust")) o.lars_trust = static_cast<float>(p.number());
    else if (p.is("--epochs")) o.epochs = integer();
    else if (p.is("--seed")) o.seed = p.whole<std::uint64_t>();
    else p.unknown();
  }
  // The recipe's warmup depends on the final batch, which may come after --recipe; a
  // --warmup-epochs given anywhere is kept.
  if (o.recipe == "mlperf" && !warmup_given) o.warmup_epochs = o.batch >= 32768 ? 25 : 5;
  return o;
}

inline void print_summary(const run_result& r) {
  if (!r.epochs.empty() && !r.evaluated) {  // --evaluate printed its own line
    const auto& e = r.epochs.back();
    std::printf("final val top-1 %.2f%%, top-5 %.2f%% after %d epochs, %.1f img/s; metrics %s, plot %s, checkpoint %s\n",
                100.0 * e.top1, 100.0 * e.top5, e.epoch, e.images_per_s, r.csv.c_str(), r.plot.c_str(),
                r.checkpoint.c_str());
  }
}

}  // namespace resnet
