// lockstep/device/executor.hpp: the schedule walker for device buffers, stream ordered.
//
// It walks the same topology::schedule the host executor walks (collective/executor.hpp), with the
// same wire layout and the same order of quantisations, but instead of doing the work it enqueues
// it on the group's stream: encode kernels, the transport's sends and receives (one group per
// step, as NCCL needs), decode-add kernels. Nothing in here waits for the GPU. The host blocks only
// where a borrowing transport waits for a peer *thread* to post its side, bounded by the timeout.
//
// Per step: encode every chunk of the send span into its wire slot (reduce-scatter only: in the
// all-gather the wire slot already holds the owner's bytes, forwarded unchanged), post the sends and
// receives, then decode-add (reduce) or copy-and-decode (copy) every received chunk. A chunk is one
// message: kernels cover a whole chunk, so the host's segment pipelining has no counterpart here
// (the GPU overlaps ranks, not segments). The epilogue, ep(first, count, stream), enqueues its own
// work (the optimizer's update) right behind the step that made a range final.
//
// Differences from the host executor, and why:
//   - no header exchange: checking the peer's call needs its header on the host, i.e. a host sync
//     on NCCL. inproc_device still checks every message's size (errc::mismatch);
//   - error feedback keeps its residuals in the group (device memory), keyed by the codec object.
#pragma once

#include "config.hpp"

#include <span>
#include <string>
#include <vector>

#include "../codec/concept.hpp"
#include "../collective/executor.hpp"  // reduce_op, chunk_range, detail::op_desc
#include "../topology/concept.hpp"
#include "codec.hpp"
#include "group.hpp"
#include "transport.hpp"

namespace lockstep::device {

// Called as ep(first, count, stream) for every element range that is final on this rank.
struct no_epilogue {
  constexpr void operator()(std::size_t, std::size_t, cudaStream_t) const noexcept {}
};

namespace kernels {
// x /= divisor, rounded as the host's `x[i] /= float(size)`.
static __global__ void divide(float* __restrict__ x, std::size_t n, float divisor) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    x[i] = __fdiv_rn(x[i], divisor);
}
}  // namespace kernels

