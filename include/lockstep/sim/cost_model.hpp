// lockstep/sim/cost_model.hpp: the alpha-beta-gamma cost of an all-reduce, in closed form.
//
//   alpha  seconds per message on the critical path (latency plus per-message software cost)
//   beta   seconds per wire byte on a link (1 / bandwidth)
//   gamma  seconds per element of codec work: encode, decode (copy) and decode-add
//
// A closed form counts what lies on the critical path of one rank when every rank moves in step:
// `messages` (segments: the executor waits for receive segment j before it posts send j+1), wire
// bytes (one-way and exchanged), and the elements each codec routine touches. It counts the
// executor's work exactly (segments a multiple of the codec block, wire sizes from
// codec.wire_bytes, the owner's encode + decode between the phases, no encode when an all-gather
// forwards wire bytes) but does not overlap codec work with transfer: it is exact when a step is
// one segment or gamma is 0 (with send_ahead, the executor variant that posts a step's sends at
// once: exact when gamma is 0), and an upper bound when segments pipeline (sim/simulator.hpp models
// that overlap). The formulas are the papers' (ring: Patarasuk & Yuan 2009; 2-D torus: Ying et al.
// 2018; halving-doubling: Thakur, Rabenseifner & Gropp 2005):
//   ring              2(N-1) alpha + 2(N-1)/N S beta
//   2-D torus R x C   2(R+C-2) alpha + 2(N-1)/N S beta
//   halving-doubling  2 log2(N) alpha + 2(N-1)/N S beta   (topology::halving_doubling; N a power of two)
//   recursive doubling  log2(N) alpha + log2(N) S beta    (topology::recursive_doubling's all_reduce)
// with alpha once per segment instead of once per step unless send_ahead (see add_ring), and the
// bytes of pairwise exchanges (a ring of 2, a torus row or column of 2, every halving-doubling
// step) at beta / eta instead of beta (link_params::exchange_efficiency).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "../codec/concept.hpp"
#include "../collective/pipeline.hpp"
#include "../core/error.hpp"

namespace lockstep::sim {

// One link: what a message pays to cross it.
//
// exchange_efficiency (eta, in (0, 1]): the fraction of the bandwidth a rank gets for bytes it
// sends in a step whose send peer is also its receive peer — a pairwise exchange, where both ends
// send to each other at once over the same connection (every step of a 2-rank ring, of a ring of
// 2 inside a torus, of halving-doubling). 1 is ideal full duplex (NCCL-style links, the default).
// TCP over shaped links gets less: data and the reverse flow's ACKs share one queue (two-way
// traffic, Zhang, Shenker & Clark 1991); netlab measures eta ~0.6 (docs/scaling.md). A one-way
// ring step (send to i+1, receive from i-1) always moves at the full bandwidth.
//
// burst_bytes: the link is a token bucket (tc's tbf, a cloud NIC's rate limiter), not a pipe of
// fixed rate: tokens accrue at the bandwidth while the link idles, up to burst_bytes, and that many
// bytes leave at once. A sender that computes between messages (a lossy codec's encode and decode)
// banks its idle time as later bandwidth. 0 (the default) is a plain rate. Credited bytes leave at
// burst_rate_Bps (tbf without a peak rate: as fast as the path beneath it, for netlab the unshaped
// TCP path; 0 = at once; else above the bandwidth). netlab's links have a 256 KiB bucket at
// 1 Gbit/s, and going from 128 KiB to 1 MiB cuts an int8 all-reduce's time by up to 46%
// (docs/scaling.md). Only the simulator models it; the closed forms leave it out.
struct link_params {
  double latency_s = 25e-6;         // alpha
  double bandwidth_Bps = 125e6;     // 1 / beta; 125e6 = 1 Gbit/s
  double exchange_efficiency = 1.0; // eta, see above
  double burst_bytes = 0;           // token bucket depth, see above
  double burst_rate_Bps = 0;        // how fast credited bytes leave; 0: at once
  // o (LogP's overhead): seconds of a rank's core per message it posts and per message it reads,
  // the software cost of a message that does not overlap (alpha does). What makes many small
  // segments cost more than few large ones. Only the simulator models it; 0 by default.
  double overhead_s = 0;
  constexpr double beta() const noexcept { return 1.0 / bandwidth_Bps; }
  // Seconds per byte of a pairwise exchange: beta / eta.
  constexpr double exchange_beta() const noexcept { return 1.0 / (bandwidth_Bps * exchange_efficiency); }
  // The bandwidth a message gets: full one way, eta of it in an exchange.
  constexpr double bandwidth_for(bool exchange) const noexcept {
    return exchange ? bandwidth_Bps * exchange_efficiency : bandwidth_Bps;
  }
};

// gamma: seconds per element of each codec routine on one core.
struct codec_rates {
  double encode_s = 0;
  double decode_s = 0;      // overwrite (all-gather receive of a lossy codec)
  double decode_add_s = 0;  // reduce-scatter receive
};

// What the cost model and the simulator need to know of a codec: the size of a message of n
// values and the cost of touching them. Built from a real codec by model_of(), so wire sizes are
// the codec's own, scales and padding included.
struct codec_model {
  std::string name = "fp32";
  bool identity = true;     // wire bytes are the fp32 values: no encode, no decode on copy
  std::size_t block = 1;    // segments are cut at multiples of it
  std::function<std::size_t(std::size_t)> wire_bytes = [](std::size_t n) { return n * sizeof(float); };
  codec_rates rates{};

