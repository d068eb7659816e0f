// lockstep/sim/simulator.hpp: a discrete-event simulator that runs every rank's schedule — the
// very steps topology::all_reduce_schedule hands the executor — with a clock instead of a
// transport.
//
// What it models, and why that much:
//   * each rank's core does what collective/executor.hpp does, in the same order: per step, the
//     send and receive spans are cut into segments (a multiple of the codec block, about
//     segment_bytes) and interleaved — encode send segment j (reduce-scatter only: the all-gather
//     forwards wire bytes), post it, wait for receive segment j, decode-add (reduce) or decode
//     (copy; free for fp32, which lands in place); the step ends when its sends have left too.
//     Every message posted and read costs the core link_params::overhead_s (LogP's o).
//     An exchange (recursive doubling) also decodes what it sends back into place (fp32: copies
//     it aside, costed as a decode-add).
//     Between the phases the owner encodes and decodes its final chunk once. Codec work costs
//     gamma per element (codec_rates, measured by measure_rates).
//   * a fan-in (pipeline::fan_in_end: topology::direct's reduce-scatter) runs as the executor
//     runs it on a host group: every send of its m steps posted at once, then each segment read
//     from all m peers and added in one pass. fp32 is memory-bound there: a decode-add streams
//     three buffers (the copy, the sum in and out), the pass m + 2 (m copies, the sum once), so it
//     costs (m + 2) / 3 decode-adds per value instead of m; a lossy codec decodes every copy, m.
//   * links: every host has one NIC, an egress and an ingress link (full duplex) of the cluster's
//     bandwidth; inter-host messages also cross the switch core when it is not non-blocking.
//     A message occupies every link of its path for bytes / bandwidth, starting when all are free
//     (first come, first served, in order of the time it is posted), and arrives `latency` after
//     its last byte left. Flows that share a NIC or the core therefore queue behind each other,
//     and back-to-back segments pipeline: one latency per step, not per segment. A message of a
//     step whose send peer is also its receive peer (a pairwise exchange) moves at
//     exchange_efficiency x bandwidth (link_params; 1 by default). With link_params::burst_bytes
//     each NIC direction is a token bucket (tbf): bytes covered by tokens leave at the burst rate
//     (or at once), the rest at the rate; tokens accrue at the bandwidth while the link idles (all
//     full at the start); see detail::transmit.
//   * ranks of one host talk over `local` links that are not shared (memory copies).
//   * the handshake: before a lossy codec's first encode, a header from every peer a rank
//     receives from (fp32's first step is sent beside the headers, so it waits for none).
// What it leaves out: TCP slow start and MPI's rendezvous for large messages (both show up in
// the fitted alpha and beta), and codec work of other ranks slowing a shared core.
//
// Cost: one heap operation per message (segment); schedules are kept run-length encoded (a run is
// a stretch of steps whose chunk spans move by a constant stride), so 4096 ranks x 8190 ring steps
// take a few hundred kilobytes, not gigabytes.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../collective/pipeline.hpp"
#include "../core/error.hpp"
#include "../topology/concept.hpp"
#include "../topology/schedule.hpp"
#include "../topology/symmetry.hpp"
#include "cost_model.hpp"

