// lockstep/topology/concept.hpp: what a topology must provide.
//
//   t.name()                        printable name
//   t.reduce_scatter(rank, size)    schedule that leaves rank r owning the reduced chunk r of
//                                   `size` chunks
//   t.all_gather(rank, size)        schedule that starts from "rank r owns chunk r" and ends with
//                                   every rank holding every chunk
//   t.validate(size)                throws lockstep::error when the topology cannot span `size`
//                                   ranks (a torus shape that does not match, say)
// and optionally
//   t.validate(size, rank)          the same, naming the calling rank in the error
//   t.symmetry(size)                a grid_symmetry (topology/symmetry.hpp): every rank's schedule
//                                   is rank 0's with the peers translated on an R x C grid; the
//                                   simulator then runs one rank instead of all of them
//   t.all_reduce(rank, size)        an all-reduce schedule of its own (recursive doubling), used
//                                   instead of reduce_scatter followed by all_gather
//   t.broadcast(root, rank, size)   a broadcast schedule of its own (a binomial tree), used
//                                   instead of scatter_from(root) followed by all_gather
// Topologies are small values (torus2d carries its shape).
#pragma once

#include <concepts>
#include <cstdint>
#include <string>

#include "schedule.hpp"

namespace lockstep::topology {

template <class T>
concept topology = requires(const T& t, int rank, int size) {
  { t.name() } -> std::convertible_to<std::string>;
  { t.reduce_scatter(rank, size) } -> std::same_as<schedule>;
  { t.all_gather(rank, size) } -> std::same_as<schedule>;
  t.validate(size);
};

// A topology chosen per call (topology::automatic): it names itself so, and the collectives ask
// it for a concrete topology per call (collective/collectives.hpp); the rest of the library sees
// only the concrete one.
template <class T>
concept per_call = requires { typename T::chooses_per_call; };

// The operation a per-call choice is for (each has its own schedule).
enum class operation : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast };

// What the collectives accept: a topology, or one chosen per call.
template <class T>
concept topology_policy = topology<T> || per_call<T>;

template <topology T>
schedule all_reduce_schedule(const T& t, int rank, int size) {
  if constexpr (requires { { t.all_reduce(rank, size) } -> std::same_as<schedule>; }) return t.all_reduce(rank, size);
  schedule s = t.reduce_scatter(rank, size);
  s.append(t.all_gather(rank, size));
  return s;
}

template <topology T>
schedule broadcast_schedule(const T& t, int root, int rank, int size) {
  if constexpr (requires { { t.broadcast(root, rank, size) } -> std::same_as<schedule>; })
    return t.broadcast(root, rank, size);
  schedule s = scatter_from(root, rank, size);
  s.append(t.all_gather(rank, size));
  return s;
}

}  // namespace lockstep::topology
