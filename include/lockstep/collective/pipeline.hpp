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

}  // namespace lockstep::pipeline
