// lockstep-train-fashion-cuda: lockstep-train-fashion on an NVIDIA GPU (cuDNN and cuBLAS), with the
// same model, flags, metrics, checkpoints and plot.
//
// Purpose: the GPU half of the sample. --ranks replicas run as threads of this process, all on the
// current GPU (CUDA_VISIBLE_DEVICES picks it), their gradients averaged by lockstep's device
// collectives over the inproc_device transport; trainer.hpp's loop with replica_cuda.cuh.
// Limits: one GPU per process; the MPI + NCCL mode of a multi-GPU run is not wired in yet.
//
//   lockstep-train-fashion-cuda --ranks 4 --topology torus2d:2x2 --codec dyntree8 --error-feedback
//       --optimizer lars --bn-group 2 --epochs 6 --out run1
#include <cstdio>
#include <cstdlib>

#include "flags.hpp"
#include "replica_cuda.cuh"

int main(int argc, char** argv) {
  fashion::options o = fashion::parse_flags(argc, argv);
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "lockstep-train-fashion-cuda: no CUDA device visible (use lockstep-train-fashion on the CPU)\n");
      return 1;
    }
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
