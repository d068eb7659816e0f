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
#include <lockstep/transport/nccl.hpp>

namespace {

// One replica per MPI process: this process's GPU (its rank among the processes of its node, from
// MPI_Comm_split_type, so any launcher places it right), an NCCL communicator over the job (its id
// broadcast by MPI), and the same replica and loop as the threaded run.
template <class World>
void train_mpi_nccl(World& world, const resnet::options& o) {
  int devices = 0;
  LOCKSTEP_SAMPLE_CHECK(cudaGetDeviceCount(&devices));
  MPI_Comm node = MPI_COMM_NULL;
  int local = 0, local_size = 1;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world.rank(), MPI_INFO_NULL, &node) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Comm_split_type failed: cannot tell which GPU is this process's");
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  if (local_size > devices)
    throw std::runtime_error("rank " + std::to_string(world.rank()) + ": " + std::to_string(local_size) +
                             " processes on this node but " + std::to_string(devices) +
                             " GPUs; NCCL needs one GPU per process (use --ranks N without mpirun for several "
                             "replicas on one GPU)");
  LOCKSTEP_SAMPLE_CHECK(cudaSetDevice(local));
  resnet::validate(o);
  if (world.rank() == 0) std::filesystem::create_directories(o.out);
  lockstep::barrier(world);
  ncclUniqueId id{};
  if (world.rank() == 0) lockstep::transport::nccl::check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
  if (MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Bcast of the NCCL id failed");
  ncclComm_t comm = nullptr;
  lockstep::transport::nccl::check(ncclCommInitRank(&comm, world.size(), id, world.rank()), "ncclCommInitRank",
                                   world.rank());
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
