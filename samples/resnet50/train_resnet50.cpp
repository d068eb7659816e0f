// lockstep-train-resnet50: trains ResNet-50 v1.5 on an ImageNet-layout JPEG folder (or synthetic
// data), synchronously data-parallel over lockstep, the systems of Ying et al. 2018: distributed
// batch norm, the sharded cached prefetched fused decode-and-crop pipeline, bf16 convolutions with
// fp32 master weights, LARS, ring or 2-D torus gradient summation.
//
// Purpose: flags (flags.hpp), then trainer.hpp with replica_cpu.hpp does the work. By default
// --ranks replicas run as threads of this process; started under mpirun (a build with MPI), each
// process is one replica and --ranks is the job's size (samples/common/main.hpp).
// Limits: CPU (oneDNN) only in this program.
//
//   lockstep-train-resnet50 --synthetic --steps 20 --batch 32 --precision bf16      (throughput)
//   lockstep-train-resnet50 --data fashion-jpeg --size 64 --batch 64 --epochs 4 --optimizer lars --lr 2
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "../common/main.hpp"
#include "flags.hpp"
#include "replica_cpu.hpp"

int main(int argc, char** argv) {
  resnet::options o = resnet::parse_flags(argc, argv);
  return sample::trainer_main(
      "lockstep-train-resnet50", argc, argv, o,
      [&](auto& world) {  // one replica of an MPI job
        resnet::validate(o);
        if (world.rank() == 0) std::filesystem::create_directories(o.out);
        lockstep::barrier(world);
        resnet::run_result r;
        resnet::train_dispatch(world, o, r);
        if (world.rank() == 0) resnet::print_summary(r);
      },
      [&] {
        std::printf("lockstep-train-resnet50: %d replica%s, batch %d (%d each), %s, size %d, %s, %s%s, %s (peak lr "
                    "%g), bn-group %d, %d epochs\n",
                    o.ranks, o.ranks == 1 ? "" : "s", o.batch, o.batch / std::max(1, o.ranks), o.precision.c_str(),
                    o.size, o.topology.c_str(), o.codec.c_str(), o.error_feedback ? "+ef" : "", o.optimizer.c_str(),
                    resnet::peak_lr(o), o.bn_group, o.epochs);
        resnet::print_summary(resnet::train_inproc(o));
      });
}
