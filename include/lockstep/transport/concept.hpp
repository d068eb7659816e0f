// lockstep/transport/concept.hpp: how bytes move. A transport is a small point-to-point interface;
// collective code never knows which one it runs on.
//
//   t.rank(), t.size()                     this endpoint's place in its group
//   t.isend(peer, tag, data, bytes)        start a send; returns a request
//   t.irecv(peer, tag, data, bytes)        start a receive of exactly `bytes`; a message of another
//                                          size is an errc::mismatch, never a truncation
//   t.wait(req, deadline) -> bool          finish a request; false when the deadline passed first
//   t.split(color, key, deadline)          a new endpoint for the sub-group of equal colour, ranked
//                                          by (key, old rank); collective over the group
//   t.abort(reason)                        tell the other ranks this one failed (best effort)
//   t.name(), T::segment_bytes             printable name; segment size that pipelines well
// Messages between one pair of ranks with one tag are matched in the order they were sent.
// Destroying a send request that has not completed (its collective failed) must leave the peer no
// way to read the data afterwards: the transport withdraws the message, waits briefly for a peer
// that is reading it, or has copied the bytes already (an eager send), so the sender may free them.
// Where MPI cannot cancel a send, mpi.hpp says what the caller must keep alive instead.
//
// A borrowing transport (ranks share memory) can also hand the receiver the sender's bytes:
//   t.borrow(peer, tag, bytes, deadline) -> view   (view.data == nullptr: the deadline passed)
//   t.release(view)                                the sender's request completes
// so that decode-add reads the sender's buffer directly, with no copy in between.
//
// A viewing transport finishes a posted receive without its last copy:
//   t.wait_view(req, deadline) -> view      the received bytes where they lie (view.data, .bytes;
//                                          view.ok == false: the deadline passed)
//   t.release(view)                         done reading them
// (mpi: bytes from a peer on the same node are read in the shared ring they arrived in.)
// It may also take a hint for sends whose bytes stay unchanged until they complete and that the
// receiver will copy, not add (an all-gather's): t.isend_in_place(peer, tag, data, bytes), a
// request like isend's (mpi: the receiver on the same node copies them out of this process).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

namespace lockstep::transport {

using clock = std::chrono::steady_clock;

template <class T>
concept transport = requires(T& t, const T& ct, int peer, std::uint32_t tag, const void* src,
                             void* dst, std::size_t bytes, typename T::request& req,
                             clock::time_point deadline, int color, int key) {
  { ct.rank() } -> std::same_as<int>;
  { ct.size() } -> std::same_as<int>;
  { ct.name() } -> std::convertible_to<std::string>;
  { T::segment_bytes } -> std::convertible_to<std::size_t>;
  { t.isend(peer, tag, src, bytes) } -> std::same_as<typename T::request>;
  { t.irecv(peer, tag, dst, bytes) } -> std::same_as<typename T::request>;
  { t.wait(req, deadline) } -> std::same_as<bool>;
  { t.split(color, key, deadline) } -> std::same_as<T>;
  t.abort(std::string{});
};

template <class T>
concept borrowing_transport = transport<T> && requires(T& t, int peer, std::uint32_t tag,
                                                       std::size_t bytes, clock::time_point deadline,
                                                       typename T::view& v) {
  { t.borrow(peer, tag, bytes, deadline) } -> std::same_as<typename T::view>;
  t.release(v);
};

template <class T>
concept viewing_transport = transport<T> && requires(T& t, typename T::request& req, clock::time_point deadline,
                                                     typename T::view& v) {
  { t.wait_view(req, deadline) } -> std::same_as<typename T::view>;
  t.release(v);
};

}  // namespace lockstep::transport
