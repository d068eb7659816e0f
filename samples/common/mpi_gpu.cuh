// samples/common/mpi_gpu.cuh: one replica per MPI process, each on a GPU of its own, for the samples'
// GPU trainers under mpirun: which GPU is this process's, and an NCCL communicator over the job.
// Needs MPI and NCCL (built where LOCKSTEP_SAMPLE_MPI and NCCL are).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <stdexcept>
#include <string>

#include <lockstep/transport/nccl.hpp>

#include "cuda_context.cuh"

namespace sample::gpu {

// Makes this process's GPU current: its rank among the processes of its node (MPI_Comm_split_type,
// so any launcher places it right). More processes on a node than GPUs is an error naming both.
inline void use_node_gpu(int world_rank) {
  int devices = 0;
  LOCKSTEP_SAMPLE_CHECK(cudaGetDeviceCount(&devices));
  MPI_Comm node = MPI_COMM_NULL;
  int local = 0, local_size = 1;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Comm_split_type failed: cannot tell which GPU is this process's");
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  if (local_size > devices)
    throw std::runtime_error("rank " + std::to_string(world_rank) + ": " + std::to_string(local_size) +
                             " processes on this node but " + std::to_string(devices) +
                             " GPUs; NCCL needs one GPU per process (use --ranks N without mpirun for several "
                             "replicas on one GPU)");
  LOCKSTEP_SAMPLE_CHECK(cudaSetDevice(local));
}

// An NCCL communicator over MPI_COMM_WORLD (rank 0's id broadcast by MPI). Every rank calls it.
inline ncclComm_t nccl_over_mpi(int rank, int size) {
  ncclUniqueId id{};
  if (rank == 0) lockstep::transport::nccl::check(ncclGetUniqueId(&id), "ncclGetUniqueId", 0);
  if (MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Bcast of the NCCL id failed");
  ncclComm_t comm = nullptr;
  lockstep::transport::nccl::check(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank", rank);
  return comm;
}

}  // namespace sample::gpu
