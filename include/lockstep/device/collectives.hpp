// lockstep/device/collectives.hpp: all_reduce, reduce_scatter, all_gather and broadcast over device
// buffers, each in an asynchronous form (enqueue, return a request) and a blocking one (the same,
// then request.wait()).
//
//   device::group<transport::nccl> g(transport::nccl(comm, stream));
//   auto r = device::all_reduce_async(g, grads, topology::ring{}, codec, reduce_op::average);
//   ... enqueue more work on g.stream() ...  r.wait();
//
// Spans hold device memory. The codec, the buffers and the group must outlive the request; the
// stream orders everything, so work enqueued on g.stream() after the call sees the result without
// any wait. An epilogue is called as ep(first, count, stream) and enqueues its own kernels.
#pragma once

#include "config.hpp"

#include <span>
#include <string>

#include "../collective/collectives.hpp"  // topology_fingerprint, describe
#include "executor.hpp"

namespace lockstep::device {

template <stream_transport Tr, topology::topology T, codec::codec C, class Epilogue = no_epilogue>
request all_reduce_async(group<Tr>& g, std::span<float> buf, const T& topo, C& codec, reduce_op op = reduce_op::sum,
                         Epilogue ep = {}) {
  auto d = lockstep::detail::describe(lockstep::detail::op_kind::all_reduce, g, topo, codec, op);
  const auto s = topology::all_reduce_schedule(topo, g.rank(), g.size());
  detail::run_schedule(g, s, buf, codec, d, ep);
  return g.make_request(d.label);
}

template <stream_transport Tr, topology::topology T, codec::codec C, class Epilogue = no_epilogue>
void all_reduce(group<Tr>& g, std::span<float> buf, const T& topo, C& codec, reduce_op op = reduce_op::sum, Epilogue ep = {}) {
  all_reduce_async(g, buf, topo, codec, op, ep).wait();
}

// buf: n elements cut into size chunks (chunk_range); afterwards this rank's chunk holds the
// reduction, the others partial sums.
template <stream_transport Tr, topology::topology T, codec::codec C, class Epilogue = no_epilogue>
request reduce_scatter_inplace_async(group<Tr>& g, std::span<float> buf, const T& topo, C& codec,
                                     reduce_op op = reduce_op::sum, Epilogue ep = {}) {
  auto d = lockstep::detail::describe(lockstep::detail::op_kind::reduce_scatter, g, topo, codec, op);
  const auto s = topo.reduce_scatter(g.rank(), g.size());
  detail::run_schedule(g, s, buf, codec, d, ep);
  return g.make_request(d.label);
}

// buf: n elements cut into size chunks; this rank's chunk is its input, the rest is filled.
template <stream_transport Tr, topology::topology T, codec::codec C, class Epilogue = no_epilogue>
request all_gather_inplace_async(group<Tr>& g, std::span<float> buf, const T& topo, C& codec, Epilogue ep = {}) {
  auto d = lockstep::detail::describe(lockstep::detail::op_kind::all_gather, g, topo, codec, reduce_op::sum);
  const auto s = topo.all_gather(g.rank(), g.size());
  detail::run_schedule(g, s, buf, codec, d, ep);
  return g.make_request(d.label);
}

template <stream_transport Tr, topology::topology T, codec::codec C>
request broadcast_async(group<Tr>& g, std::span<float> buf, int root, const T& topo, C& codec) {
  if (root < 0 || root >= g.size())
    throw error(errc::invalid_argument, "broadcast", g.rank(), -1,
                "root " + std::to_string(root) + " outside a group of " + std::to_string(g.size()));
  auto d = lockstep::detail::describe(lockstep::detail::op_kind::broadcast, g, topo, codec, reduce_op::sum, root);
  const auto s = topology::broadcast_schedule(topo, root, g.rank(), g.size());
  no_epilogue ep;
  detail::run_schedule(g, s, buf, codec, d, ep);
  return g.make_request(d.label);
}

template <stream_transport Tr, topology::topology T, codec::codec C>
void broadcast(group<Tr>& g, std::span<float> buf, int root, const T& topo, C& codec) {
  broadcast_async(g, buf, root, topo, codec).wait();
}

}  // namespace lockstep::device