namespace detail {

template <stream_transport T, codec::codec C, class Epilogue>
void run_schedule(group<T>& g, const topology::schedule& s, std::span<float> buf, C& codec,
                  const lockstep::detail::op_desc& op, Epilogue& ep) {
  using topology::action;
  using topology::phase;
  using lockstep::detail::op_kind;
  T& t = g.transport();
  const cudaStream_t st = g.stream();
  const int rank = g.rank(), size = g.size();
  const std::size_t n = buf.size();
  float* const x = buf.data();
  constexpr bool identity = C::identity;
  constexpr bool borrowing = borrowing_stream_transport<T>;

  if (!x && n) throw error(errc::invalid_argument, op.label, rank, -1, "null buffer with " + std::to_string(n) + " elements");
  if (n > lockstep::detail::max_count)
    throw error(errc::invalid_argument, op.label, rank, -1, "count " + std::to_string(n) + " overflows the wire format");
  const std::uint64_t seq = g.next_sequence();

  // Wire layout in scratch: chunk c encoded as one unit at wire + wire_off[c]. // (chunk)
  const std::uint32_t chunks = s.chunks;
  auto range = [&](std::uint32_t c) { return chunk_range(n, chunks, c); };
  std::vector<std::size_t> wire_off(chunks + 1, 0);
  for (std::uint32_t c = 0; c < chunks; ++c) {
    const auto [lo, hi] = range(c);
    wire_off[c + 1] = wire_off[c] + codec.wire_bytes(hi - lo);
  }
  std::byte* const wire = g.scratch(wire_off[chunks]);
  typename group<T>::nest nested(&g);  // a collective run by an epilogue gets scratch of its own
  auto msg_bytes = [&](std::size_t len) { return identity ? len * sizeof(float) : codec.wire_bytes(len); };
  auto encode = [&](std::uint32_t c, int ef_phase) {
    const auto [lo, hi] = range(c);
    if constexpr (codec::feedback_codec<C>)
      device::encode(codec, x + lo, hi - lo, wire + wire_off[c], st, g.residual(codec, x, n, ef_phase) + lo);
    else
      device::encode(codec, x + lo, hi - lo, wire + wire_off[c], st);
  };
  // Replace a final chunk by its decoded wire image, so that every rank ends with the same bits.
  auto settle = [&](topology::chunk_span span, int ef_phase) {
    for (std::uint32_t c = span.first; c < span.end(); ++c) {
      const auto [lo, hi] = range(c);
      if (hi == lo) continue;
      encode(c, ef_phase);
      device::decode(codec, wire + wire_off[c], hi - lo, x + lo, st);
    }
  };
  auto fail = [&](errc code, int peer, const std::string& what) { return error(code, op.label, rank, peer, what); };
  auto timeout_text = [&](const char* waiting, std::size_t si) {
    return std::string("no ") + waiting + " within " + std::to_string(g.options().timeout.count()) + " ms at step " +
           std::to_string(si) + " of " + std::to_string(s.steps.size()) + " (call #" + std::to_string(seq) + ")";
  };

  try {
    const bool gathers = op.kind == op_kind::all_reduce || op.kind == op_kind::all_gather;
    const bool owns = gathers || op.kind == op_kind::reduce_scatter;
    bool finalized = !owns;
    auto finalize = [&] {
      finalized = true;
      const std::size_t lo = range(s.owned.first).first, hi = range(s.owned.end() - 1).second;
      if (op.rop == reduce_op::average && op.kind != op_kind::all_gather && hi > lo) {
        kernels::divide<<<grid_for((hi - lo + 255) / 256, elementwise_policy::blocks_per_sm), 256, 0, st>>>(
            x + lo, hi - lo, static_cast<float>(size));
        check_launch("average");
      }
      if (gathers && !identity && size > 1) settle(s.owned, 1);
      if (hi > lo) ep(lo, hi - lo, st);
    };
    auto finalize_if_due = [&](std::size_t next) {
      if (!finalized && (next == s.steps.size() || s.steps[next].phase != phase::reduce_scatter)) finalize();
    };
    if (op.kind == op_kind::broadcast && rank == op.root) {
      if (!identity && size > 1) settle({0, chunks}, 2);
      if (n) ep(0, n, st);
    }
    finalize_if_due(0);

    std::vector<typename T::request> sends, recvs;
    for (std::size_t si = 0; si < s.steps.size(); ++si) {
      const topology::step& sp = s.steps[si];
      const std::uint32_t tag = (static_cast<std::uint32_t>(seq & 0x7fff) << 9) | static_cast<std::uint32_t>(si & 0x1ff);
      const bool reduce = sp.act == action::reduce;
      const topology::chunk_span send = sp.send_peer >= 0 ? sp.send : topology::chunk_span{};
      const topology::chunk_span recv = sp.recv_peer >= 0 ? sp.recv : topology::chunk_span{};
      auto len_of = [&](std::uint32_t c) { return range(c).second - range(c).first; };

      if (!identity && sp.phase == phase::reduce_scatter)
        for (std::uint32_t c = send.first; c < send.end(); ++c)
          if (len_of(c)) encode(c, 0);
      sends.clear();
      recvs.clear();
      t.group_begin();
      for (std::uint32_t c = send.first; c < send.end(); ++c) {
        if (!len_of(c)) continue;  // empty chunks (n < size) travel as no message at all
        const void* src = identity ? static_cast<const void*>(x + range(c).first) : static_cast<const void*>(wire + wire_off[c]);
        sends.push_back(t.isend(sp.send_peer, tag, src, msg_bytes(len_of(c))));
      }
      if constexpr (!borrowing) {
        for (std::uint32_t c = recv.first; c < recv.end(); ++c) {
          if (!len_of(c)) continue;
          void* dst = (identity && !reduce) ? static_cast<void*>(x + range(c).first) : static_cast<void*>(wire + wire_off[c]);
          recvs.push_back(t.irecv(sp.recv_peer, tag, dst, msg_bytes(len_of(c))));
        }
      }
      t.group_end();

      std::size_t k = 0;
      for (std::uint32_t c = recv.first; c < recv.end(); ++c) {
        const auto [lo, hi] = range(c);
        if (hi == lo) continue;
        std::byte* slot = wire + wire_off[c];
        if constexpr (borrowing) {
          auto v = t.borrow(sp.recv_peer, tag, msg_bytes(hi - lo), g.deadline());
          if (!v.data) throw fail(errc::timeout, sp.recv_peer, timeout_text("data from the peer", si));
          if (reduce) {
            device::decode_add(codec, v.data, hi - lo, x + lo, st);
          } else if constexpr (identity) {
            check(cudaMemcpyAsync(x + lo, v.data, (hi - lo) * sizeof(float), cudaMemcpyDeviceToDevice, st), "all_gather copy");
          } else {
            // Keep the wire bytes: a later all-gather step forwards them unchanged.
            check(cudaMemcpyAsync(slot, v.data, msg_bytes(hi - lo), cudaMemcpyDeviceToDevice, st), "all_gather copy");
            device::decode(codec, slot, hi - lo, x + lo, st);
          }
          t.release(v);
        } else {
          if (!t.wait(recvs[k++], g.deadline())) throw fail(errc::timeout, sp.recv_peer, timeout_text("data from the peer", si));
          if (reduce) device::decode_add(codec, slot, hi - lo, x + lo, st);
          else if constexpr (!identity) device::decode(codec, slot, hi - lo, x + lo, st);
        }
        if (!reduce) ep(lo, hi - lo, st);
      }
      for (auto& r : sends)
        if (!t.wait(r, g.deadline())) throw fail(errc::timeout, sp.send_peer, timeout_text("receipt of sent data by the peer", si));
      finalize_if_due(si + 1);
    }
  } catch (const error& e) {
    t.abort(e.what());
    if (e.op() == op.label) throw;
    throw error(e.code(), op.label, rank, e.peer(), e.detail());
  }
}

}  // namespace detail
}  // namespace lockstep::device