namespace lockstep::sim {

struct cluster {
  link_params nic{};                             // every host's NIC, each direction
  link_params local{1e-6, 10e9};                 // ranks of the same host
  int ranks_per_host = 1;                        // rank r lives on host r / ranks_per_host
  double switch_bandwidth_Bps = 0;               // 0: non-blocking; else one core all hosts share
  std::size_t segment_bytes = std::size_t{1} << 20;  // the transport's (inproc: 1 MiB)
  bool handshake = true;
  // false: send segment j+1 is posted after receive segment j arrived, so each segment pays the
  // latency (the closed forms' model). true: all of a step's sends are posted first, so a step
  // pays it once (the papers' 2(N-1) alpha); what the torus needs to beat the ring.
  bool send_ahead = false;
  // Between the two (when send_ahead is false): sends may run this many segments ahead of
  // receives. as_executor: what collective/executor.hpp does, every send of a step at once for
  // fp32 and 4 segments ahead for a lossy codec, which encodes each before it sends it.
  static constexpr int as_executor = -1;
  int segments_ahead = 0;
};

struct result {
  double time_s = 0;       // the slowest rank's finish
  double min_time_s = 0;   // the fastest rank's finish
  double bytes = 0;        // fp32 payload of the all-reduce
  double busbw_Bps = 0;
  std::uint64_t messages = 0;
  std::uint64_t steps = 0;  // per rank, the longest schedule
};

namespace detail {

// One NIC direction as a token bucket: free from `free` on, holding `tokens` bytes of credit then.
struct shaper {
  double free = 0;
  double tokens = 0;
  double credit(double t, const link_params& l) const noexcept {
    return std::min(l.burst_bytes, tokens + std::max(0.0, t - free) * l.bandwidth_Bps);
  }
};

// A message of `bytes` that may start at `ready` crosses every link of `path` (all of them at
// once, first come first served): it starts when all are free; then, as tc's tbf, it leaves at the
// burst rate P (l.burst_rate_Bps; 0: at once) while the scarcest bucket has credit (which drains
// at P - r, refilled at the bandwidth r meanwhile, so C P / (P - r) bytes go out that way) and at
// `rate` after that (the bandwidth, times eta in an exchange: the reverse flow's ACKs take the
// rest, so the bucket gains nothing then). Returns when its last byte left; each link is busy
// until then and keeps the credit it had less what the burst used.
template <std::size_t K>
double transmit(const std::array<shaper*, K>& path, double ready, double bytes, double rate, const link_params& l) {
  double start = ready;
  for (const shaper* s : path) start = std::max(start, s->free);
  double credit = l.burst_bytes;
  for (const shaper* s : path) credit = std::min(credit, s->credit(start, l));
  const double p = l.burst_rate_Bps, r = l.bandwidth_Bps;  // p > r or p == 0 (simulator checks)
  const double covered = std::min(bytes, p > 0 ? credit * p / (p - r) : credit);
  const double end = start + (p > 0 ? covered / p : 0.0) + (bytes - covered) / rate;
  const double spent = p > 0 ? covered * (1 - r / p) : covered;  // credit the burst used up
  for (shaper* s : path) {
    s->tokens = std::clamp(s->credit(start, l) - spent, 0.0, l.burst_bytes);
    s->free = end;
  }
  return end;
}

// A stretch of `length` steps with the same peers, action, phase and span sizes whose span starts
// move by a constant stride: step k of the run sends chunks [send_first + k*send_stride, ... +
// send_count). Ring and torus schedules compress to a handful of runs per rank.
struct run {
  int send_peer = -1, recv_peer = -1;
  std::uint32_t send_first = 0, send_count = 0, recv_first = 0, recv_count = 0;
  std::int64_t send_stride = 0, recv_stride = 0;
  std::uint32_t length = 0;
  bool reduce = false;
  bool reduce_scatter = false;
  bool exchange = false;  // topology::is_exchange
  std::uint32_t fan = 0;  // steps of the fan-in this run (of one step) starts; 0: none
};

struct compact_schedule {
  std::vector<run> runs;
  std::uint32_t steps = 0, chunks = 1;
  std::uint32_t finalize_at = 0;  // the owner's encode + decode runs before this step
  topology::chunk_span owned;
  std::vector<int> recv_peers;  // distinct, for the handshake
};

inline compact_schedule compress(const topology::schedule& s) {
  compact_schedule c;
  c.steps = static_cast<std::uint32_t>(s.steps.size());
  c.chunks = s.chunks;
  c.finalize_at = static_cast<std::uint32_t>(pipeline::finalize_step(s));
  c.owned = s.owned;
  // Fan-ins: the head step gets the run's length; its steps stay runs of one step each.
  std::vector<std::uint32_t> fan(s.steps.size(), 0);
  for (std::size_t si = 0; si < s.steps.size();) {
    const std::size_t end = pipeline::fan_in_end(s, si);
    if (end > si + 1) {
      for (std::size_t i = si; i < end; ++i) fan[i] = 1;
      fan[si] = static_cast<std::uint32_t>(end - si);
    }
    si = end;
  }
  for (std::size_t si = 0; si < s.steps.size(); ++si) {
    const topology::step& st = s.steps[si];
    const bool red = st.act == topology::action::reduce, rs = st.phase == topology::phase::reduce_scatter,
               ex = topology::is_exchange(st);
    const std::uint32_t sc = st.send_peer >= 0 ? st.send.count : 0, rc = st.recv_peer >= 0 ? st.recv.count : 0;
    if (st.recv_peer >= 0 && std::find(c.recv_peers.begin(), c.recv_peers.end(), st.recv_peer) == c.recv_peers.end())
      c.recv_peers.push_back(st.recv_peer);
    if (!c.runs.empty() && !fan[si] && !c.runs.back().fan) {
      run& r = c.runs.back();
      if (r.send_peer == st.send_peer && r.recv_peer == st.recv_peer && r.reduce == red && r.reduce_scatter == rs &&
          r.exchange == ex && r.send_count == sc && r.recv_count == rc) {
        const std::int64_t ds = std::int64_t(st.send.first) - r.send_first, dr = std::int64_t(st.recv.first) - r.recv_first;
        if (r.length == 1) {
          r.send_stride = ds, r.recv_stride = dr, r.length = 2;
          continue;
        }
        if (ds == r.send_stride * r.length && dr == r.recv_stride * r.length) {
          ++r.length;
          continue;
        }
      }
    }
    c.runs.push_back({st.send_peer, st.recv_peer, st.send.first, sc, st.recv.first, rc, 0, 0, 1, red, rs, ex, fan[si]});
  }
  return c;
}

// Walks the segments of a chunk span in the executor's order: chunk by chunk, `seg` values at a time.
struct segment_cursor {
  std::uint64_t n = 0, chunks = 1, seg = 1;
  std::uint32_t chunk = 0, end = 0;  // current chunk, one past the last
  std::uint64_t offset = 0;          // within the current chunk
  const std::size_t* offsets = nullptr;  // (chunk + 1): per-rank counts (all_gather_v ...), else equal chunks