  // Bytes of one message of n values, as the executor sends it (fp32 unpadded).
  std::size_t message_bytes(std::size_t n) const { return identity ? n * sizeof(float) : wire_bytes(n); }
};

template <codec::codec C>
codec_model model_of(const C& c, codec_rates rates = {}) {
  return {std::string(c.name()), C::identity, std::max<std::size_t>(1, c.block()),
          [c](std::size_t n) { return c.wire_bytes(n); }, rates};
}

// gamma measured on this machine: each routine over n values, best of `reps` (the best, because
// other processes share the cores and only slow a run down).
template <codec::codec C>
codec_rates measure_rates(const C& c, std::size_t n = std::size_t{1} << 22, int reps = 3) {
  std::vector<float> x(n), acc(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(0.001f * static_cast<float>(i)) * 0.01f;
  std::vector<std::byte> wire(c.wire_bytes(n));
  auto best = [&](auto&& f) {
    double b = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      b = std::min(b, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return b / static_cast<double>(n);
  };
  codec_rates r;
  if constexpr (codec::feedback_codec<C>) {
    // What the executor runs for such a codec: the encode through the residual (add, encode,
    // decode, subtract), not the bare inner encode.
    C fc = c;
    std::vector<float> residual(n, 0.0f);
    r.encode_s = best([&] { fc.encode_with_residual(x.data(), n, wire.data(), residual.data()); });
  } else {
    r.encode_s = C::identity ? 0.0 : best([&] { c.encode(x.data(), n, wire.data()); });
  }
  c.encode(x.data(), n, wire.data());
  r.decode_s = C::identity ? 0.0 : best([&] { c.decode(wire.data(), n, acc.data()); });
  r.decode_add_s = best([&] { c.decode_add(wire.data(), n, acc.data()); });
  return r;
}

// The executor's segment length in elements, by the executor's own rule (collective/pipeline.hpp).
inline std::size_t segment_elems(const codec_model& c, std::size_t segment_bytes) {
  return pipeline::segment_elems(c.block, segment_bytes);
}

// Wire bytes of one chunk of len values, cut into segments as the executor cuts it.
inline std::size_t chunk_wire_bytes(const codec_model& c, std::size_t len, std::size_t seg) {
  const std::size_t full = len / seg, rem = len % seg;
  return full * c.message_bytes(seg) + (rem ? c.message_bytes(rem) : 0);
}
// Not (len + seg - 1) / seg: a whole-chunk segment (pipeline::whole_chunk) is near SIZE_MAX.
inline std::size_t chunk_segments(std::size_t len, std::size_t seg) { return len / seg + (len % seg != 0); }

// Critical-path counts of one rank; time() turns them into seconds.
struct cost_terms {
  double messages = 0;        // sequential steps (each pays alpha once)
  double oneway_bytes = 0;    // bytes through the rank's link, one after the other, at beta
  double exchange_bytes = 0;  // bytes sent in pairwise exchanges (send peer = receive peer), at beta / eta
  double encode_elems = 0;
  double decode_elems = 0;
  double decode_add_elems = 0;

  double wire_bytes() const noexcept { return oneway_bytes + exchange_bytes; }
  double time(const link_params& l, const codec_rates& g) const noexcept {
    return messages * l.latency_s + oneway_bytes * l.beta() + exchange_bytes * l.exchange_beta() + compute_time(g);
  }
  double compute_time(const codec_rates& g) const noexcept {
    return encode_elems * g.encode_s + decode_elems * g.decode_s + decode_add_elems * g.decode_add_s;
  }
};

// The executor's handshake: one header to each peer before a lossy codec's first encode (56
// bytes, sizeof(detail::wire_header), which tests/test_sim.cpp holds it to; one alpha); fp32's
// first step is sent beside the headers and pays none.
inline constexpr std::size_t header_bytes = 56;

namespace detail {
// One ring phase pair over a span of `elems` values cut into n parts of `part` values each (all
// parts equal): reduce-scatter adds (n-1) steps, all-gather (n-1).
inline void add_ring(cost_terms& t, const codec_model& c, int n, std::size_t part_chunks, std::size_t chunk,
                     std::size_t seg, bool send_ahead) {
  if (n < 2) return;
  const double steps = n - 1;
  const double elems = static_cast<double>(part_chunks * chunk);
  const double bytes = static_cast<double>(part_chunks * chunk_wire_bytes(c, chunk, seg));
  // The executor posts send segment j+1 only after receive segment j arrived, so every segment,
  // not every step, pays alpha: 2(N-1) alpha of the papers is the one-segment case.
  t.messages += 2 * steps * (send_ahead ? 1.0 : static_cast<double>(part_chunks * chunk_segments(chunk, seg)));
  // A ring of two is a pairwise exchange: the rank's one peer is both next and previous.
  (n == 2 ? t.exchange_bytes : t.oneway_bytes) += 2 * steps * bytes;
  if (!c.identity) {
    t.encode_elems += steps * elems;  // reduce-scatter sends re-encode partial sums
    t.decode_elems += steps * elems;  // all-gather receives overwrite
  }
  t.decode_add_elems += steps * elems;
}
inline void add_finalize(cost_terms& t, const codec_model& c, int size, std::size_t chunk) {
  if (c.identity || size < 2) return;
  t.encode_elems += static_cast<double>(chunk);  // the owner quantises its final values once
  t.decode_elems += static_cast<double>(chunk);  // and keeps their decoded image
}
inline void check(const char* op, int size, std::size_t n) {
  if (size < 1) throw error(errc::invalid_argument, op, -1, -1, "group size " + std::to_string(size) + ", not >= 1");
  const auto chunks = static_cast<std::size_t>(size);
  if (n % chunks)
    throw error(errc::invalid_argument, op, -1, -1,
                std::to_string(n) + " values do not split into " + std::to_string(chunks) +
                    " equal chunks; the closed forms assume they do");
}
}  // namespace detail

// n fp32 values, N ranks; segment_bytes as the group would use (the transport's default).
inline cost_terms ring_terms(int size, std::size_t n, const codec_model& c, std::size_t segment_bytes,
                             bool handshake = true, bool send_ahead = false) {
  detail::check("sim::ring_terms", size, n);
  cost_terms t;
  const std::size_t chunk = n / static_cast<std::size_t>(size), seg = segment_elems(c, segment_bytes);
  detail::add_ring(t, c, size, 1, chunk, seg, send_ahead);
  detail::add_finalize(t, c, size, chunk);
  if (handshake && size > 1 && !c.identity) t.messages += 1, t.oneway_bytes += header_bytes;
  return t;
}

// Columns first, as topology::torus2d runs it: rings of R over parts of C chunks, then rings of C.
inline cost_terms torus2d_terms(int rows, int cols, std::size_t n, const codec_model& c,
                                std::size_t segment_bytes, bool handshake = true, bool send_ahead = false) {
  if (rows < 1 || cols < 1)
    throw error(errc::invalid_argument, "sim::torus2d_terms", -1, -1,
                "shape " + std::to_string(rows) + "x" + std::to_string(cols) + ": both sides must be >= 1");
  const int size = rows * cols;
  detail::check("sim::torus2d_terms", size, n);
  cost_terms t;
  const std::size_t chunk = n / static_cast<std::size_t>(size), seg = segment_elems(c, segment_bytes);
  detail::add_ring(t, c, rows, static_cast<std::size_t>(cols), chunk, seg, send_ahead);
  detail::add_ring(t, c, cols, 1, chunk, seg, send_ahead);
  detail::add_finalize(t, c, size, chunk);
  if (handshake && size > 1 && !c.identity) t.messages += 1, t.oneway_bytes += header_bytes;
  return t;
}

// Recursive halving (reduce-scatter) then doubling (all-gather); N a power of two.
inline cost_terms halving_doubling_terms(int size, std::size_t n, const codec_model& c,
                                         std::size_t segment_bytes, bool handshake = true, bool send_ahead = false) {
  if (size < 1 || (size & (size - 1)))
    throw error(errc::invalid_argument, "sim::halving_doubling_terms", -1, -1,
                "halving-doubling needs a power-of-two group, not " + std::to_string(size) + " ranks");
  detail::check("sim::halving_doubling_terms", size, n);
  cost_terms t;
  const std::size_t chunk = n / static_cast<std::size_t>(size), seg = segment_elems(c, segment_bytes);
  for (int half = size / 2; half >= 1; half /= 2) {
    // exchange `half` chunks with the partner, both ways
    const double elems = static_cast<double>(half) * static_cast<double>(chunk);
    const double bytes = half * static_cast<double>(chunk_wire_bytes(c, chunk, seg));
    t.messages += send_ahead ? 2.0 : 2.0 * half * static_cast<double>(chunk_segments(chunk, seg));
    t.exchange_bytes += 2 * bytes;  // every step is a pairwise exchange
    if (!c.identity) t.encode_elems += elems, t.decode_elems += elems;
    t.decode_add_elems += elems;
  }
  detail::add_finalize(t, c, size, chunk);
  if (handshake && size > 1 && !c.identity) t.messages += 1, t.oneway_bytes += header_bytes;
  return t;
}

// Recursive doubling (topology::recursive_doubling's all_reduce): log2 N exchanges of the whole
// buffer, one chunk; each side encodes what it sends and decodes it back into place; the final
// value is quantised once more by every rank. N a power of two.
inline cost_terms recursive_doubling_terms(int size, std::size_t n, const codec_model& c, std::size_t segment_bytes,
                                           bool handshake = true, bool send_ahead = false) {
  if (size < 1 || (size & (size - 1)))
    throw error(errc::invalid_argument, "sim::recursive_doubling_terms", -1, -1,
                "recursive doubling's closed form needs a power-of-two group, not " + std::to_string(size) + " ranks");
  cost_terms t;
  const std::size_t seg = segment_elems(c, segment_bytes);
  for (int d = 1; d < size; d *= 2) {
    const double elems = static_cast<double>(n);
    t.messages += send_ahead ? 1.0 : static_cast<double>(chunk_segments(n, seg));
    t.exchange_bytes += static_cast<double>(chunk_wire_bytes(c, n, seg));
    if (!c.identity) t.encode_elems += elems, t.decode_elems += elems;
    t.decode_add_elems += c.identity ? 2 * elems : elems;  // fp32 copies the span aside (simulator.hpp)
  }
  detail::add_finalize(t, c, size, n);
  if (handshake && size > 1 && !c.identity) t.messages += 1, t.oneway_bytes += header_bytes;
  return t;
}

// nccl-tests' bus bandwidth of an all-reduce of `bytes` fp32 bytes that took `seconds`.
inline double allreduce_busbw(double bytes, double seconds, int size) {
  return seconds > 0 ? bytes / seconds * 2.0 * (size - 1) / size : 0.0;
}

// Speedup of synchronous data-parallel training on N workers over one (Dettmers' question): each
// step computes for compute_s, then all-reduces the gradient, which takes comm_s; `overlap` is the
// fraction of the all-reduce hidden behind backward (0: none, as in Dettmers' model).
inline double data_parallel_speedup(int workers, double compute_s, double comm_s, double overlap = 0.0) {
  const double exposed = comm_s * (1.0 - std::clamp(overlap, 0.0, 1.0));
  return workers * compute_s / (compute_s + exposed);
}

}  // namespace lockstep::sim
