// lockstep/collective/executor.hpp: the one piece of code that walks a schedule.
//
// For one rank, run_schedule takes the schedule its topology produced, a buffer of fp32 values, a
// codec and a transport, and moves chunks as the steps say. Per step, the send span and the
// receive span are cut into segments (a multiple of the codec's block, about segment_bytes each)
// and interleaved: encode segment k and post it, then decode-add (or copy) received segment k - 4;
// so the neighbour decodes early segments while this rank still encodes later ones, and message
// latencies within a step overlap. Values are summed in fp32 only; a lossy
// codec quantises each partial sum once, when it is sent, and the final value once, when its owner
// sends it to the all-gather. The wire bytes of a chunk are kept in the group's scratch and
// forwarded unchanged by later all-gather steps, so no value is quantised twice in that phase, and
// the owner replaces its own values by their decoded wire image, so every rank ends bitwise equal.
//
// Each rank sends every peer it will send to a header (op, count, codec, topology, root, segment
// size, call number) and checks the header of every peer it will receive from before it posts a
// receive, reads, encodes or finalises anything: a mismatch between ranks is an error naming both
// sides, never a truncation or a hang, and a failing call leaves this rank's buffer and its
// error-feedback residuals untouched. Only the first step's fp32 sends go out beside the headers
// (they change nothing here, and the peer reads them only after checking our header), which
// saves the round the headers would otherwise take on their own. (Checking each header lazily,
// just before that peer's data is used, let a rank run epilogues in a call that then fails; it
// was tried and dropped.)
#pragma once

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "../codec/concept.hpp"
#include "../core/error.hpp"
#include "../topology/concept.hpp"
#include "../transport/concept.hpp"
#include "group.hpp"

