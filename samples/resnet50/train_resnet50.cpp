// lockstep-train-resnet50: trains ResNet-50 v1.5 on an ImageNet-layout JPEG folder (or synthetic
// data), synchronously data-parallel over lockstep, the systems of Ying et al. 2018: distributed
// batch norm, the sharded cached prefetched fused decode-and-crop pipeline, bf16 convolutions with
// fp32 master weights, LARS, ring or 2-D torus gradient summation.
//
// Purpose: flags (flags.hpp), then trainer.hpp with replica_cpu.hpp does the work. By default
// --ranks replicas run as threads of this process; started under mpirun (a build with MPI), each
// process is one replica and --ranks is the job's size.
// Limits: CPU (oneDNN) only in this program.
//
//   lockstep-train-resnet50 --synthetic --steps 20 --batch 32 --precision bf16      (throughput)
//   lockstep-train-resnet50 --data fashion-jpeg --size 64 --batch 64 --epochs 4 --optimizer lars --lr 2
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flags.hpp"
#include "replica_cpu.hpp"

#if LOCKSTEP_SAMPLE_MPI
#include <lockstep/transport/mpi.hpp>
#endif

int main(int argc, char** argv) {
  resnet::options o = resnet::parse_flags(argc, argv);
  try {
#if LOCKSTEP_SAMPLE_MPI
    if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE")) {
      lockstep::transport::mpi_session session(&argc, &argv);
      lockstep::group<lockstep::transport::mpi> world(lockstep::transport::mpi(MPI_COMM_WORLD));
      o.ranks = world.size();
      resnet::validate(o);
      if (world.rank() == 0) std::filesystem::create_directories(o.out);
      lockstep::barrier(world);
      resnet::run_result r;
      resnet::train_dispatch(world, o, r);
      if (world.rank() == 0) resnet::print_summary(r);
      return 0;
    }
#endif
    std::printf("lockstep-train-resnet50: %d replica%s, batch %d (%d each), %s, size %d, %s, %s%s, %s (peak lr %g), "
                "bn-group %d, %d epochs\n",
                o.ranks, o.ranks == 1 ? "" : "s", o.batch, o.batch / std::max(1, o.ranks), o.precision.c_str(), o.size,
                o.topology.c_str(), o.codec.c_str(), o.error_feedback ? "+ef" : "", o.optimizer.c_str(),
                resnet::peak_lr(o), o.bn_group, o.epochs);
    resnet::print_summary(resnet::train_inproc(o));
  } catch (const std::invalid_argument& e) {
    sample::die("lockstep-train-resnet50", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-train-resnet50: %s\n", e.what());
    return 1;
  }
  return 0;
}
