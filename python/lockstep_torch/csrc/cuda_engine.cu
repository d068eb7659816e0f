// python/lockstep_torch/csrc/cuda_engine.cu: lockstep_torch's CUDA buckets (cuda_engine.hpp): the
// stream engine over lockstep's NCCL transport, compiled by nvcc with no torch header in sight.
#include "cuda_engine.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <span>

#include <lockstep/device/space.hpp>
#include <lockstep/transport/nccl.hpp>

#include "stream_engine.hpp"

namespace lockstep_torch::cuda {

namespace {

using nccl = lockstep::transport::nccl;
using device_group = lockstep::group<nccl>;

// Makes `device` current for one call and puts back the caller's (torch's autograd threads keep
// their own).
class device_guard {
 public:
  explicit device_guard(int device, int rank) {
    lockstep::device::check(cudaGetDevice(&old_), "cudaGetDevice", rank);
    if (old_ != device) lockstep::device::check(cudaSetDevice(device), "cudaSetDevice", rank);
  }
  ~device_guard() { cudaSetDevice(old_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int old_ = 0;
};

}  // namespace

bool available(std::string& why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  return true;
}

std::string unique_id() {
  ncclUniqueId id{};
  nccl::check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof id.internal);
}

struct engine::impl {
  int device = 0;
  double timeout_s = 0;
  std::optional<lockstep::device::stream> s;  // before the engine: the group frees its scratch on it
  std::unique_ptr<stream_engine<device_group>> e;

  std::span<float> span(std::uintptr_t data, std::size_t n) const { return {reinterpret_cast<float*>(data), n}; }
  static cudaStream_t stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
};

engine::engine(const std::string& id, int rank, int size, int device, double timeout_s) : p_(std::make_unique<impl>()) {
  const lockstep::group_options opt = group_options_for(timeout_s);
  if (id.size() != sizeof(ncclUniqueId::internal))
    throw lockstep::error(lockstep::errc::invalid_argument, "lockstep_torch", rank, -1,
                          "an NCCL id of " + std::to_string(id.size()) + " bytes, not " +
                              std::to_string(sizeof(ncclUniqueId::internal)));
  std::string why;
  if (!available(why))
    throw lockstep::error(lockstep::errc::invalid_argument, "lockstep_torch", rank, -1,
                          "CUDA buckets need a GPU, and none is visible (" + why + ")");
  p_->device = device;
  p_->timeout_s = timeout_s;
  device_guard on(device, rank);
  p_->s.emplace();  // on `device`
  ncclUniqueId uid{};
  std::memcpy(uid.internal, id.data(), sizeof uid.internal);
  auto comm = nccl::communicator::init_rank(size, uid, rank);
  p_->e = std::make_unique<stream_engine<device_group>>(
      std::make_unique<device_group>(nccl(std::move(comm), p_->s->get()), opt),
      [device] { cudaSetDevice(device); });  // the watcher's event queries and abort, on this GPU
  warm_up();
}

// NCCL connects a pair of ranks at their first send and receive, and a blocking communicator's
// ncclGroupEnd waits on the host until the peer has connected too: a peer that never called would
// stall a later hook on the host, before the watcher could see it. So every pair the topologies
// use (ring neighbours, the rows and columns of every torus shape a State may name) connects here,
// while every rank is in this constructor, and later calls only enqueue.
void engine::warm_up() {
  const std::size_t n = static_cast<std::size_t>(size()) * 64;
  lockstep::device::buffer<float> x(n, p_->s->get());
  lockstep::device::check(cudaMemsetAsync(x.data(), 0, n * sizeof(float), p_->s->get()), "cudaMemsetAsync", rank());
  const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(x.data()), s = reinterpret_cast<std::uintptr_t>(p_->s->get());
  all_reduce(p, n, s, "fp32", "ring", "sum");
  // torus2d:RxC for every shape of the group (1xN and Nx1 are the ring's pairs).
  for (int r = 2; r < size(); ++r)
    if (size() % r == 0) all_reduce(p, n, s, "fp32", "torus2d:" + std::to_string(r) + "x" + std::to_string(size() / r), "sum");
  synchronize();
  lockstep::device::check(cudaStreamSynchronize(p_->s->get()), "cudaStreamSynchronize", rank());
}

engine::~engine() {
  if (!p_ || !p_->e) return;
  device_guard on(p_->device, p_->e->rank());
  p_->e.reset();  // waits for pending calls, each within the timeout
  p_->s.reset();  // on this GPU
}

int engine::rank() const { return p_->e->rank(); }
int engine::size() const { return p_->e->size(); }
int engine::device() const { return p_->device; }
double engine::timeout() const { return p_->timeout_s; }
std::string engine::name() const { return p_->e->name(); }

void engine::all_reduce(std::uintptr_t data, std::size_t n, std::uintptr_t stream, const std::string& codec,
                        const std::string& topology, const std::string& op) {
  const codec_kind ck = parse_codec(codec, rank());
  const topology_spec ts = parse_topology(topology, rank(), size());
  const lockstep::reduce_op rop = parse_op(op, rank());
  device_guard on(p_->device, rank());
  p_->e->all_reduce(p_->span(data, n), impl::stream(stream), ck, ts, rop);
}

void engine::reduce_bucket(std::uintptr_t data, std::size_t n, std::uintptr_t stream, const std::string& codec,
                           const std::string& topology, int bucket_index) {
  const codec_kind ck = parse_codec(codec, rank());
  const topology_spec ts = parse_topology(topology, rank(), size());
  device_guard on(p_->device, rank());
  p_->e->reduce_bucket(p_->span(data, n), impl::stream(stream), ck, ts, bucket_index);
}

void engine::synchronize() { p_->e->synchronize(); }
std::map<int, std::size_t> engine::buckets() { return p_->e->buckets(); }
void engine::reset_buckets() {
  device_guard on(p_->device, rank());
  p_->e->reset_buckets();
}

}  // namespace lockstep_torch::cuda
