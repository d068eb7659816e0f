// lockstep/collective/collectives.hpp: all_reduce, reduce_scatter, all_gather, broadcast, barrier,
// each blocking and asynchronous, over any group (host or stream-ordered), topology and codec.
//
//   lockstep::all_reduce(g, grads, topology::torus2d{}, codec, reduce_op::average);
//   auto r = lockstep::all_reduce_async(g, bucket, topology::ring{}, codec);  ...  r.wait();
//
// The codec is taken by reference because error_feedback<C> keeps state in it; it and the buffers
// must outlive an asynchronous call. An epilogue, callable as ep(first, count), sees every element
// range the moment its final value is in place on this rank (the optimizer's fused update); on a
// stream-ordered group the moment its work is enqueued, and it enqueues its own on g.stream().
// On a stream-ordered group buffers live in the transport's space (device memory for a GPU), and a
// blocking call returns once the stream has run it.
#pragma once

#include <exception>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../codec/concept.hpp"
#include "../codec/fp32.hpp"
#include "../topology/concept.hpp"
#include "../topology/ring.hpp"
#include "executor.hpp"
#include "group.hpp"

namespace lockstep {

namespace detail {

template <class T, class C>
std::string label(op_kind kind, const T& topo, const C& codec, std::string_view topo_prefix = {}) {
  std::string s(to_string(kind));
  s += "(";
  s += topo_prefix;
  s += topo.name();
  s += ", ";
  s += codec.name();
  s += ")";
  return s;
}

template <class G, topology::topology T, codec::codec C>
op_desc describe(op_kind kind, const G& g, const T& topo, const C& codec, reduce_op rop, int root = -1,
                 std::string_view topo_prefix = {}) {
  if constexpr (requires { topo.validate(g.size(), g.rank()); }) topo.validate(g.size(), g.rank());  // names this rank
  else topo.validate(g.size());
  return op_desc{kind, rop, root, topology_fingerprint(topo, g.size()), label(kind, topo, codec, topo_prefix)};
}

template <class G>
void check_sizes(const G& g, const char* op, std::size_t in, std::size_t out, std::size_t per_rank_of,
                 const char* in_name, const char* out_name) {
  const auto size = static_cast<std::size_t>(g.size());
  if (per_rank_of > max_count / size || in != per_rank_of * size)
    throw error(errc::invalid_argument, op, g.rank(), -1,
                std::string(in_name) + " has " + std::to_string(in) + " elements; expected group size " +
                    std::to_string(size) + " x " + out_name + " (" + std::to_string(out) + ")");
}

// One collective over a concrete topology: validation, schedule, the walk. segment_bytes: the
// call's own segment size (0: the group's).
template <class G, topology::topology T, class C, class Epilogue>
void run_call(op_kind kind, G& g, std::span<float> buf, const T& topo, C& codec, reduce_op rop, int root, Epilogue& ep,
              chunk_layout layout = {}, std::size_t segment_bytes = 0, std::string_view label_prefix = {},
              const void* residual_key = nullptr) {
  op_desc d = describe(kind, g, topo, codec, rop, root, label_prefix);
  d.layout = std::move(layout);
  d.segment_bytes = segment_bytes;
  d.residual_key = residual_key;
  const topology::schedule s = kind == op_kind::reduce_scatter ? topo.reduce_scatter(g.rank(), g.size())
                               : kind == op_kind::all_gather   ? topo.all_gather(g.rank(), g.size())
                               : kind == op_kind::broadcast    ? topology::broadcast_schedule(topo, root, g.rank(), g.size())
                                                               : topology::all_reduce_schedule(topo, g.rank(), g.size());
  run_schedule(g, s, buf, codec, d, ep);
}

// The whole call of one collective, to run now or later. A topology chosen per call
// (topology::automatic) picks a concrete one and a segment size here, on the thread that runs
// the call, from inputs every rank shares (group size, count, codec).
template <class G, class T, class C, class Epilogue>
auto call(op_kind kind, G& g, std::span<float> buf, const T& topo, C& codec, reduce_op rop, int root, Epilogue ep,
          chunk_layout layout = {}, const void* residual_key = nullptr) {
  if constexpr (topology::per_call<T>) {
    // The choice is made here, as the call is issued: it depends on nothing the call's turn
    // changes, and the call then carries the few bytes of the choice, not a copy of the chooser
    // (automatic's parameters and tables: a tenth of a 2-rank 4 KiB all-reduce).
    using topology::operation;
    const operation op = kind == op_kind::reduce_scatter ? operation::reduce_scatter
                         : kind == op_kind::all_gather   ? operation::all_gather
                         : kind == op_kind::broadcast    ? operation::broadcast
                                                         : operation::all_reduce;
    // An error choosing (a bad LOCKSTEP_TOPOLOGY) is the call's: thrown in its turn, so that an
    // asynchronous call hands it to wait() as every other error it meets (request.hpp).
    // (The choice's type through T: this header does not include automatic.hpp.)
    std::remove_cvref_t<decltype(topo.choose(op, g.size(), buf.size(), codec, g.segment_bytes(), G::ordered, g.rank()))> pick{};
    std::exception_ptr failed;
    try {
      // Per-rank counts (all_gather_v, reduce_scatter_v) are predicted as the call cuts the buffer.
      pick = topo.choose(op, g.size(), buf.size(), codec, g.segment_bytes(), G::ordered, g.rank(),
                         std::span<const std::size_t>(layout.offsets), layout.id);
    } catch (...) {
      failed = std::current_exception();
    }
    return [&g, kind, buf, pick, failed, &codec, rop, root, ep, layout = std::move(layout), residual_key]() mutable {
      if (failed) {
        // The peers, which chose, would wait out their timeout for this rank's headers: they are
        // told (a LOCKSTEP_TOPOLOGY that names no topology on this rank only, say).
        try {
          std::rethrow_exception(failed);
        } catch (const std::exception& e) {
          g.abort(e.what());
          throw;
        }
      }
      T::visit(pick.kind, [&](const auto& concrete) {
        run_call(kind, g, buf, concrete, codec, rop, root, ep, std::move(layout), pick.segment_bytes, "automatic: ",
                 residual_key);
      });
    };
  } else {
    return [&g, kind, buf, topo, &codec, rop, root, ep, layout = std::move(layout), residual_key]() mutable {
      run_call(kind, g, buf, topo, codec, rop, root, ep, std::move(layout), 0, {}, residual_key);
    };
  }
}

// Blocking: inline on a host group; enqueued and waited for on an ordered one.
template <class G, class T, class C, class Epilogue>
void run_now(op_kind kind, G& g, std::span<float> buf, const T& topo, C& codec, reduce_op rop, int root, Epilogue&& ep,
             chunk_layout layout = {}, const void* residual_key = nullptr) {
  auto fn = call(kind, g, buf, topo, codec, rop, root, std::ref(ep), std::move(layout), residual_key);
  if constexpr (G::ordered) g.submit(fn, label(kind, topo, codec)).wait();
  else g.run(fn);
}

// Asynchronous: the request completes when the call has finished on this rank.
template <class G, class T, class C, class Epilogue>
request run_later(op_kind kind, G& g, std::span<float> buf, const T& topo, C& codec, reduce_op rop, int root, Epilogue ep,
                  chunk_layout layout = {}) {
  return g.submit(call(kind, g, buf, topo, codec, rop, root, std::move(ep), std::move(layout)), label(kind, topo, codec));
}

// Per-rank counts: one per rank, summing to the buffer's size (checked here, naming the rank; that
// every rank was handed the same counts is checked by the header exchange).
template <class G>
chunk_layout layout_of(const G& g, const char* op, std::span<const std::size_t> counts, std::size_t buf_size) {
  const auto size = static_cast<std::size_t>(g.size());
  if (counts.size() != size)
    throw error(errc::invalid_argument, op, g.rank(), -1,
                std::to_string(counts.size()) + " per-rank counts for a group of " + std::to_string(size) + " ranks");
  std::size_t total = 0;
  for (std::size_t c : counts) {
    if (c > max_count - total)
      throw error(errc::invalid_argument, op, g.rank(), -1, "per-rank counts overflow the wire format");
    total += c;
  }
  chunk_layout l = chunk_layout::from_counts(counts);
  if (total != buf_size)
    throw error(errc::invalid_argument, op, g.rank(), -1,
                "buffer has " + std::to_string(buf_size) + " elements; the per-rank counts " + l.str() + " sum to " +
                    std::to_string(total));
  return l;
}

template <class G>
void check_own_count(const G& g, const char* op, std::span<const std::size_t> counts, std::size_t own, const char* what) {
  const auto r = static_cast<std::size_t>(g.rank());
  if (counts.size() == static_cast<std::size_t>(g.size()) && counts[r] != own)
    throw error(errc::invalid_argument, op, g.rank(), -1,
                std::string(what) + " has " + std::to_string(own) + " elements; this rank's count is " +
                    std::to_string(counts[r]));
}

inline void check_root(int root, int size, int rank) {
  if (root < 0 || root >= size)
    throw error(errc::invalid_argument, "broadcast", rank, -1,
                "root " + std::to_string(root) + " outside a group of " + std::to_string(size));
}

}  // namespace detail

// ---- all_reduce -------------------------------------------------------------------------------

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
void all_reduce(group<Tr>& g, std::span<float> buf, const T& topo, C& codec,
                reduce_op op = reduce_op::sum, Epilogue&& ep = {}) {
  detail::run_now(detail::op_kind::all_reduce, g, buf, topo, codec, op, -1, ep);
}

template <topology::topology_policy T = topology::ring, codec::codec C = codec::fp32, transport::transport Tr>
void all_reduce(group<Tr>& g, std::span<float> buf, reduce_op op = reduce_op::sum) {
  T topo{};
  C codec{};
  all_reduce(g, buf, topo, codec, op);
}

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
request all_reduce_async(group<Tr>& g, std::span<float> buf, const T& topo, C& codec,
                         reduce_op op = reduce_op::sum, Epilogue ep = {}) {
  return detail::run_later(detail::op_kind::all_reduce, g, buf, topo, codec, op, -1, std::move(ep));
}

// ---- reduce_scatter ---------------------------------------------------------------------------

// buf holds n elements cut into size chunks (chunk_range); afterwards this rank's chunk holds the
// reduction, the other chunks hold intermediate values (partial sums, or this rank's input where a
// sum went straight into a peer's message) and are not meant to be read.
template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
void reduce_scatter_inplace(group<Tr>& g, std::span<float> buf, const T& topo, C& codec,
                            reduce_op op = reduce_op::sum, Epilogue&& ep = {}) {
  detail::run_now(detail::op_kind::reduce_scatter, g, buf, topo, codec, op, -1, ep);
}

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
request reduce_scatter_inplace_async(group<Tr>& g, std::span<float> buf, const T& topo, C& codec,
                                     reduce_op op = reduce_op::sum, Epilogue ep = {}) {
  return detail::run_later(detail::op_kind::reduce_scatter, g, buf, topo, codec, op, -1, std::move(ep));
}

// in: size * m elements, out: m elements (chunk `rank` of the reduction). in is not modified.
template <transport::transport Tr, topology::topology_policy T, codec::codec C>
void reduce_scatter(group<Tr>& g, std::span<const float> in, std::span<float> out, const T& topo, C& codec,
                    reduce_op op = reduce_op::sum) {
  detail::check_sizes(g, "reduce_scatter", in.size(), out.size(), out.size(), "input", "output");
  auto& sp = g.space();
  auto mem = sp.allocate(in.size() * sizeof(float));  // the working copy, in the group's space
  float* work = reinterpret_cast<float*>(mem.data());
  sp.copy(work, in.data(), in.size() * sizeof(float));
  const std::size_t m = out.size(), r = static_cast<std::size_t>(g.rank());
  // Error feedback keys the residuals by `in`: the working copy is new every call.
  detail::run_now(detail::op_kind::reduce_scatter, g, std::span<float>(work, in.size()), topo, codec, op, -1,
                  [&](std::size_t first, std::size_t count) {
                    sp.copy(out.data() + (first - r * m), work + first, count * sizeof(float));
                  },
                  {}, in.data());
}

// ---- all_gather -------------------------------------------------------------------------------

// buf holds n elements cut into size chunks; this rank's chunk is its input, the rest is filled.
template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
void all_gather_inplace(group<Tr>& g, std::span<float> buf, const T& topo, C& codec, Epilogue&& ep = {}) {
  detail::run_now(detail::op_kind::all_gather, g, buf, topo, codec, reduce_op::sum, -1, ep);
}

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
request all_gather_inplace_async(group<Tr>& g, std::span<float> buf, const T& topo, C& codec, Epilogue ep = {}) {
  return detail::run_later(detail::op_kind::all_gather, g, buf, topo, codec, reduce_op::sum, -1, std::move(ep));
}

// in: m elements, out: size * m elements, rank r's input at [r*m, (r+1)*m).
template <transport::transport Tr, topology::topology_policy T, codec::codec C>
void all_gather(group<Tr>& g, std::span<const float> in, std::span<float> out, const T& topo, C& codec) {
  detail::check_sizes(g, "all_gather", out.size(), in.size(), in.size(), "output", "input");
  g.space().copy(out.data() + in.size() * static_cast<std::size_t>(g.rank()), in.data(), in.size() * sizeof(float));
  all_gather_inplace(g, out, topo, codec);
}

// ---- per-rank counts: all_gather_v, reduce_scatter_v ------------------------------------------
//
// MPI_Allgatherv / MPI_Reduce_scatter: rank k contributes (all_gather_v) or ends owning
// (reduce_scatter_v) counts[k] elements, at offset counts[0] + ... + counts[k-1] of the whole
// buffer. Counts may be zero (a rank with nothing; one-hot counts make reduce_scatter_v a reduce
// to that rank) and every rank passes the same counts: a rank handed others fails with
// errc::mismatch naming the peer, as any header disagreement does. The same schedules and codecs
// as the equal-count calls; only the chunk boundaries differ.

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
void all_gather_v_inplace(group<Tr>& g, std::span<float> buf, std::span<const std::size_t> counts, const T& topo,
                          C& codec, Epilogue&& ep = {}) {
  auto l = detail::layout_of(g, "all_gather_v", counts, buf.size());
  detail::run_now(detail::op_kind::all_gather, g, buf, topo, codec, reduce_op::sum, -1, ep, std::move(l));
}

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
request all_gather_v_inplace_async(group<Tr>& g, std::span<float> buf, std::span<const std::size_t> counts,
                                   const T& topo, C& codec, Epilogue ep = {}) {
  auto l = detail::layout_of(g, "all_gather_v", counts, buf.size());
  return detail::run_later(detail::op_kind::all_gather, g, buf, topo, codec, reduce_op::sum, -1, std::move(ep), std::move(l));
}

// in: counts[rank] elements, out: sum(counts), rank k's input at its offset.
template <transport::transport Tr, topology::topology_policy T, codec::codec C>
void all_gather_v(group<Tr>& g, std::span<const float> in, std::span<float> out, std::span<const std::size_t> counts,
                  const T& topo, C& codec) {
  auto l = detail::layout_of(g, "all_gather_v", counts, out.size());
  detail::check_own_count(g, "all_gather_v", counts, in.size(), "input");
  g.space().copy(out.data() + l.offsets[static_cast<std::size_t>(g.rank())], in.data(), in.size() * sizeof(float));
  detail::run_now(detail::op_kind::all_gather, g, out, topo, codec, reduce_op::sum, -1, no_epilogue{}, std::move(l));
}

// buf: sum(counts) elements; afterwards this rank's part holds the reduction (the other parts
// hold intermediate values, as reduce_scatter_inplace says, and are not meant to be read).
template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
void reduce_scatter_v_inplace(group<Tr>& g, std::span<float> buf, std::span<const std::size_t> counts, const T& topo,
                              C& codec, reduce_op op = reduce_op::sum, Epilogue&& ep = {}) {
  auto l = detail::layout_of(g, "reduce_scatter_v", counts, buf.size());
  detail::run_now(detail::op_kind::reduce_scatter, g, buf, topo, codec, op, -1, ep, std::move(l));
}

template <transport::transport Tr, topology::topology_policy T, codec::codec C, class Epilogue = no_epilogue>
request reduce_scatter_v_inplace_async(group<Tr>& g, std::span<float> buf, std::span<const std::size_t> counts,
                                       const T& topo, C& codec, reduce_op op = reduce_op::sum, Epilogue ep = {}) {
  auto l = detail::layout_of(g, "reduce_scatter_v", counts, buf.size());
  return detail::run_later(detail::op_kind::reduce_scatter, g, buf, topo, codec, op, -1, std::move(ep), std::move(l));
}

// in: sum(counts) elements, out: counts[rank] (this rank's part of the reduction). in is not modified.
template <transport::transport Tr, topology::topology_policy T, codec::codec C>
void reduce_scatter_v(group<Tr>& g, std::span<const float> in, std::span<float> out,
                      std::span<const std::size_t> counts, const T& topo, C& codec, reduce_op op = reduce_op::sum) {
  auto l = detail::layout_of(g, "reduce_scatter_v", counts, in.size());
  detail::check_own_count(g, "reduce_scatter_v", counts, out.size(), "output");
  auto& sp = g.space();
  auto mem = sp.allocate(in.size() * sizeof(float));
  float* work = reinterpret_cast<float*>(mem.data());
  sp.copy(work, in.data(), in.size() * sizeof(float));
  const std::size_t at = l.offsets[static_cast<std::size_t>(g.rank())];
  detail::run_now(detail::op_kind::reduce_scatter, g, std::span<float>(work, in.size()), topo, codec, op, -1,
                  [&](std::size_t first, std::size_t count) {
                    sp.copy(out.data() + (first - at), work + first, count * sizeof(float));
                  },
                  std::move(l), in.data());
}

// ---- broadcast, barrier -----------------------------------------------------------------------

// The root's buffer reaches every rank: scatter from the root, then the topology's all-gather.
// With a lossy codec the root's own buffer is replaced by the decoded values too, so that all
// ranks hold the same bits.
template <transport::transport Tr, topology::topology_policy T, codec::codec C>
void broadcast(group<Tr>& g, std::span<float> buf, int root, const T& topo, C& codec) {
  detail::check_root(root, g.size(), g.rank());
  detail::run_now(detail::op_kind::broadcast, g, buf, topo, codec, reduce_op::sum, root, no_epilogue{});
}

template <transport::transport Tr, topology::topology_policy T, codec::codec C>
request broadcast_async(group<Tr>& g, std::span<float> buf, int root, const T& topo, C& codec) {
  detail::check_root(root, g.size(), g.rank());
  return detail::run_later(detail::op_kind::broadcast, g, buf, topo, codec, reduce_op::sum, root, no_epilogue{});
}

template <transport::transport Tr, topology::topology T = topology::ring>
void barrier(group<Tr>& g, const T& topo = {}) {
  // One value per rank: each chunk is non-empty, so every rank waits for every other. The values
  // are never read, so the space's memory needs no initialising.
  const auto n = static_cast<std::size_t>(g.size());
  auto token = g.space().allocate(n * sizeof(float));
  codec::fp32 c;
  detail::run_now(detail::op_kind::barrier, g, std::span<float>(reinterpret_cast<float*>(token.data()), n), topo, c,
                  reduce_op::sum, -1, no_epilogue{});
}

}  // namespace lockstep