namespace lockstep {

enum class reduce_op : std::uint32_t { sum = 0, average = 1 };

// Called with (first, count) for every element range that is final on this rank.
struct no_epilogue {
  constexpr void operator()(std::size_t, std::size_t) const noexcept {}
};

// [first, last) of chunk c when n elements are cut into `chunks` pieces.
constexpr std::pair<std::size_t, std::size_t> chunk_range(std::size_t n, std::size_t chunks, std::size_t c) noexcept {
  using wide = unsigned __int128;
  return {static_cast<std::size_t>(wide(n) * c / chunks), static_cast<std::size_t>(wide(n) * (c + 1) / chunks)};
}

namespace detail {

enum class op_kind : std::uint32_t { all_reduce = 1, reduce_scatter, all_gather, broadcast, barrier };

constexpr const char* to_string(op_kind k) noexcept {
  switch (k) {
    case op_kind::all_reduce: return "all_reduce";
    case op_kind::reduce_scatter: return "reduce_scatter";
    case op_kind::all_gather: return "all_gather";
    case op_kind::broadcast: return "broadcast";
    case op_kind::barrier: return "barrier";
  }
  return "collective";
}

// Counts beyond this are rejected: chunk arithmetic and wire sizes stay far from overflow.
inline constexpr std::size_t max_count = std::size_t{1} << 48;

struct wire_header {
  std::uint32_t magic = 0x4c4b5354;  // "LKST"
  std::uint32_t kind = 0;
  std::uint32_t codec_id = 0;
  std::uint32_t topology_id = 0;
  std::uint32_t rop = 0;
  std::int32_t root = -1;
  std::uint64_t count = 0;
  std::uint64_t segment = 0;
  std::uint64_t seq = 0;
};

struct op_desc {
  op_kind kind;
  reduce_op rop = reduce_op::sum;
  int root = -1;
  std::uint32_t topology_id = 0;
  std::string label;  // "all_reduce(ring, bf16)"
};

inline std::string describe_mismatch(const wire_header& mine, const wire_header& theirs) {
  auto field = [](const char* what, auto a, auto b) {
    return std::string(what) + " " + std::to_string(a) + " here, " + std::to_string(b) + " on the peer";
  };
  if (theirs.magic != mine.magic) return "the peer sent something that is not a lockstep header";
  if (theirs.seq != mine.seq) return field("call number", mine.seq, theirs.seq) + " (ranks issued different numbers of collectives)";
  if (theirs.kind != mine.kind)
    return std::string("operation ") + to_string(static_cast<op_kind>(mine.kind)) + " here, " +
           to_string(static_cast<op_kind>(theirs.kind)) + " on the peer";
  if (theirs.count != mine.count) return field("element count", mine.count, theirs.count);
  if (theirs.codec_id != mine.codec_id) return "codecs differ (format or block size)";
  if (theirs.topology_id != mine.topology_id) return "topologies differ";
  if (theirs.rop != mine.rop) return "reduction ops differ (sum vs average)";
  if (theirs.root != mine.root) return field("root", mine.root, theirs.root);
  if (theirs.segment != mine.segment) return field("segment size", mine.segment, theirs.segment);
  return {};
}

template <transport::transport T, codec::codec C, class Epilogue>
void run_schedule(group<T>& g, const topology::schedule& s, std::span<float> buf, C& codec,
                  const op_desc& op, Epilogue& ep) {
  using topology::action;
  using topology::phase;
  T& t = g.transport();
  const int rank = g.rank(), size = g.size();
  const std::size_t n = buf.size();
  float* const x = buf.data();
  constexpr bool identity = C::identity;

  if (!x && n) throw error(errc::invalid_argument, op.label, rank, -1, "null buffer with " + std::to_string(n) + " elements");
  if (n > max_count) throw error(errc::invalid_argument, op.label, rank, -1, "count " + std::to_string(n) + " overflows the wire format");

  const std::size_t block = std::max<std::size_t>(1, codec.block());
  const std::size_t seg_bytes = g.segment_bytes();
  const std::size_t seg = std::max(block, seg_bytes / sizeof(float) / block * block);
  const std::uint64_t seq = g.next_sequence();

  // Wire layout in scratch: chunk c's segments back to back, each encoded on its own.
  const std::uint32_t chunks = s.chunks;
  auto chunk_of = [&](std::uint32_t c) { return chunk_range(n, chunks, c); };
  auto chunk_wire = [&](std::size_t len) { return len / seg * codec.wire_bytes(seg) + codec.wire_bytes(len % seg); };
  std::vector<std::size_t> wire_off(chunks + 1, 0);
  for (std::uint32_t c = 0; c < chunks; ++c) {
    auto [lo, hi] = chunk_of(c);
    wire_off[c + 1] = wire_off[c] + chunk_wire(hi - lo);
  }
  std::byte* const wire = g.scratch(wire_off[chunks]);
  // The fp32 wire is the values themselves: messages carry exactly 4n bytes, unpadded.
  auto msg_bytes = [&](std::size_t len) { return identity ? len * sizeof(float) : codec.wire_bytes(len); };

  struct segment {
    std::size_t lo, len;  // elements [lo, lo + len) of the buffer
    std::byte* wire;      // where its wire image lives in scratch
    std::uint32_t chunk;
    bool last;            // last segment of its chunk
  };
  auto cut = [&](topology::chunk_span span, std::vector<segment>& out) {
    out.clear();
    for (std::uint32_t c = span.first; c < span.end(); ++c) {
      auto [lo, hi] = chunk_of(c);
      std::byte* w = wire + wire_off[c];
      for (std::size_t a = lo; a < hi; a += seg) {
        const std::size_t len = std::min(seg, hi - a);
        out.push_back({a, len, w, c, a + len == hi});
        w += codec.wire_bytes(len);
      }
    }
  };
  auto encode = [&](const segment& sg, int ef_phase) {
    if constexpr (codec::feedback_codec<C>)
      codec.encode_with_residual(x + sg.lo, sg.len, sg.wire, codec.residual(x, n, ef_phase) + sg.lo);
    else
      codec.encode(x + sg.lo, sg.len, sg.wire);
  };

  auto fail = [&](errc code, int peer, const std::string& what) -> error {
    return error(code, op.label, rank, peer, what);
  };
  auto deadline = [&] { return g.deadline(); };
  auto timeout_text = [&](const char* waiting, std::size_t si) {
    return std::string("no ") + waiting + " after " + std::to_string(g.options().timeout.count()) +
           " ms at step " + std::to_string(si) + " of " + std::to_string(s.steps.size()) + " (call #" +
           std::to_string(seq) + ")";
  };

  // 1. Headers: to every peer we send to, from every peer we receive from. `mine` is declared
  // before the requests that send it, so it outlives them: a request that has not completed when
  // the call fails withdraws its message or waits for the peer that is reading it (inproc), and
  // only then is the header's storage gone.
  wire_header mine;
  mine.kind = static_cast<std::uint32_t>(op.kind);
  mine.codec_id = codec.id();
  mine.topology_id = op.topology_id;
  mine.rop = static_cast<std::uint32_t>(op.rop);
  mine.root = op.root;
  mine.count = n;
  mine.segment = seg;
  mine.seq = seq;
  std::vector<typename T::request> pending_headers;
  try {
    std::vector<int> to, from;
    for (const auto& st : s.steps) {
      if (st.send_peer >= 0 && std::find(to.begin(), to.end(), st.send_peer) == to.end()) to.push_back(st.send_peer);
      if (st.recv_peer >= 0 && std::find(from.begin(), from.end(), st.recv_peer) == from.end()) from.push_back(st.recv_peer);
    }
    const std::uint32_t header_tag = (1u << 24) | (static_cast<std::uint32_t>(seq & 0x7fff) << 9);
    for (int p : to) pending_headers.push_back(t.isend(p, header_tag, &mine, sizeof mine));
    std::vector<wire_header> theirs(from.size());
    std::vector<typename T::request> header_recvs;
    for (std::size_t i = 0; i < from.size(); ++i) header_recvs.push_back(t.irecv(from[i], header_tag, &theirs[i], sizeof(wire_header)));
    // Every peer's header is checked before this rank posts a receive (MPI starts copying a
    // matched message into the buffer while it waits for anything), reads a byte of data,
    // encodes (error feedback would change its residuals), or runs an epilogue. Only the first
    // step's fp32 sends go out before: they change nothing here, and a peer reads them only after
    // checking our header. So the headers travel beside the first data instead of costing a round
    // of their own.
    bool headers_checked = false;
    auto check_headers = [&] {
      if (headers_checked) return;
      headers_checked = true;
      for (std::size_t i = 0; i < from.size(); ++i) {
        if (!t.wait(header_recvs[i], deadline()))
          throw fail(errc::timeout, from[i], timeout_text("header from the peer: it has not entered this collective", 0));
        const std::string why = describe_mismatch(mine, theirs[i]);
        if (!why.empty()) throw fail(errc::mismatch, from[i], why);
      }
    };

    // 2. What this rank holds final before or after the reduce-scatter steps.
    const bool gathers = op.kind == op_kind::all_reduce || op.kind == op_kind::all_gather;
    const bool owns = gathers || op.kind == op_kind::reduce_scatter;
    std::vector<segment> sends, recvs;
    bool finalized = !owns;
    auto finalize = [&] {
      check_headers();
      finalized = true;
      auto [lo, hi] = chunk_range(n, chunks, s.owned.first);
      hi = chunk_range(n, chunks, s.owned.end() - 1).second;
      if (op.rop == reduce_op::average && op.kind != op_kind::all_gather) {
        const float inv_size = static_cast<float>(size);
        for (std::size_t i = lo; i < hi; ++i) x[i] /= inv_size;
      }
      if (gathers && !identity && size > 1) {
        cut(s.owned, sends);
        for (const segment& sg : sends) {
          encode(sg, 1);
          codec.decode(sg.wire, sg.len, x + sg.lo);
        }
      }
      if (hi > lo) ep(lo, hi - lo);
    };
    auto finalize_if_due = [&](std::size_t next) {
      if (!finalized && (next == s.steps.size() || s.steps[next].phase != phase::reduce_scatter)) finalize();
    };
    if (op.kind == op_kind::broadcast && rank == op.root) {
      check_headers();
      if (!identity && size > 1) {
        cut({0, chunks}, sends);
        for (const segment& sg : sends) {
          encode(sg, 2);
          codec.decode(sg.wire, sg.len, x + sg.lo);
        }
      }
      if (n) ep(0, n);
    }
    finalize_if_due(0);

    // 3. The steps.
    std::vector<typename T::request> send_reqs, recv_reqs;
    for (std::size_t si = 0; si < s.steps.size(); ++si) {
      const topology::step& st = s.steps[si];
      // Messages between two ranks are matched in send order (the schedule guarantees both sides
      // agree on it), so the tag only separates calls; a step number would differ between a
      // broadcast root's k-th send and its receiver's first step.
      const std::uint32_t tag = static_cast<std::uint32_t>(seq & 0x7fff) << 9;
      const bool reduce = st.act == action::reduce;
      sends.clear();
      recvs.clear();
      if (st.send_peer >= 0) cut(st.send, sends);
      if (st.recv_peer >= 0) cut(st.recv, recvs);
      send_reqs.clear();
      recv_reqs.clear();
      // Headers checked, then this step's receives posted (at the top of the step, or in the
      // first step just before the first encode or receive).
      bool posted = false;
      auto ready = [&] {
        check_headers();
        if (posted) return;
        posted = true;
        for (const segment& sg : recvs) {
          void* dst = (identity && !reduce) ? static_cast<void*>(x + sg.lo) : static_cast<void*>(sg.wire);
          recv_reqs.push_back(t.irecv(st.recv_peer, tag, dst, msg_bytes(sg.len)));
        }
      };
      if (headers_checked) ready();
      // Sends run ahead of receives by `ahead` segments, so that the per-message latency of a
      // step overlaps instead of adding up segment after segment; fp32 has nothing to encode and
      // posts every send at once. Receive k waits only on sends posted before it on every rank,
      // so no rank can wait on itself around the ring.
      const std::size_t ahead = identity ? sends.size() : 4;
      auto receive = [&](std::size_t k) {
        ready();
        const segment& sg = recvs[k];
        // Reduce steps add from wherever the bytes are; copy steps copy them into place (where a
        // plain receive would have put them) unless they are there already.
        void* const dst = (identity && !reduce) ? static_cast<void*>(x + sg.lo) : static_cast<void*>(sg.wire);
        const bool got = t.consume(recv_reqs[k], deadline(), [&](const std::byte* data) {
          if (reduce) {
            codec.decode_add(data, sg.len, x + sg.lo);
            return;
          }
          if (static_cast<const void*>(data) != dst) std::memcpy(dst, data, msg_bytes(sg.len));
          if constexpr (!identity) codec.decode(sg.wire, sg.len, x + sg.lo);
        });
        if (!got) throw fail(errc::timeout, st.recv_peer, timeout_text("data from the peer", si));
        if (!reduce && sg.last) {
          auto [lo, hi] = chunk_of(sg.chunk);
          ep(lo, hi - lo);
        }
      };
      std::size_t received = 0;
      for (std::size_t k = 0; k < sends.size(); ++k) {
        const segment& sg = sends[k];
        const void* src = x + sg.lo;
        if constexpr (!identity) {
          ready();
          if (st.phase == phase::reduce_scatter) encode(sg, 0);
          src = sg.wire;
        }
        // A copy step's bytes (final values, or wire bytes being forwarded) are not written again
        // in this call, and the receiver copies them: a transport that can let it read them here
        // is told so.
        send_reqs.push_back([&] {
          if constexpr (requires { t.isend_in_place(st.send_peer, tag, src, msg_bytes(sg.len)); })
            if (!reduce) return t.isend_in_place(st.send_peer, tag, src, msg_bytes(sg.len));
          return t.isend(st.send_peer, tag, src, msg_bytes(sg.len));
        }());
        while (received < recvs.size() && received + ahead <= k) receive(received++);
      }
      while (received < recvs.size()) receive(received++);
      check_headers();  // a step that only sends: a mismatch is reported, not waited out
      for (auto& r : send_reqs)
        if (!t.wait(r, deadline())) {
          // Where the transport tells (inproc: a send completes when the peer takes it), say
          // whether the peer ever took our header, i.e. entered this collective at all. Over MPI
          // a small send completes on its own (eager protocol), which tells nothing.
          const char* what = "receipt of sent data by the peer";
          if constexpr (requires { requires T::send_completion_means_taken; }) {
            const auto i = static_cast<std::size_t>(std::find(to.begin(), to.end(), st.send_peer) - to.begin());
            if (!t.wait(pending_headers[i], transport::clock::now()))
              what = "receipt of sent data by the peer: it has not entered this collective (it has not taken this rank's header)";
          }
          throw fail(errc::timeout, st.send_peer, timeout_text(what, si));
        }
      finalize_if_due(si + 1);
    }
    check_headers();
    for (std::size_t i = 0; i < pending_headers.size(); ++i)
      if (!t.wait(pending_headers[i], deadline()))
        throw fail(errc::timeout, to[i], timeout_text("receipt of the header by the peer", s.steps.size()));
  } catch (const error& e) {
    // Tell the others (inproc wakes them at once) and say where we were. Sends still pending are
    // settled by their requests' destructors on the way out (see above).
    t.abort(e.what());
    if (e.op() == op.label) throw;
    throw error(e.code(), op.label, rank, e.peer(), e.detail());
  }
}

}  // namespace detail
}  // namespace lockstep
