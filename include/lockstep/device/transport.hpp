// lockstep/device/transport.hpp: what a stream-ordered transport must provide.
//
// The device twin of transport/concept.hpp. The difference is when things happen: every operation
// is enqueued on the endpoint's CUDA stream and returns at once; "the data is there" is a fact about
// the stream, never about the host. The host may block only while a peer has not yet *enqueued*
// its side (inproc_device ranks are threads), never while the GPU works.
//
//   t.rank(), t.size(), t.name()           as on the host
//   t.stream()                             the stream every operation is ordered on
//   t.group_begin(), t.group_end()         sends and receives posted in between progress together
//                                          (NCCL's group semantics: a ring step posts its send and
//                                          its receive as one group, or two ranks deadlock)
//   t.isend(peer, tag, src, bytes)         send the bytes that are at src at this point of the stream;
//                                          src must stay unmodified until wait(req)
//   t.irecv(peer, tag, dst, bytes)         receive into dst; dst holds the bytes after wait(req)
//   t.wait(req, deadline) -> bool          orders the stream after the request; false when the
//                                          peer did not enqueue its side by the deadline
//   t.abort(reason)                        tell the other ranks this one failed (best effort)
// A borrowing transport (ranks share one GPU) also hands the receiver the sender's device memory:
//   t.borrow(peer, tag, bytes, deadline) -> view   the stream is ordered after the sender's bytes
//   t.release(view)                                 the reads enqueued so far are the last ones
#pragma once

#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../transport/concept.hpp"

namespace lockstep::device {

template <class T>
concept stream_transport = requires(T& t, const T& ct, int peer, std::uint32_t tag, const void* src, void* dst,
                                    std::size_t bytes, typename T::request& req,
                                    transport::clock::time_point deadline) {
  { ct.rank() } -> std::same_as<int>;
  { ct.size() } -> std::same_as<int>;
  { ct.name() } -> std::convertible_to<std::string>;
  { ct.stream() } -> std::same_as<cudaStream_t>;
  t.group_begin();
  t.group_end();
  { t.isend(peer, tag, src, bytes) } -> std::same_as<typename T::request>;
  { t.irecv(peer, tag, dst, bytes) } -> std::same_as<typename T::request>;
  { t.wait(req, deadline) } -> std::same_as<bool>;
  t.abort(std::string{});
};

template <class T>
concept borrowing_stream_transport = stream_transport<T> && requires(T& t, int peer, std::uint32_t tag, std::size_t bytes,
                                                                     transport::clock::time_point deadline,
                                                                     typename T::view& v) {
  { t.borrow(peer, tag, bytes, deadline) } -> std::same_as<typename T::view>;
  t.release(v);
};

}  // namespace lockstep::device
