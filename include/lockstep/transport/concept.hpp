// lockstep/transport/concept.hpp: how bytes move. A transport is a small point-to-point interface;
// collective code never knows which one it runs on.
//
//   t.rank(), t.size()                     this endpoint's place in its group
//   t.isend(peer, tag, data, bytes)        start a send; returns a request
//   t.irecv(peer, tag, data, bytes)        start a receive of exactly `bytes`; a message of another
//                                          size is an errc::mismatch, never a truncation
//   t.wait(req, deadline) -> bool          finish a request; false when the deadline passed first
//   t.consume(req, deadline, fn) -> bool   finish a posted receive by calling fn(const std::byte*)
//                                          once with its bytes where the transport holds them (the
//                                          receive's own buffer, a shared ring, the sender's memory);
//                                          they are valid only during fn, which may throw; false when
//                                          the deadline passed first (fn not called)
//   t.abort(reason)                        tell every other rank of the group this one failed (best
//                                          effort); their waits throw errc::aborted naming it. Where
//                                          the transport splits, every group split from the same
//                                          first group fails with it (docs/reliability.md)
//   t.name(), T::segment_bytes             printable name; segment size that pipelines well
// and optionally
//   t.split(color, key, deadline)          a new endpoint for the sub-group of equal colour, ranked
//                                          by (key, old rank); collective over the group
//   T::space_type                          the execution space its bytes live in (space::host if
//                                          absent); an ordered space makes a stream-ordered
//                                          transport: every call is enqueued on t.stream(), and
//                                          "the data is there" is a fact about the stream, never
//                                          about the host (inproc_stream.hpp, nccl.hpp)
//   t.group_begin(), t.group_end()         sends and receives posted in between progress together
//                                          (NCCL's group semantics: a ring step posts its sends and
//                                          receives as one group, or two ranks deadlock)
//   t.try_isend_fill(peer, tag, bytes, fill) -> std::optional<request>
//                                          a send whose payload fill(std::byte* dst) writes into
//                                          the transport's own buffer, complete at once; empty,
//                                          with nothing sent, where the whole message cannot be
//                                          taken now (never waits). The executor's add-and-forward
//                                          (mpi: the shared rings; docs/design.md)
//   T::sends_wait_for_receives             true: a send moves nothing before the peer's receive
//                                          is posted (the executor posts receives first)
//   t.async_error() -> std::string         a failure the transport learned of outside any call of
//                                          ours (NCCL's asynchronous errors: a peer that died, a
//                                          network error), or empty. A stream-ordered request's
//                                          wait polls it while the stream has not finished, so
//                                          the failure is reported at once, by its cause, not at
//                                          the timeout (as torch's NCCL watchdog does)
//   T::waits_end_the_transport             true: a wait that times out leaves the endpoint
//                                          unusable (Gloo closes its pairs), so the executor never
//                                          waits in short looks, only up to the call's deadline
// Messages between one pair of ranks with one tag are matched in the order they were sent.
// Destroying a send request that has not completed (its collective failed) must leave the peer no
// way to read the data afterwards: the transport withdraws the message, waits briefly for a peer
// that is reading it, or has copied the bytes already (an eager send), so the sender may free them.
// Where MPI cannot cancel a send, mpi.hpp says what the caller must keep alive instead.
//
// consume is how the executor reads every message: a reduce step decode-adds from wherever the bytes
// are (inproc: the sender's own buffer; mpi: the shared ring a node-local peer wrote them into), a
// copy step copies them into place unless they are there already. Each transport decides where
// the bytes are read; the executor has no branch per transport.
//
// A transport may also take a hint for sends whose bytes stay unchanged until they complete and that the
// receiver will copy, not add (an all-gather's): t.isend_in_place(peer, tag, data, bytes), a
// request like isend's (mpi: the receiver on the same node copies them out of this process).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/space.hpp"

namespace lockstep::transport {

using clock = std::chrono::steady_clock;

namespace detail {
// A consume callback for the concept check (nvcc takes no lambda in a requires-expression).
struct read_nothing {
  void operator()(const std::byte*) const noexcept {}
};
}  // namespace detail

template <class T>
concept transport = requires(T& t, const T& ct, int peer, std::uint32_t tag, const void* src,
                             void* dst, std::size_t bytes, typename T::request& req,
                             clock::time_point deadline) {
  { ct.rank() } -> std::same_as<int>;
  { ct.size() } -> std::same_as<int>;
  { ct.name() } -> std::convertible_to<std::string>;
  { T::segment_bytes } -> std::convertible_to<std::size_t>;
  { t.isend(peer, tag, src, bytes) } -> std::same_as<typename T::request>;
  { t.irecv(peer, tag, dst, bytes) } -> std::same_as<typename T::request>;
  { t.wait(req, deadline) } -> std::same_as<bool>;
  { t.consume(req, deadline, detail::read_nothing{}) } -> std::same_as<bool>;
  t.abort(std::string{});
};

template <class T>
concept splittable = transport<T> && requires(T& t, int color, int key, clock::time_point deadline) {
  { t.split(color, key, deadline) } -> std::same_as<T>;
};

namespace detail {
template <class T>
struct space_of {
  using type = space::host;
};
template <class T>
  requires requires { typename T::space_type; }
struct space_of<T> {
  using type = typename T::space_type;
};
}  // namespace detail

// The execution space a transport's bytes live in.
template <class T>
using space_of = typename detail::space_of<T>::type;

}  // namespace lockstep::transport
