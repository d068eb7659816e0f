// lockstep-train-resnet50-cuda: lockstep-train-resnet50 on NVIDIA GPUs (cuDNN and cuBLAS), with the
// same model, flags, input pipeline, metrics, plot and checkpoint format.
//
// Purpose: the GPU backend of the sample; trainer.hpp's loop with replica_cuda.cuh. The input
// pipeline (samples/common) decodes on the host and each step copies its batch to the device. By
// default --ranks replicas run as threads of this process, all on the current GPU
// (CUDA_VISIBLE_DEVICES picks it), their gradients averaged by lockstep's device collectives over
// the inproc_device transport. Started under mpirun (a build with MPI and NCCL), each process is
// one replica on GPU (local rank mod GPUs), gradients over NCCL with lockstep's own topologies and
// codecs, batch norm and validation over MPI; --ranks is the job's size.
// --threads is accepted and has no work here: the host only decodes JPEGs (--decode-threads).
//
//   lockstep-train-resnet50-cuda --synthetic --steps 20 --batch 64 --precision bf16      (throughput)
//   lockstep-train-resnet50-cuda --data fashion-jpeg-32 --size 32 --batch 128 --epochs 3 --ranks 2 --bn-group 2
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "../common/main.hpp"
#include "flags.hpp"
#include "replica_cuda.cuh"

#if LOCKSTEP_SAMPLE_MPI
#include "../common/mpi_gpu.cuh"

namespace {

// One replica per MPI process: this process's GPU (its rank among the processes of its node, from
// MPI_Comm_split_type, so any launcher places it right), an NCCL communicator over the job (its id
// broadcast by MPI), and the same replica and loop as the threaded run.
template <class World>
void train_mpi_nccl(World& world, const resnet::options& o) {
  sample::gpu::use_node_gpu(world.rank());
  resnet::validate(o);
  if (world.rank() == 0) std::filesystem::create_directories(o.out);
  lockstep::barrier(world);
  ncclComm_t comm = sample::gpu::nccl_over_mpi(world.rank(), world.size());
  lockstep::device::stream s;  // before the group: the group frees its scratch on it
  lockstep::group<lockstep::transport::nccl> dg(
      lockstep::transport::nccl(lockstep::transport::nccl::communicator(comm), s.get()));
  resnet::run_result r;
  resnet::train_dispatch_cuda(world, dg, o, r);
  if (world.rank() == 0) resnet::print_summary(r);
}

}  // namespace
#endif

int main(int argc, char** argv) {
  resnet::options o = resnet::parse_flags(argc, argv);
  const char* program = "lockstep-train-resnet50-cuda";
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "%s: no CUDA device visible (use lockstep-train-resnet50 on the CPU)\n", program);
    return 1;
  }
  return sample::trainer_main(
      program, argc, argv, o,
      [&](auto& world) {  // one replica of an MPI job, over NCCL
#if LOCKSTEP_SAMPLE_MPI
        train_mpi_nccl(world, o);
#else
        (void)world;
#endif
      },
      [&] {
        cudaDeviceProp prop{};
        int dev = 0;
        LOCKSTEP_SAMPLE_CHECK(cudaGetDevice(&dev));
        LOCKSTEP_SAMPLE_CHECK(cudaGetDeviceProperties(&prop, dev));
        std::printf("%s on %s: %d replica%s, batch %d (%d each), %s, size %d, %s, %s%s, %s (peak lr %g), bn-group %d, "
                    "%d epochs\n",
                    program, prop.name, o.ranks, o.ranks == 1 ? "" : "s", o.batch, o.batch / std::max(1, o.ranks),
                    o.precision.c_str(), o.size, o.topology.c_str(), o.codec.c_str(), o.error_feedback ? "+ef" : "",
                    o.optimizer.c_str(), resnet::peak_lr(o), o.bn_group, o.epochs);
        resnet::print_summary(resnet::train_inproc_cuda(o));
      });
}
