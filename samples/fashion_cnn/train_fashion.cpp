// lockstep-train-fashion: trains a small CNN on Fashion-MNIST, synchronously data-parallel over
// lockstep. The README's first program.
//
// Purpose: flags (flags.hpp), then trainer.hpp with replica_cpu.hpp does the work. By default --ranks replicas run as threads of
// this process (inproc transport); started under mpirun (a build with MPI), each process is one
// replica and --ranks is the job's size (samples/common/main.hpp).
// Limits: CPU (oneDNN) only in this program; lockstep-train-fashion-cuda (train_fashion_cuda.cu)
// is the same trainer on a GPU.
//
//   lockstep-train-fashion --ranks 4 --topology torus2d:2x2 --codec dyntree8 --error-feedback
//       --optimizer lars --bn-group 2 --epochs 6 --out run1
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "../common/main.hpp"
#include "flags.hpp"
#include "replica_cpu.hpp"

int main(int argc, char** argv) {
  fashion::options o = fashion::parse_flags(argc, argv);
  return sample::trainer_main(
      "lockstep-train-fashion", argc, argv, o,
      [&](auto& world) {  // one replica of an MPI job
        fashion::validate(o);
        if (world.rank() == 0) std::filesystem::create_directories(o.out);
        const fashion::shared_data data = fashion::load_data(o);
        fashion::run_result r;
        fashion::train_dispatch(world, o, data, r);
        if (world.rank() == 0) fashion::print_summary(r);
      },
      [&] {
        std::printf("lockstep-train-fashion: %d replica%s, batch %d (%d each), %s, %s%s, %s, bn-group %d, %d epochs\n",
                    o.ranks, o.ranks == 1 ? "" : "s", o.batch, o.batch / std::max(1, o.ranks), o.topology.c_str(),
                    o.codec.c_str(), o.error_feedback ? "+ef" : "", o.optimizer.c_str(), o.bn_group, o.epochs);
        fashion::print_summary(fashion::train_inproc(o));
      });
}