  std::uint64_t chunk_len(std::uint32_t c) const noexcept {
    if (offsets) return offsets[c + 1] - offsets[c];
    using wide = unsigned __int128;
    return static_cast<std::uint64_t>(wide(n) * (c + 1) / chunks - wide(n) * c / chunks);
  }
  void reset(std::uint32_t first, std::uint32_t count) noexcept {
    chunk = first, end = first + count, offset = 0;
    skip_empty();
  }
  void skip_empty() noexcept {
    while (chunk < end && offset >= chunk_len(chunk)) ++chunk, offset = 0;
  }
  bool done() const noexcept { return chunk >= end; }
  std::uint64_t next() noexcept {  // length of the current segment; moves past it
    const std::uint64_t len = std::min(seg, chunk_len(chunk) - offset);
    offset += len;
    skip_empty();
    return len;
  }
};

}  // namespace detail

// Simulates one collective: schedule_of(rank) gives each rank's schedule (all the same number of
// chunks) over n fp32 values. `finalize_owned`: the all-reduce's owner encode + decode between the
// phases (set it for all_reduce schedules). `offsets` (chunks + 1, ending at n): chunk c is
// [offsets[c], offsets[c+1]) as all_gather_v / reduce_scatter_v cut it (detail::chunk_layout);
// empty: equal chunks.
class simulator {
 public:
  simulator(const cluster& cl, const codec_model& codec) : cl_(cl), codec_(codec) {
    auto bad = [](const std::string& why) { return error(errc::invalid_argument, "sim::simulator", -1, -1, why); };
    if (cl_.segments_ahead < cluster::as_executor)
      throw bad("cluster.segments_ahead must be >= 0 or as_executor, not " + std::to_string(cl_.segments_ahead));
    // Sends lead receives by ahead_ segments (the executor's `ahead`); the executor's own window is
    // pipeline::sends_ahead of a step with more sends than any lead can reach.
    constexpr std::int64_t all = std::numeric_limits<std::int64_t>::max();
    ahead_ = cl_.send_ahead ? all
             : cl_.segments_ahead == cluster::as_executor
                 ? static_cast<std::int64_t>(pipeline::sends_ahead(codec_.identity, static_cast<std::size_t>(all), false))
                 : cl_.segments_ahead;
    if (cl_.ranks_per_host < 1) throw bad("cluster.ranks_per_host must be >= 1, not " + std::to_string(cl_.ranks_per_host));
    if (!(cl_.nic.bandwidth_Bps > 0) || !(cl_.local.bandwidth_Bps > 0))
      throw bad("cluster bandwidths must be > 0, not " + std::to_string(cl_.nic.bandwidth_Bps) + " B/s (nic) and " +
                std::to_string(cl_.local.bandwidth_Bps) + " B/s (local)");
    for (const link_params* l : {&cl_.nic, &cl_.local})
      if (!(l->exchange_efficiency > 0 && l->exchange_efficiency <= 1))
        throw bad("cluster exchange_efficiency must be in (0, 1], not " + std::to_string(l->exchange_efficiency));
    if (!(cl_.nic.burst_bytes >= 0)) throw bad("cluster.nic.burst_bytes must be >= 0, not " + std::to_string(cl_.nic.burst_bytes));
    if (!(cl_.nic.burst_rate_Bps == 0 || cl_.nic.burst_rate_Bps > cl_.nic.bandwidth_Bps))
      throw bad("cluster.nic.burst_rate_Bps must be 0 (at once) or above the bandwidth (" +
                std::to_string(cl_.nic.bandwidth_Bps) + " B/s), not " + std::to_string(cl_.nic.burst_rate_Bps));
    if (cl_.nic.burst_bytes > 0 && cl_.switch_bandwidth_Bps > 0)
      throw bad("token buckets (cluster.nic.burst_bytes) are modelled on a non-blocking switch only, "
                "not behind a shared core (cluster.switch_bandwidth_Bps)");
  }

