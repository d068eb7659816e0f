// lockstep/collective/pipeline.hpp: how the executor pipelines a step, in one place. The executor,
// the cost model and the simulator all ask these functions, so what is simulated is what runs.
//
//   segment_elems(block, segment_bytes)   a step's chunks are cut into segments of this many
//                                         values (a multiple of the codec block, about
//                                         segment_bytes; a whole chunk where segment_bytes is
//                                         whole_chunk, as on a GPU: its kernels cover a chunk and
//                                         it overlaps ranks, not segments)
//   sends_ahead(identity, sends, ordered) the lag of a step's receives behind its sends: receive k
//                                         is read once send k + ahead is posted (so 5 sends go out
//                                         before the first read for lossy codecs; all of them
//                                         where ahead >= the step's send count)
//   finalize_step(schedule)               the step before which this rank's own chunk is final
//   fan_in_end(schedule, step)            the end of the fan-in that starts at a step (host groups:
//                                         the steps whose receives are read together, one pass)
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>

#include "../topology/schedule.hpp"

namespace lockstep::pipeline {

// A segment as large as any chunk.
inline constexpr std::size_t whole_chunk = std::numeric_limits<std::size_t>::max();

constexpr std::size_t segment_elems(std::size_t block, std::size_t segment_bytes) noexcept {
  block = std::max<std::size_t>(1, block);
  if (segment_bytes == whole_chunk) return whole_chunk / block * block;
  return std::max(block, segment_bytes / sizeof(float) / block * block);
}

// Lossy codecs: sends run 4 segments ahead of receives, so the per-message latency of a step
// overlaps instead of adding up segment after segment, while a neighbour decodes early segments as
// this rank still encodes later ones. fp32 has nothing to encode and posts every send at once;
// so does a stream-ordered transport, whose sends and receives of a step must be posted as one
// group (NCCL: two ranks that each post a lone send wait on each other forever). Receive k waits
// only on sends posted before it on every rank, so no rank can wait on itself around a ring.
inline constexpr std::size_t lossy_sends_ahead = 4;

constexpr std::size_t sends_ahead(bool identity, std::size_t sends, bool stream_ordered) noexcept {
  return identity || stream_ordered ? sends : lossy_sends_ahead;
}

// The index of the first step that is not part of the reduce-scatter: before it runs, the rank's
// owned chunk holds its final sum (steps.size() when every step reduces).
inline std::size_t finalize_step(const topology::schedule& s) noexcept {
  std::size_t i = 0;
  while (i < s.steps.size() && s.steps[i].phase == topology::phase::reduce_scatter) ++i;
  return i;
}

// Peers read together in one fan-in; a longer run is cut into fans of this many, back to back
// (the same additions in the same order: the same bits). It bounds what one fan holds: the
// executor's nested reads (one per peer), its landing area over a copying transport ((fan_max - 1)
// spans, not N - 2) and fan_in_end's scan of the run.
inline constexpr std::size_t fan_max = 16;

// The end of the run of steps from si that fan in; si + 1 where none does (every topology but
// topology::direct). A run: reduce-scatter steps that each receive the same span from another
// peer and send only chunks outside it, so that nothing they send depends on what they receive.
// A host group's executor posts every send and receive of the run at once and adds the copies of
// each segment in one pass (the running sum read and written once, not once per peer); the
// simulator costs it so. A stream does not (it adds on the device, one message after the other).
inline std::size_t fan_in_end(const topology::schedule& s, std::size_t si) noexcept {
  const topology::step& head = s.steps[si];
  auto fans = [&](const topology::step& st) {
    return st.phase == topology::phase::reduce_scatter && st.act == topology::action::reduce && st.send_peer >= 0 &&
           st.recv_peer >= 0 && !topology::is_exchange(st) && st.recv == head.recv && !st.send.overlaps(head.recv);
  };
  if (!fans(head)) return si + 1;
  std::size_t end = si + 1;
  auto new_peer = [&](int p) {
    for (std::size_t i = si; i < end; ++i)
      if (s.steps[i].recv_peer == p) return false;
    return true;
  };
  while (end < s.steps.size() && end - si < fan_max && fans(s.steps[end]) && new_peer(s.steps[end].recv_peer)) ++end;
  return end;
}

}  // namespace lockstep::pipeline
