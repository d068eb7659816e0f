// python/lockstep_torch/csrc/cuda_engine.hpp: lockstep_torch's CUDA buckets, as an interface with
// no CUDA or torch type in it, so module.cpp (g++, torch's headers) and cuda_engine.cu (nvcc,
// lockstep's device headers and NCCL) never meet in one translation unit. Built where nvcc and
// NCCL are (LOCKSTEP_TORCH_CUDA); tensors cross as their address and torch's stream as its
// cudaStream_t, both integers.
//
// The engine runs lockstep's device executor (the one walker, in device::cuda_space) over its own
// NCCL communicator, whose id rank 0 makes (unique_id) and the Python side broadcasts over the
// user's process group: the same GPUs and links ProcessGroupNCCL uses, with lockstep's topologies
// and codecs on them (NCCL's own all-reduce cannot compress). Everything else is stream_engine's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace lockstep_torch::cuda {

// Whether a CUDA device is visible; `why` says why not (the runtime's message).
bool available(std::string& why);

// ncclGetUniqueId's bytes, made on the rank that will be rank 0 of the engine.
std::string unique_id();

class engine {
 public:
  // Rank `rank` of `size` on GPU `device`, joining the communicator of `id` (collective: every
  // rank constructs its engine with the same id). timeout_s bounds every call.
  engine(const std::string& id, int rank, int size, int device, double timeout_s);
  ~engine();
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  double timeout() const;
  std::string name() const;

  // `data`: n floats on this engine's GPU; `stream`: the caller's cudaStream_t (torch's current
  // stream). Both enqueue in the stream's order and return (stream_engine.hpp).
  void all_reduce(std::uintptr_t data, std::size_t n, std::uintptr_t stream, const std::string& codec,
                  const std::string& topology, const std::string& op);
  void reduce_bucket(std::uintptr_t data, std::size_t n, std::uintptr_t stream, const std::string& codec,
                     const std::string& topology, int bucket_index);
  void synchronize();
  std::map<int, std::size_t> buckets();
  void reset_buckets();

 private:
  void warm_up();
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace lockstep_torch::cuda