  result run(int size, std::size_t n, const std::function<topology::schedule(int)>& schedule_of,
             bool finalize_owned = true, std::span<const std::size_t> offsets = {}) {
    if (size < 1) throw error(errc::invalid_argument, "sim::simulator::run", -1, -1, "group size " + std::to_string(size) + ", not >= 1");
    if (!offsets.empty() && offsets.back() != n)
      throw error(errc::invalid_argument, "sim::simulator::run", -1, -1,
                  "per-chunk offsets end at " + std::to_string(offsets.back()) + ", not at the " + std::to_string(n) + " values");
    // Falling offsets would give chunk lengths that wrap (size_t), as if the chunk held 2^64 values.
    if (!offsets.empty() && offsets.front() != 0)
      throw error(errc::invalid_argument, "sim::simulator::run", -1, -1,
                  "per-chunk offsets start at " + std::to_string(offsets.front()) + ", not at 0");
    for (std::size_t c = 1; c < offsets.size(); ++c)
      if (offsets[c] < offsets[c - 1])
        throw error(errc::invalid_argument, "sim::simulator::run", -1, -1,
                    "per-chunk offsets fall from " + std::to_string(offsets[c - 1]) + " to " + std::to_string(offsets[c]) +
                        " at chunk " + std::to_string(c));
    last_symmetric_ = false;
    size_ = size;
    n_ = n;
    finalize_ = finalize_owned;
    seg_ = segment_elems(codec_, cl_.segment_bytes);
    hosts_ = (size + cl_.ranks_per_host - 1) / cl_.ranks_per_host;
    links_.assign(2 * static_cast<std::size_t>(hosts_), detail::shaper{0.0, cl_.nic.burst_bytes});
    core_free_ = 0;
    ranks_.assign(static_cast<std::size_t>(size), {});
    heap_.clear();
    seq_ = 0;
    messages_ = 0;
    std::uint64_t max_steps = 0;
    for (int r = 0; r < size; ++r) {
      rank_state& R = ranks_[static_cast<std::size_t>(r)];
      R.sched = detail::compress(schedule_of(r));
      if (r > 0 && R.sched.chunks != ranks_[0].sched.chunks)
        throw error(errc::mismatch, "sim::simulator::run", r, 0,
                    "this rank's schedule cuts the buffer into " + std::to_string(R.sched.chunks) + " chunks, rank 0's into " +
                        std::to_string(ranks_[0].sched.chunks));
      if (!offsets.empty() && offsets.size() != std::size_t{R.sched.chunks} + 1)
        throw error(errc::invalid_argument, "sim::simulator::run", r, -1,
                    std::to_string(offsets.size()) + " per-chunk offsets for a schedule of " + std::to_string(R.sched.chunks) +
                        " chunks (want chunks + 1)");
      max_steps = std::max<std::uint64_t>(max_steps, R.sched.steps);
      R.send.offsets = R.recv.offsets = offsets.empty() ? nullptr : offsets.data();
      R.send.n = R.recv.n = n;
      R.send.chunks = R.recv.chunks = R.sched.chunks;
      R.send.seg = R.recv.seg = seg_;
    }
    for (int r = 0; r < size; ++r) {
      rank_state& R = ranks_[static_cast<std::size_t>(r)];
      if (cl_.handshake && !codec_.identity)
        for (int p : R.sched.recv_peers) {
          const link_params& l = same_host(p, r) ? cl_.local : cl_.nic;
          R.t = std::max(R.t, l.latency_s + static_cast<double>(header_bytes) / l.bandwidth_Bps);
        }
      R.finalized = !finalize_;
    }
    for (int r = 0; r < size; ++r) advance(r);
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), later);
      const message m = heap_.back();
      heap_.pop_back();
      deliver(m);
    }
    result res;
    res.time_s = 0;
    res.min_time_s = std::numeric_limits<double>::infinity();
    for (int r = 0; r < size; ++r) {
      const rank_state& R = ranks_[static_cast<std::size_t>(r)];
      if (!R.finished)
        throw error(errc::mismatch, "sim::simulator::run", r, R.waiting == wait::recv ? R.recv_peer : -1,
                    "never finished (stuck at step " + std::to_string(R.step) + " of " + std::to_string(R.sched.steps) +
                        "): the ranks' schedules do not match each other");
      res.time_s = std::max(res.time_s, R.t);
      res.min_time_s = std::min(res.min_time_s, R.t);
    }
    res.bytes = static_cast<double>(n) * sizeof(float);
    res.busbw_Bps = allreduce_busbw(res.bytes, res.time_s, size);
    res.messages = messages_;
    res.steps = max_steps;
    return res;
  }

  // A topology that declares its symmetry (topology/symmetry.hpp) may take the shortcut; any other
  // runs every rank.
  template <topology::topology T>
  result all_reduce(const T& topo, int size, std::size_t n) {
    topo.validate(size);
    auto schedule_of = [&](int r) { return topology::all_reduce_schedule(topo, r, size); };
    if constexpr (topology::symmetric_topology<T>) {
      if (symmetric_cluster(n, size))
        if (auto r = run_symmetric(size, n, topo.symmetry(size), schedule_of)) return *r;
    }
    return run(size, n, schedule_of, true);
  }

  // Which fast path the last all_reduce took (tests check both agree).
  bool last_was_symmetric() const noexcept { return last_symmetric_; }
  // Ranks whose schedules run_symmetric compares with rank 0's before it trusts the symmetry
  // (0: all of them). Every rank is the proof; a sample keeps 4096-rank runs fast.
  void set_symmetry_checks(int ranks) noexcept { symmetry_checks_ = ranks; }
  void disable_symmetry(bool off = true) noexcept { no_symmetry_ = off; }

 private:
  struct message {
    double ready;        // posted by the sender's core
    std::uint64_t seq;   // ties: posting order
    std::uint32_t src, dst;
    std::uint64_t ordinal;  // the sender's how-many-th message (segment) to dst in this collective
    std::uint64_t bytes;
    bool exchange;       // its step's send peer is also the receive peer
  };
  static bool later(const message& a, const message& b) noexcept {
    return a.ready != b.ready ? a.ready > b.ready : a.seq > b.seq;
  }
  struct arrival {
    std::uint32_t src;
    std::uint64_t ordinal;
    double time;
  };
  enum class wait : std::uint8_t { none, recv, sends };
  struct rank_state {
    detail::compact_schedule sched;
    std::uint32_t run = 0, in_run = 0, step = 0;
    bool in_step = false, finished = false, finalized = false, reduce = false, reduce_scatter = false, exchange = false;
    int send_peer = -1, recv_peer = -1;
    detail::segment_cursor send, recv;
    std::uint32_t sent = 0, received = 0;  // segments of the current step
    std::uint32_t sends_pending = 0;
    double send_end = 0;
    double t = 0;  // this rank's core
    wait waiting = wait::none;
    std::vector<arrival> early;  // arrived before this rank wanted them
    // Messages between two ranks match in send order, as the executor's do: the k-th segment a
    // rank sends a peer is the k-th that peer receives from it, whatever step each is at (the
    // ranks a fold leaves out run fewer steps than their partners).
    std::vector<std::pair<int, std::uint64_t>> sent_to, got_from;
    // In a fan-in: its steps, its peers in step order and which of them the current segment waits on.
    std::uint32_t fan = 0, fan_i = 0;
    std::vector<int> fan_peers;
    bool headers_in = false;  // fp32: the peers' headers are in (a fan-in waited for them)
  };
  static std::uint64_t& counter(std::vector<std::pair<int, std::uint64_t>>& v, int peer) {
    for (auto& [p, k] : v)
      if (p == peer) return k;
    return v.emplace_back(peer, 0).second;
  }

  bool same_host(int a, int b) const noexcept { return a / cl_.ranks_per_host == b / cl_.ranks_per_host; }

  // The symmetry argument. Put the ranks on an R x C grid, r = i*C + j, and let s_(a,b) move
  // (i, j) to (i+a mod R, j+b mod C). Suppose, for every rank r = (a, b) and every step k, rank r's
  // step k is rank 0's step k with the peers moved by s_(a,b) and the same span sizes, action
  // and phase; every chunk holds the same number of values; every rank has its own NIC and the
  // switch is non-blocking. Then the whole system is invariant under s, and by induction over
  // events in time order every rank's timeline equals rank 0's: the message rank 0 receives from
  // peer p at (step k, segment j) was posted by p at the time rank 0 posted its own (k, j), and it
  // queued on rank 0's ingress exactly as rank 0's own (k, j) queued on its peer's ingress. So one
  // rank simulated with one egress and one ingress clock is the exact answer, not an estimate.
  // The schedule condition is what a topology's symmetry() declares (ring: the 1 x N grid, torus2d:
  // R x C) and what run_symmetric checks before it trusts it.
  bool symmetric_cluster(std::size_t n, int size) const noexcept {
    return !no_symmetry_ && cl_.ranks_per_host == 1 && cl_.switch_bandwidth_Bps <= 0 && n % static_cast<std::size_t>(size) == 0;
  }

  std::optional<result> run_symmetric(int size, std::size_t n, topology::grid_symmetry sym,
                                      const std::function<topology::schedule(int)>& schedule_of) {
    last_symmetric_ = false;
    if (sym.rows < 1 || sym.cols < 1 || static_cast<long long>(sym.rows) * sym.cols != size) return std::nullopt;
    const int C = sym.cols;
    const topology::schedule s0 = schedule_of(0);
    if (s0.chunks != static_cast<std::uint32_t>(size) && n % s0.chunks) return std::nullopt;
    auto matches = [&](int r) {
      const topology::schedule sr = schedule_of(r);
      if (sr.steps.size() != s0.steps.size() || sr.chunks != s0.chunks || sr.owned.count != s0.owned.count) return false;
      for (std::size_t k = 0; k < s0.steps.size(); ++k) {
        const topology::step &x = s0.steps[k], &y = sr.steps[k];
        if (sym.move(x.send_peer, r) != y.send_peer || sym.move(x.recv_peer, r) != y.recv_peer ||
            x.send.count != y.send.count || x.recv.count != y.recv.count || x.act != y.act || x.phase != y.phase)
          return false;
      }
      return true;
    };
    if (symmetry_checks_ <= 0 || symmetry_checks_ >= size) {
      for (int r = 1; r < size; ++r)
        if (!matches(r)) return std::nullopt;
    } else {
      // The neighbours of 0 in both directions and a spread of others.
      std::vector<int> probe{1, size - 1, C % size, (size - C) % size, size / 2};
      for (int i = 0; static_cast<int>(probe.size()) < symmetry_checks_; ++i)
        probe.push_back(static_cast<int>((1 + 2654435761ull * static_cast<unsigned>(i)) % static_cast<unsigned>(size)));
      for (int r : probe)
        if (r > 0 && !matches(r)) return std::nullopt;
    }
    // Every rank receives at step k as many segments as it sends (a received segment mirrors one
    // of its own sends); otherwise the argument does not apply.
    for (const topology::step& st : s0.steps)
      if ((st.send_peer >= 0) != (st.recv_peer >= 0) || st.send.count != st.recv.count) return std::nullopt;

    size_ = size;
    n_ = n;
    seg_ = segment_elems(codec_, cl_.segment_bytes);
    rank_state R;
    R.sched = detail::compress(s0);
    R.send.n = R.recv.n = n;
    R.send.chunks = R.recv.chunks = R.sched.chunks;
    R.send.seg = R.recv.seg = seg_;
    R.finalized = false;
    if (cl_.handshake && !codec_.identity && !R.sched.recv_peers.empty())
      R.t = cl_.nic.latency_s + static_cast<double>(header_bytes) / cl_.nic.bandwidth_Bps;
    detail::shaper egress{0.0, cl_.nic.burst_bytes}, ingress{0.0, cl_.nic.burst_bytes};
    std::vector<double> arrive;  // of this step's segments, by index
    std::uint64_t messages = 0;
    for (R.step = 0; R.step < R.sched.steps;) {
      maybe_finalize(R);
      const detail::run& ru = R.sched.runs[R.run];
      if (ru.fan > 1) {
        // A fan-in: step i's segment j from its peer mirrors this rank's own step-i segment j
        // (that peer sent it at the time this rank sent its own), as in any step.
        messages += symmetric_fan(R, egress, ingress);
        continue;
      }
      const std::int64_t k = R.in_run;
      R.reduce = ru.reduce;
      R.reduce_scatter = ru.reduce_scatter;
      R.exchange = ru.exchange;
      R.send.reset(static_cast<std::uint32_t>(ru.send_first + k * ru.send_stride), ru.send_peer >= 0 ? ru.send_count : 0);
      R.recv.reset(static_cast<std::uint32_t>(ru.recv_first + k * ru.recv_stride), ru.recv_peer >= 0 ? ru.recv_count : 0);
      R.sent = R.received = 0;
      double send_end = 0;
      arrive.clear();
      while (!R.send.done() || !R.recv.done()) {
        if (!R.send.done() && (lead(R) <= ahead_ || R.recv.done())) {
          const std::uint64_t len = R.send.next();
          if (R.reduce_scatter && !codec_.identity) R.t += static_cast<double>(len) * codec_.rates.encode_s;
          if (R.exchange) R.t += static_cast<double>(len) * exchange_copy_s();
          R.t += cl_.nic.overhead_s;
          const double end = detail::transmit(std::array{&egress, &ingress}, R.t, static_cast<double>(codec_.message_bytes(len)),
                                              cl_.nic.bandwidth_for(ru.send_peer == ru.recv_peer), cl_.nic);
          send_end = end;
          arrive.push_back(end + cl_.nic.latency_s);
          ++R.sent;
          ++messages;
        }
        if (!R.recv.done() && (lead(R) > ahead_ || R.send.done())) {
          if (R.received >= arrive.size()) return std::nullopt;  // receives ahead of sends: no mirror
          consume(R, arrive[R.received], cl_.nic.overhead_s);
        }
      }
      R.t = std::max(R.t, send_end);
      pass_steps(R, 1);
    }
    maybe_finalize(R);
    last_symmetric_ = true;
    result res;
    res.time_s = res.min_time_s = R.t;
    res.bytes = static_cast<double>(n) * sizeof(float);
    res.busbw_Bps = allreduce_busbw(res.bytes, res.time_s, size);
    res.messages = messages * static_cast<std::uint64_t>(size);
    res.steps = R.sched.steps;
    return res;
  }

  // `paced`: the message waits for its turn on the egress until then (a fan-in's, see start_fan).
  void post(rank_state& R, std::uint32_t src, std::uint64_t len, double paced = 0) {
    if (R.reduce_scatter && !codec_.identity) R.t += static_cast<double>(len) * codec_.rates.encode_s;
    if (R.exchange) R.t += static_cast<double>(len) * exchange_copy_s();
    R.t += (same_host(static_cast<int>(src), R.send_peer) ? cl_.local : cl_.nic).overhead_s;
    ++R.sent;
    heap_.push_back({std::max(R.t, paced), seq_++, src, static_cast<std::uint32_t>(R.send_peer), counter(R.sent_to, R.send_peer)++,
                     codec_.message_bytes(len), R.send_peer == R.recv_peer});
    std::push_heap(heap_.begin(), heap_.end(), later);
    ++R.sends_pending;
    ++messages_;
  }

  void consume(rank_state& R, double when, double overhead) {
    if (R.fan) {
      // A fan-in adds segment j once all its peers' copies are in, in one pass (see the top).
      R.t = std::max(R.t, when) + overhead;
      if (++R.fan_i < R.fan) return;
      R.fan_i = 0;
      const double m = R.fan;
      R.t += static_cast<double>(R.recv.next()) * codec_.rates.decode_add_s * (codec_.identity ? (m + 2) / 3 : m);
      ++R.received;
      return;
    }
    const std::uint64_t len = R.recv.next();
    R.t = std::max(R.t, when) + overhead;
    if (R.reduce) R.t += static_cast<double>(len) * codec_.rates.decode_add_s;
    else if (!codec_.identity) R.t += static_cast<double>(len) * codec_.rates.decode_s;
    ++R.received;
  }

  void maybe_finalize(rank_state& R) {
    if (R.finalized || R.step < R.sched.finalize_at) return;
    R.finalized = true;
    if (codec_.identity || size_ < 2) return;
    detail::segment_cursor own = R.send;
    own.reset(R.sched.owned.first, R.sched.owned.count);
    std::uint64_t elems = 0;
    for (std::uint32_t c = own.chunk; c < own.end; ++c) elems += own.chunk_len(c);
    R.t += static_cast<double>(elems) * (codec_.rates.encode_s + codec_.rates.decode_s);
  }

  // Runs rank r until it must wait for a message or for its sends, or until it is done.
  void advance(int r) {
    rank_state& R = ranks_[static_cast<std::size_t>(r)];
    R.waiting = wait::none;
    for (;;) {
      if (!R.in_step) {
        maybe_finalize(R);
        if (R.step == R.sched.steps) {
          R.finished = true;
          return;
        }
        const detail::run& ru = R.sched.runs[R.run];
        const std::int64_t k = R.in_run;
        R.send_peer = ru.send_peer;
        R.recv_peer = ru.recv_peer;
        R.reduce = ru.reduce;
        R.reduce_scatter = ru.reduce_scatter;
        R.exchange = ru.exchange;
        R.send.reset(static_cast<std::uint32_t>(ru.send_first + k * ru.send_stride), ru.send_peer >= 0 ? ru.send_count : 0);
        R.recv.reset(static_cast<std::uint32_t>(ru.recv_first + k * ru.recv_stride), ru.recv_peer >= 0 ? ru.recv_count : 0);
        R.sent = R.received = 0;
        R.send_end = 0;
        R.in_step = true;
        if (ru.fan > 1) start_fan(R, r);
      }
      if (R.fan) R.recv_peer = R.fan_peers[R.fan_i];
      // Round j: send segment j, then receive segment j (the executor's order).
      while (!R.send.done() || !R.recv.done()) {
        if (!R.send.done() && (lead(R) <= ahead_ || R.recv.done())) post(R, static_cast<std::uint32_t>(r), R.send.next());
        if (!R.recv.done() && (lead(R) > ahead_ || R.send.done())) {
          auto it = std::find_if(R.early.begin(), R.early.end(), [&](const arrival& a) {
            return a.src == static_cast<std::uint32_t>(R.recv_peer) && a.ordinal == counter(R.got_from, R.recv_peer);
          });
          if (it == R.early.end()) {
            R.waiting = wait::recv;
            return;
          }
          const double when = it->time;
          *it = R.early.back();
          R.early.pop_back();
          consume(R, when, (same_host(r, R.recv_peer) ? cl_.local : cl_.nic).overhead_s);
          ++counter(R.got_from, R.recv_peer);
          if (R.fan) R.recv_peer = R.fan_peers[R.fan_i];
        }
      }
      if (R.sends_pending) {
        R.waiting = wait::sends;
        return;
      }
      R.t = std::max(R.t, R.send_end);
      R.in_step = false;
      pass_steps(R, std::max<std::uint32_t>(R.fan, 1));
      R.fan = 0;
    }
  }

  // The fan-in whose head step rank r is at (its runs are of one step each): every send of its
  // steps posted at once, then the receives from each step's peer, segment by segment (consume
  // adds a segment when the last peer's copy is in). Flows to several peers share the egress: the
  // simulator posts them interleaved (segment j to every peer, then j + 1) and each as ready when
  // the egress would reach it, because links here are taken first come, first served in order of
  // posting, and m flows all posted at once by every rank would otherwise hold every ingress for
  // a whole rank's sends in turn (64 MiB at 4 ranks: twice the ring's time, where a fair share
  // runs as the ring).
  void start_fan(rank_state& R, int r) {
    const detail::run& head = R.sched.runs[R.run];
    R.fan = head.fan, R.fan_i = 0;
    R.fan_peers.clear();
    for (std::uint32_t i = 0; i < R.fan; ++i) R.fan_peers.push_back(R.sched.runs[R.run + i].recv_peer);
    std::vector<detail::segment_cursor> cur = fan_cursors(R, R.fan);
    fan_headers(R, r);
    // The NIC's egress only: a host's local links are not shared (deliver).
    double egress = R.t;
    for (bool more = true; more;) {
      more = false;
      for (std::uint32_t i = 0; i < R.fan; ++i) {
        if (cur[i].done()) continue;
        const detail::run& f = R.sched.runs[R.run + i];
        R.send_peer = f.send_peer, R.recv_peer = f.recv_peer;
        const std::uint64_t len = cur[i].next();
        const bool nic = !same_host(r, f.send_peer);
        post(R, static_cast<std::uint32_t>(r), len, nic ? egress : 0.0);
        if (nic)
          egress = std::max(egress, R.t) + static_cast<double>(codec_.message_bytes(len)) /
                                               cl_.nic.bandwidth_for(f.send_peer == f.recv_peer);
        more = more || !cur[i].done();
      }
    }
    R.send = cur.back();
    R.recv_peer = R.fan_peers[0];
  }

  // fp32 sends its first step beside the headers and waits for none (see the top); a fan-in
  // waits for every peer's header before it posts anything (the executor's run_fan_in checks
  // them first, as it will read its peers' spans together).
  void fan_headers(rank_state& R, int r) {
    if (!cl_.handshake || !codec_.identity || R.headers_in) return;
    R.headers_in = true;
    for (int p : R.sched.recv_peers) {
      const link_params& l = same_host(p, r) ? cl_.local : cl_.nic;
      R.t = std::max(R.t, l.latency_s + static_cast<double>(header_bytes) / l.bandwidth_Bps);
    }
  }

  // run_symmetric's walk of the fan-in rank R (the one simulated rank) is at; returns its messages.
  std::uint64_t symmetric_fan(rank_state& R, detail::shaper& egress, detail::shaper& ingress) {
    const detail::run& head = R.sched.runs[R.run];
    const std::uint32_t m = head.fan;
    fan_headers(R, 0);  // as rank 0: one rank per host here, every peer across the NIC
    R.reduce = true, R.reduce_scatter = true, R.exchange = false;
    std::vector<detail::segment_cursor> cur = fan_cursors(R, m);
    std::vector<std::vector<double>> arrive(m);
    double pace = R.t, send_end = 0;
    std::uint64_t messages = 0;
    for (bool more = true; more;) {
      more = false;
      for (std::uint32_t i = 0; i < m; ++i) {
        if (cur[i].done()) continue;
        const detail::run& f = R.sched.runs[R.run + i];
        const std::uint64_t len = cur[i].next();
        if (!codec_.identity) R.t += static_cast<double>(len) * codec_.rates.encode_s;
        R.t += cl_.nic.overhead_s;
        const double rate = cl_.nic.bandwidth_for(f.send_peer == f.recv_peer);
        const double bytes = static_cast<double>(codec_.message_bytes(len));
        const double end = detail::transmit(std::array{&egress, &ingress}, std::max(R.t, pace), bytes, rate, cl_.nic);
        pace = std::max(pace, R.t) + bytes / rate;
        send_end = std::max(send_end, end);
        arrive[i].push_back(end + cl_.nic.latency_s);
        ++messages;
        more = more || !cur[i].done();
      }
    }
    R.fan = m, R.fan_i = 0;
    R.recv.reset(head.recv_first, head.recv_count);
    for (std::size_t j = 0; !R.recv.done(); ++j)
      for (std::uint32_t i = 0; i < m; ++i) consume(R, arrive[i].at(j), cl_.nic.overhead_s);
    R.fan = 0;
    R.t = std::max(R.t, send_end);
    pass_steps(R, m);
    return messages;
  }

  // Moves rank R past `steps` steps of its schedule (a fan-in's runs are one step each).
  void pass_steps(rank_state& R, std::uint32_t steps) const {
    for (std::uint32_t i = 0; i < steps; ++i) {
      ++R.step;
      if (++R.in_run == R.sched.runs[R.run].length) ++R.run, R.in_run = 0;
    }
  }

  // The send cursors of the fan-in R is at, one per step, in step order.
  static std::vector<detail::segment_cursor> fan_cursors(const rank_state& R, std::uint32_t m) {
    std::vector<detail::segment_cursor> cur;
    for (std::uint32_t i = 0; i < m; ++i) {
      const detail::run& f = R.sched.runs[R.run + i];
      cur.push_back(R.send);
      cur.back().reset(f.send_first, f.send_count);
    }
    return cur;
  }

  // The message leaves its sender's core: it takes the links of its path, then reaches the peer.
  void deliver(const message& m) {
    const int src = static_cast<int>(m.src), dst = static_cast<int>(m.dst);
    double start = m.ready, end, arrive;
    if (same_host(src, dst)) {
      end = start + static_cast<double>(m.bytes) / cl_.local.bandwidth_for(m.exchange);
      arrive = end + cl_.local.latency_s;
    } else {
      detail::shaper& out = links_[2 * static_cast<std::size_t>(src / cl_.ranks_per_host)];
      detail::shaper& in = links_[2 * static_cast<std::size_t>(dst / cl_.ranks_per_host) + 1];
      const bool core = cl_.switch_bandwidth_Bps > 0;
      // eta: the connection's two-way penalty; a shared core (no buckets there: the constructor
      // refuses them) is one more link the message waits for, and the slower rate decides
      const double rate = (m.exchange ? cl_.nic.exchange_efficiency : 1.0) *
                          (core ? std::min(cl_.nic.bandwidth_Bps, cl_.switch_bandwidth_Bps) : cl_.nic.bandwidth_Bps);
      if (core) start = std::max(start, core_free_);
      end = detail::transmit(std::array{&out, &in}, start, static_cast<double>(m.bytes), rate, cl_.nic);
      if (core) core_free_ = end;
      arrive = end + cl_.nic.latency_s;
    }
    rank_state& S = ranks_[m.src];
    S.send_end = std::max(S.send_end, end);
    if (--S.sends_pending == 0 && S.waiting == wait::sends) advance(src);
    rank_state& D = ranks_[m.dst];
    if (D.waiting == wait::recv && D.recv_peer == src && counter(D.got_from, src) == m.ordinal) {
      consume(D, arrive, (same_host(src, dst) ? cl_.local : cl_.nic).overhead_s);
      ++counter(D.got_from, src);
      advance(dst);
    } else {
      D.early.push_back({m.src, m.ordinal, arrive});
    }
  }

  // An exchange keeps what it sends apart from what it adds into: a lossy codec decodes its wire
  // image back into place, fp32 copies the span (costed as a decode-add: both stream it through
  // memory once more).
  double exchange_copy_s() const noexcept { return codec_.identity ? codec_.rates.decode_add_s : codec_.rates.decode_s; }

  cluster cl_;
  codec_model codec_;
  int size_ = 0, hosts_ = 0;
  std::size_t n_ = 0;
  std::uint64_t seg_ = 1;
  bool finalize_ = true;
  std::int64_t ahead_ = 0;  // sends may lead receives by this many segments
  // How many segments of the current step a rank has sent and not yet received the mirror of.
  static std::int64_t lead(const rank_state& R) noexcept { return std::int64_t{R.sent} - std::int64_t{R.received}; }
  bool last_symmetric_ = false, no_symmetry_ = false;
  int symmetry_checks_ = 16;
  std::vector<detail::shaper> links_;  // (host, direction)
  double core_free_ = 0;               // the shared switch core, when there is one
  std::vector<rank_state> ranks_;
  std::vector<message> heap_;
  std::uint64_t seq_ = 0, messages_ = 0;
};

}  // namespace lockstep::sim
