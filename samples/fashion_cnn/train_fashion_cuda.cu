// lockstep-train-fashion-cuda: lockstep-train-fashion on an NVIDIA GPU (cuDNN and cuBLAS), with the
// same model, flags, metrics, checkpoints and plot.
//
// Purpose: the GPU half of the sample; trainer.hpp's loop with replica_cuda.cuh (or, with --fc and
// --parallel hybrid-a|b|c, replica_hybrid_cuda.cuh). By default --ranks
// replicas run as threads of this process, all on the current GPU (CUDA_VISIBLE_DEVICES picks it),
// their gradients averaged by lockstep's device collectives over the inproc_device transport.
// Started under mpirun (a build with MPI and NCCL), each process is one replica on GPU
// (local rank mod GPUs), gradients over NCCL with lockstep's own topologies and codecs, batch norm
// and test sums over MPI; --ranks is the job's size.
//
//   lockstep-train-fashion-cuda --ranks 4 --topology torus2d:2x2 --codec dyntree8 --error-feedback
//       --optimizer lars --bn-group 2 --epochs 6 --out run1
#include <cstdio>
#include <cstdlib>

#include "flags.hpp"
#include "replica_cuda.cuh"

#if LOCKSTEP_SAMPLE_MPI && LOCKSTEP_SAMPLE_NCCL
#include <lockstep/transport/mpi.hpp>
#include "../common/mpi_gpu.cuh"

namespace {

// One replica per MPI process: this process's GPU (its rank among the processes of its node, from
// MPI_Comm_split_type, so any launcher places it right), an NCCL communicator over the job (its id
// broadcast by MPI), and the same replica and loop as the threaded run.
int train_mpi_nccl(fashion::options o, int* argc, char*** argv) {
  lockstep::transport::mpi_session session(argc, argv);
  lockstep::group<lockstep::transport::mpi> world(lockstep::transport::mpi(MPI_COMM_WORLD));
  o.ranks = world.size();
  sample::gpu::use_node_gpu(world.rank());
  fashion::validate(o);
  if (world.rank() == 0) std::filesystem::create_directories(o.out);
  const fashion::shared_data data = fashion::load_data(o);
  ncclComm_t comm = sample::gpu::nccl_over_mpi(world.rank(), world.size());
  lockstep::device::stream s;  // before the group: the group frees its scratch on it
  lockstep::group<lockstep::transport::nccl> dg(
      lockstep::transport::nccl(lockstep::transport::nccl::communicator(comm), s.get()));
  fashion::run_result r;
  fashion::train_dispatch_cuda(world, dg, o, data, r);
  if (world.rank() == 0) fashion::print_summary(r);
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  fashion::options o = fashion::parse_flags(argc, argv);
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "lockstep-train-fashion-cuda: no CUDA device visible (use lockstep-train-fashion on the CPU)\n");
      return 1;
    }
#if LOCKSTEP_SAMPLE_MPI && LOCKSTEP_SAMPLE_NCCL
    if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE")) return train_mpi_nccl(o, &argc, &argv);
#endif
    cudaDeviceProp prop{};
    int dev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceProperties(&prop, dev);
    std::printf("lockstep-train-fashion-cuda on %s: %d replica%s, batch %d (%d each), %s, %s%s, %s, bn-group %d, %d epochs\n",
                prop.name, o.ranks, o.ranks == 1 ? "" : "s", o.batch, o.batch / std::max(1, o.ranks),
                o.topology.c_str(), o.codec.c_str(), o.error_feedback ? "+ef" : "", o.optimizer.c_str(), o.bn_group,
                o.epochs);
    fashion::print_summary(fashion::train_inproc_cuda(o));
  } catch (const std::invalid_argument& e) {
    fashion::die("lockstep-train-fashion-cuda", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-train-fashion-cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
