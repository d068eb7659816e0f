// lockstep/transport/nccl.hpp: NCCL as a stream-ordered point-to-point transport.
//
// NCCL's own all-reduce cannot compress, so lockstep uses only ncclSend and ncclRecv, posted in
// groups on the endpoint's stream, and runs its own topologies and codecs over them (the one
// executor, collective/executor.hpp, in the CUDA stream space). Every call enqueues and returns;
// wait() has nothing left to do, because the stream already orders later work after the group,
// and consume() hands the executor the receive's own buffer, whose reads it enqueues behind it.
// NCCL matches a pair's messages in posting order, so tags are not needed on the wire (the
// executor still passes them). A chunk is one message (segment_bytes = whole_chunk).
//
// What NCCL does not give: a timeout on a peer that never posts (the stream just does not move;
// the request's wait enforces the group's timeout, or reports NCCL's asynchronous error sooner,
// and then aborts the communicator), collective headers (reading one on the host would need a
// host synchronisation per call), and message sizes checked between ranks (a mismatch is NCCL's
// undefined behaviour, not errc::mismatch).
//
//   auto comms = transport::nccl::communicator::init_all({0});          // one rank per listed GPU
//   device::stream s;
//   lockstep::group<transport::nccl> g(transport::nccl(comms[0], s.get()));
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../collective/pipeline.hpp"
#include "../device/space.hpp"
#include "concept.hpp"

namespace lockstep::transport {

class nccl {
 public:
  // NCCL's own explanation of r; check throws it as errc::transport naming the NCCL call.
  static std::string why(ncclResult_t r, ncclComm_t comm) {
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    return std::string(ncclGetErrorString(r)) + (last && *last ? std::string(": ") + last : std::string());
  }
  static void check(ncclResult_t r, const char* what, int rank = -1, int peer = -1, ncclComm_t comm = nullptr) {
    if (r != ncclSuccess && r != ncclInProgress) throw error(errc::transport, what, rank, peer, why(r, comm));
  }

  // A shared, owning handle of an ncclComm_t: destroyed when the last endpoint using it goes.
  class communicator {
   public:
    communicator() = default;
    explicit communicator(ncclComm_t c) : c_(new std::atomic<ncclComm_t>(c), destroy) {}
    ncclComm_t get() const noexcept { return c_ ? c_->load() : nullptr; }
    // ncclCommAbort instead of the destroy: frees the communicator and unblocks its pending work.
    // Taken by an exchange: of aborts from several threads (a watcher's, a call's), one frees it.
    void abort() { if (const ncclComm_t c = c_ ? c_->exchange(nullptr) : nullptr) ncclCommAbort(c); }

    // One communicator per listed device, all in this process (ncclCommInitAll). NCCL needs
    // distinct GPUs per rank, so several ranks on one GPU are inproc_device's job, not NCCL's.
    static std::vector<communicator> init_all(const std::vector<int>& devices) {
      std::vector<ncclComm_t> raw(devices.size());
      check(ncclCommInitAll(raw.data(), static_cast<int>(devices.size()), devices.data()), "ncclCommInitAll");
      std::vector<communicator> out;
      for (ncclComm_t c : raw) out.emplace_back(c);
      return out;
    }
    // Rank `rank` of `size` across processes; `id` comes from ncclGetUniqueId on rank 0 and is
    // shipped to the others by whatever launcher the program has (MPI, a file).
    static communicator init_rank(int size, ncclUniqueId id, int rank) {
      ncclComm_t c = nullptr;
      check(ncclCommInitRank(&c, size, id, rank), "ncclCommInitRank", rank);
      return communicator(c);
    }

   private:
    static void destroy(std::atomic<ncclComm_t>* p) { if (const ncclComm_t c = p->load()) ncclCommDestroy(c); delete p; }
    std::shared_ptr<std::atomic<ncclComm_t>> c_;  // holds null once aborted
  };

  using space_type = device::cuda_space;
  static constexpr std::size_t segment_bytes = pipeline::whole_chunk;

  // Nothing travels with a request but where a receive lands: the stream holds the order.
  struct request { void* dst = nullptr; };

  nccl() = default;
  nccl(communicator comm, cudaStream_t stream) : comm_(std::move(comm)), stream_(stream) {
    check(ncclCommUserRank(comm_.get(), &rank_), "ncclCommUserRank", -1, -1, comm_.get());
    check(ncclCommCount(comm_.get(), &size_), "ncclCommCount", rank_, -1, comm_.get());
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  std::string name() const { return "nccl"; }
  cudaStream_t stream() const noexcept { return stream_; }
  ncclComm_t comm() const noexcept { return comm_.get(); }

  void group_begin() { check(ncclGroupStart(), "ncclGroupStart", rank_); }
  void group_end() { check(ncclGroupEnd(), "ncclGroupEnd", rank_, -1, comm_.get()); }

  request isend(int peer, std::uint32_t, const void* data, std::size_t bytes) {
    check_peer(peer, "send");
    check(ncclSend(data, bytes, ncclUint8, peer, comm_.get(), stream_), "ncclSend", rank_, peer, comm_.get());
    return {nullptr};
  }
  request irecv(int peer, std::uint32_t, void* data, std::size_t bytes) {
    check_peer(peer, "recv");
    check(ncclRecv(data, bytes, ncclUint8, peer, comm_.get(), stream_), "ncclRecv", rank_, peer, comm_.get());
    return {data};
  }
  bool wait(request&, clock::time_point) { return true; }
  // The bytes land in the receive's buffer; fn's kernels run behind the group that fills it.
  template <class F>
  bool consume(request& r, clock::time_point, F&& fn) { fn(static_cast<const std::byte*>(r.dst)); return true; }

  // Unblocks everything pending on the communicator; it cannot be used afterwards.
  void abort(const std::string&) { comm_.abort(); }
  // NCCL's asynchronous error (a peer's connection closed), polled by a request's wait; comm read once.
  std::string async_error() const {
    ncclResult_t r = ncclSuccess;
    if (const ncclComm_t c = comm_.get(); c && ncclCommGetAsyncError(c, &r) == ncclSuccess && r != ncclSuccess && r != ncclInProgress)
      return "NCCL reported an asynchronous error: " + why(r, c);
    return {};
  }

 private:
  void check_peer(int peer, const char* op) const {
    if (!comm_.get()) throw error(errc::aborted, op, rank_, peer, "the communicator was aborted, or never made");
    if (peer < 0 || peer >= size_)
      throw error(errc::invalid_argument, op, rank_, peer, "peer out of range for a group of " + std::to_string(size_));
  }

  communicator comm_;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0, size_ = 0;
};

static_assert(transport<nccl>);

}  // namespace lockstep::transport
