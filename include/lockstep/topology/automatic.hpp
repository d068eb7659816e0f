// lockstep/topology/automatic.hpp: a topology chosen per call by the cost model.
//
//   topology::automatic a = calibrate_automatic(g);   // link measured on this group (collective/calibrate.hpp)
//   all_reduce(g, grads, a, codec);                              // each call: the predicted fastest
//
// For every call, automatic asks the simulator (sim/simulator.hpp: the discrete-event run of the
// topologies' own schedules, the executor's segments and send window) how long this operation
// would take over each candidate — ring, torus2d (most square), halving_doubling,
// recursive_doubling, direct (where calibration measured it faster: direct_sizes) —
// and each candidate segment size, on the link it was given (alpha, beta, eta; for small buffers,
// those of its cache tier; for large ones, the bulk tier's eta) and the codec's measured gamma,
// and runs the fastest; ties go to the earlier candidate in that order, and a segment size other than the
// group's wins only by segment_margin (10%). NCCL's tuner makes the same choice from tables; this
// one comes from the model the simulator uses, so `lockstep-sim --explain` (or explain() here)
// prints the very numbers a call compared.
//
// Every rank must choose alike: the choice is a pure function of the group size, the count, the
// codec and the parameters held here, and calibrate_automatic() makes those identical on every
// rank (the measurements are averaged over the group before the fit). A rank that still chose differently
// (a different LOCKSTEP_TOPOLOGY, say) sends a different topology fingerprint or segment size in
// its header, and the call fails with errc::mismatch naming both.
//
// LOCKSTEP_TOPOLOGY=ring|torus2d|halving_doubling|recursive_doubling|direct forces one (with the group's
// segment size); read on every choice. A value that names none is an error of the call on that
// rank, which aborts the group (the peers fail at once, naming it, instead of at their timeout).
//
// A codec with error feedback is modelled as its inner codec: whether to keep residuals is each
// rank's own choice over the same wire format (codec/error_feedback.hpp), so ranks with and
// without it must choose alike; the residual's extra passes are not charged. On a stream-ordered
// group (NCCL, inproc_stream) the simulator posts a step's sends at once and exchanges no headers,
// as the executor does there.
//
// Per-rank counts (all_gather_v, reduce_scatter_v) are simulated as the call cuts its buffer, on
// groups of up to per_rank_max_ranks; a layout that is not one part per rank is the call's error.
// Each new layout is a miss (counts that change every call pay a simulation every call), and
// ranks handed different counts may choose different topologies: as for ranks handed different
// counts of any call, their headers then disagree (per-rank counts first), and the rank that reads
// a peer's aborts the group; where the two schedules share no edge that one reads, the call ends
// at the group's timeout instead.
//
// Choices are cached per (operation, group size, count, per-rank counts, codec, segment of the
// group, stream order) in a table the copies of one automatic share, so a training loop's buckets
// pay the simulation once. The collectives choose as a call is issued, on the issuing thread. Cost of a
// miss: a few simulations of every rank's schedule, growing with the count's segments: 7 ms at 8
// ranks and 64 MiB per rank, 50..65 ms at 63..64 ranks and 64 MiB, 0.6..0.9 s at 63..64 ranks
// and 1 GiB, of which direct (offered where calibration measured it fastest in the bulk tier)
// takes about 0.4 s (`lockstep-sim --explain`, Intel Xeon VM, 2026-12-06, with a build beside).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "../codec/concept.hpp"
#include "../core/error.hpp"
#include "../sim/cost_model.hpp"
#include "../sim/fit.hpp"
#include "../sim/simulator.hpp"
#include "concept.hpp"
#include "direct.hpp"
#include "halving_doubling.hpp"
#include "recursive_doubling.hpp"
#include "ring.hpp"
#include "torus2d.hpp"

namespace lockstep::topology {

// One candidate and what the model predicts for it.
struct choice {
  enum kind_t : std::uint8_t { ring, torus2d, halving_doubling, recursive_doubling, direct } kind = ring;
  // Every kind, in the order automatic compares them (a tie goes to the earlier).
  static constexpr kind_t all[] = {ring, torus2d, halving_doubling, recursive_doubling, direct};
  std::size_t segment_bytes = 0;  // the call's segment; 0: the group's own
  double predicted_s = 0;

  static constexpr const char* name_of(kind_t k) noexcept {
    switch (k) {
      case ring: return "ring";
      case torus2d: return "torus2d";
      case halving_doubling: return "halving_doubling";
      case recursive_doubling: return "recursive_doubling";
      case direct: return "direct";
    }
    return "?";
  }
  const char* name() const noexcept { return name_of(kind); }
};

struct automatic {
  // Marks a topology chosen per call (topology::per_call).
  using chooses_per_call = void;

  // The link every pair of ranks is taken to have (the simulator's defaults: 25 us, 1 Gbit/s)
  // and gamma per codec name (codec.name(); a codec without an entry costs no compute).
  sim::link_params link{};
  std::map<std::string, sim::codec_rates> rates{};
  // Segment sizes tried besides the group's own (host groups only: a stream sends a chunk whole);
  // calibrate_automatic drops the finer ones where finer segments measured no faster.
  std::vector<std::size_t> segment_choices{std::size_t{256} << 10, std::size_t{4} << 20};
  // ... taken only where predicted faster than the best at the group's segment by this fraction.
  double segment_margin = 0.10;
  // Calls whose buffer (count fp32 values per rank) is at most cache_bytes are predicted on
  // cache_link and cache_rates (a codec without an entry there: its entry in rates) instead; 0:
  // one link for every size. Where the "link" is the cores copying through shared memory, a
  // small buffer and its messages stay in cache, and bytes move and reduce several times faster
  // than the out-of-cache figures that decide large calls: one link fitted to both had recursive
  // doubling's two 64 KiB exchanges at 44 us where they ran in 26 (4 ranks, docs/benchmarks.md),
  // and chose four messages over them. calibrate_automatic fits this tier on the sizes it timed
  // in cache (to 64 KiB) and ends it there, or at 256 KiB where it predicted those calls better.
  std::size_t cache_bytes = 0;
  sim::link_params cache_link{};
  std::map<std::string, sim::codec_rates> cache_rates{};
  // Sizes (bytes per rank) at which topology::direct measured faster than the ring on this group:
  // direct is a candidate for calls within a factor of two of one of them (by default none); a
  // size in the bulk tier (at least bulk_bytes > 0, far out of cache, where every call is bound by
  // memory alike) offers it for every call from half that size up. So the bulk rule follows
  // bulk_bytes: where the bulk fit failed (bulk_bytes 0) such a size is a factor-of-two window
  // like the others, and after editing either field call forget_choices(), as after any edit.
  // Its gain on a host is memory traffic, which the model has only in part (the fan-in's one pass, not the
  // transport's own copies nor the streamed final copies): over the mpi transport on machine C (4
  // ranks) direct ran 10..14% faster than the ring at 4 MiB and 10..15% slower at 1 MiB, where the
  // simulator predicted it 4..9% faster at both; on machine D at 16 and 64 MiB it took 12..35%
  // less time than the ring and halving-doubling over the inproc transport and 8..26% more over
  // the mpi transport (docs/benchmarks.md). calibrate_automatic times it at 1 and 4 MiB against the
  // ring, and cold at 32 MiB against the ring and halving-doubling, all-reduces on its group,
  // so direct is offered for all-reduces and reduce-scatters (the fan-in is the reduce-scatter's;
  // an all-gather or broadcast over direct is a ring's steps to other peers), on groups of at most
  // direct_max_ranks, never on a stream (whose reduce-scatter does not fan in).
  std::vector<std::size_t> direct_sizes{};
  // Above it, simulating direct costs what a call should not pay: its steps have a peer each and
  // compress to no runs, so a count the ranks do not divide evenly (no symmetric shortcut) runs
  // every rank's N - 1 fans in full, about 3 s at 1024 ranks.
  static constexpr int direct_max_ranks = 64;
  // Up to this group size a call with per-rank counts is simulated with them; above, as equal
  // chunks of the same total, cached once per total: each new layout is a miss, and a miss on
  // hundreds of ranks costs the issuing thread a second or more.
  static constexpr int per_rank_max_ranks = 64;

  // Whether direct is among a call's candidates.
  bool offers_direct(operation op, int size, std::size_t count, bool stream_ordered) const noexcept {
    if (stream_ordered || size > direct_max_ranks || (op != operation::all_reduce && op != operation::reduce_scatter))
      return false;
    const double bytes = static_cast<double>(count) * sizeof(float);
    for (std::size_t b : direct_sizes)
      if (bytes >= 0.5 * static_cast<double>(b) && (bytes <= 2.0 * static_cast<double>(b) || (bulk_bytes > 0 && b >= bulk_bytes)))
        return true;
    return false;
  }

  // Calls of at least bulk_bytes per rank (0: no such tier) are predicted with exchanges at
  // bulk_exchange_efficiency instead of link.exchange_efficiency. Where the "link" is the cores
  // copying through shared memory, how an exchange step compares with a one-way step changes once
  // the buffers come from memory: over the mpi transport on machine C (4 ranks) halving-doubling
  // ran 0..5% slower than the ring at 1 and 4 MiB and 2..7% faster at 16 and 64 MiB, where the one
  // eta fitted at 1 and 4 MiB chose the ring (docs/benchmarks.md). calibrate_automatic fits this
  // eta on the ring and halving-doubling at 32 MiB, cold, and starts the tier at 16 MiB, on groups
  // of 3 ranks and more (at 2, halving-doubling is the ring).
  std::size_t bulk_bytes = 0;
  double bulk_exchange_efficiency = 1.0;

  // Whether a call of `count` values is predicted on the cache tier, on the bulk tier.
  bool in_cache(std::size_t count) const noexcept { return cache_bytes > 0 && count <= cache_bytes / sizeof(float); }
  bool in_bulk(std::size_t count) const noexcept {
    return bulk_bytes > 0 && !in_cache(count) && count >= bulk_bytes / sizeof(float) + (bulk_bytes % sizeof(float) != 0);
  }
  sim::link_params link_for(std::size_t count) const noexcept {
    if (in_cache(count)) return cache_link;
    sim::link_params l = link;
    if (in_bulk(count)) l.exchange_efficiency = bulk_exchange_efficiency;
    return l;
  }

  std::string name() const { return "automatic"; }
  // The topology LOCKSTEP_TOPOLOGY forces, if any (throws naming a value that names none): what
  // every call runs, whatever explain() predicts.
  static std::optional<choice::kind_t> forced_by_environment(int rank = -1) { return forced(rank); }
  void validate(int size, int rank = -1) const {
    if (size < 1) throw error(errc::invalid_argument, "automatic", rank, -1, "group size " + std::to_string(size));
    forced(rank);
  }

  // Calls f with the topology a choice names (torus2d: the most square shape).
  template <class F>
  static decltype(auto) visit(choice::kind_t k, F&& f) {
    switch (k) {
      case choice::torus2d: return f(topology::torus2d{});
      case choice::halving_doubling: return f(topology::halving_doubling{});
      case choice::recursive_doubling: return f(topology::recursive_doubling{});
      case choice::direct: return f(topology::direct{});
      case choice::ring: break;
    }
    return f(topology::ring{});
  }

  // Every candidate for this call, in the order they are compared, each with its predicted time.
  //
  // offsets: where the call has per-rank counts (all_gather_v, reduce_scatter_v), rank r's part of
  // the count is [offsets[r], offsets[r + 1]) (size + 1 of them, ending at count); empty: equal parts.
  template <codec::codec C>
  std::vector<choice> explain(operation op, int size, std::size_t count, const C& codec, std::size_t group_segment,
                              bool stream_ordered = false, std::span<const std::size_t> offsets = {}) const {
    // Error feedback is each rank's own choice over the same wire format (codec/error_feedback.hpp),
    // which the header does not check: a rank with it and a rank without must choose alike, so
    // both are modelled as the inner codec (its measured gamma; the residual's extra passes are
    // not charged).
    if constexpr (requires { codec.inner(); requires codec::feedback_codec<C>; })
      return explain(op, size, count, codec.inner(), group_segment, stream_ordered, offsets);
    const auto it = rates.find(std::string(codec.name()));
    return explain(op, size, count, sim::model_of(codec, it == rates.end() ? sim::codec_rates{} : it->second),
                   group_segment, stream_ordered, offsets);
  }
  // The same for a codec the simulator knows by its model (lockstep-sim --explain): its own rates,
  // or cache_rates' entry for it on a call in cache.
  std::vector<choice> explain(operation op, int size, std::size_t count, sim::codec_model model,
                              std::size_t group_segment, bool stream_ordered = false,
                              std::span<const std::size_t> offsets = {}) const {
    validate(size);
    check_offsets(op, size, count, offsets);
    if (size > per_rank_max_ranks) offsets = {};
    if (in_cache(count))
      if (const auto it = cache_rates.find(model.name); it != cache_rates.end()) model.rates = it->second;
    std::vector<std::size_t> segs{group_segment};
    if (!stream_ordered)
      for (std::size_t s : segment_choices)
        if (s != group_segment && s > 0) segs.push_back(s);
    std::vector<choice> out;
    for (auto k : choice::all) {
      if (k == choice::direct && !offers_direct(op, size, count, stream_ordered)) continue;
      for (std::size_t s : segs) {
        sim::cluster cl;
        cl.nic = link_for(count);
        cl.segment_bytes = s;
        cl.segments_ahead = sim::cluster::as_executor;
        if (stream_ordered) {
          // As the executor on a stream: a step's sends all posted at once, whatever the codec,
          // and no headers (executor.hpp: exchanges_headers).
          cl.send_ahead = true;
          cl.handshake = false;
        }
        const double t = visit(k, [&](const auto& topo) { return predict(cl, model, topo, op, size, count, offsets); });
        out.push_back({k, s == group_segment ? 0 : s, t});
      }
    }
    return out;
  }

  // Which of explain()'s candidates a call takes: the fastest at the group's segment (the earlier
  // on a tie), unless another segment size is predicted faster than it by more than `margin`:
  // what segments overlap is the model's finest effect and what a message costs its least
  // certain part (256 KiB segments it predicted 6% faster at 4 MiB ran 10..20% slower,
  // docs/benchmarks.md).
  static std::size_t pick(const std::vector<choice>& all, double margin) {
    std::size_t best = 0, other = all.size();
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (all[i].segment_bytes == 0 && all[i].predicted_s < all[best].predicted_s) best = i;
      if (all[i].segment_bytes != 0 && (other == all.size() || all[i].predicted_s < all[other].predicted_s)) other = i;
    }
    if (other < all.size() && all[other].predicted_s < all[best].predicted_s * (1 - margin)) best = other;
    return best;
  }

  // Forgets the cached choices of this copy (and of copies made from it from now on), as after
  // its parameters changed: calibrate_automatic does it.
  void forget_choices() { cache_ = std::make_shared<cache>(); }

  // The choice for this call: forced by LOCKSTEP_TOPOLOGY, else the fastest prediction. `rank`
  // names the caller in an error. A cached choice costs no allocation: small all-reduces (batch
  // norm's statistics, LARS's norms) take a few microseconds, and the choice is on their path.
  // offsets as for explain(), and layout_id a fingerprint of them (0 for none: the cache's key;
  // the offsets themselves are compared on a hit).
  template <codec::codec C>
  choice choose(operation op, int size, std::size_t count, const C& codec, std::size_t group_segment,
                bool stream_ordered = false, int rank = -1, std::span<const std::size_t> offsets = {},
                std::uint64_t layout_id = 0) const {
    if (auto f = forced(rank)) return {*f, 0, 0};
    if (size < 1) throw error(errc::invalid_argument, "automatic", rank, -1, "group size " + std::to_string(size));
    if (size == 1) return {choice::ring, 0, 0};
    if constexpr (requires { codec.inner(); requires codec::feedback_codec<C>; })  // as explain() above
      return choose(op, size, count, codec.inner(), group_segment, stream_ordered, rank, offsets, layout_id);
    if (size > per_rank_max_ranks) offsets = {}, layout_id = 0;  // predicted as equal parts (explain)
    if (offsets.empty()) layout_id = 0;
    // A codec's name may be a std::string made by the call (error_feedback of a codec with a
    // run-time name): kept alive here, as the view below reads it.
    const auto name_storage = codec.name();
    const std::string_view name = name_storage;
    const key k{op, size, count, codec.id(), group_segment, stream_ordered, layout_id};
    {
      std::lock_guard lk(cache_->m);
      // The codec's id is a 32-bit fingerprint: the name rules out another codec's colliding one;
      // and the offsets, another layout's colliding fingerprint.
      if (auto it = cache_->table.find(k); it != cache_->table.end() && it->second.codec == name && it->second.same_layout(offsets))
        return it->second.pick;
    }
    const std::vector<choice> all = explain(op, size, count, codec, group_segment, stream_ordered, offsets);
    const choice best = all[pick(all, segment_margin)];
    std::lock_guard lk(cache_->m);
    if (cache_->table.size() >= max_cached) cache_->table.clear();
    cache_->table.insert_or_assign(k, entry{std::string(name), {offsets.begin(), offsets.end()}, best});
    return best;
  }

 private:
  // Per-rank counts belong to the two operations that have them, one part per rank, covering count.
  static void check_offsets(operation op, int size, std::size_t count, std::span<const std::size_t> offsets) {
    if (offsets.empty()) return;
    auto bad = [](const std::string& why) { return error(errc::invalid_argument, "automatic", -1, -1, why); };
    if (op != operation::reduce_scatter && op != operation::all_gather)
      throw bad("per-rank counts are for reduce_scatter and all_gather, not all_reduce or broadcast");
    if (offsets.size() != static_cast<std::size_t>(size) + 1 || offsets.front() != 0 || offsets.back() != count ||
        !std::ranges::is_sorted(offsets))
      throw bad(std::to_string(offsets.size()) + " offsets from " + std::to_string(offsets.front()) + " to " +
                std::to_string(offsets.back()) + ": want " + std::to_string(size + 1) + ", rising from 0 to the count " +
                std::to_string(count));
  }

  template <class T>
  static double predict(const sim::cluster& cl, const sim::codec_model& model, const T& topo, operation op, int size,
                        std::size_t count, std::span<const std::size_t> offsets) {
    sim::simulator s(cl, model);
    switch (op) {
      case operation::all_reduce: return s.all_reduce(topo, size, count).time_s;
      case operation::reduce_scatter:
        return s.run(size, count, [&](int r) { return topo.reduce_scatter(r, size); }, false, offsets).time_s;
      case operation::all_gather:
        return s.run(size, count, [&](int r) { return topo.all_gather(r, size); }, true, offsets).time_s;
      case operation::broadcast:
        return s.run(size, count, [&](int r) { return broadcast_schedule(topo, 0, r, size); }, false).time_s;
    }
    return 0;
  }

  // LOCKSTEP_TOPOLOGY's choice; throws naming the value when it names no candidate.
  static std::optional<choice::kind_t> forced(int rank) {
    const char* e = std::getenv("LOCKSTEP_TOPOLOGY");
    if (!e || !*e || std::string(e) == "automatic") return std::nullopt;
    for (auto k : choice::all)
      if (std::string(e) == choice::name_of(k)) return k;
    throw error(errc::invalid_argument, "automatic", rank, -1,
                std::string("LOCKSTEP_TOPOLOGY=") + e +
                    ": not ring, torus2d, halving_doubling, recursive_doubling, direct or automatic");
  }

  // (operation, group size, count, codec id, group segment, stream-ordered, layout id) -> entry
  using key = std::tuple<operation, int, std::size_t, std::uint32_t, std::size_t, bool, std::uint64_t>;
  struct entry {
    std::string codec;                 // the codec's name
    std::vector<std::size_t> offsets;  // the per-rank counts' offsets (empty: equal parts)
    choice pick;
    // A loop, not std::ranges::equal: GCC 12 warns of a null memcmp argument for two empty ranges.
    bool same_layout(std::span<const std::size_t> o) const noexcept {
      if (o.size() != offsets.size()) return false;
      for (std::size_t i = 0; i < o.size(); ++i)
        if (o[i] != offsets[i]) return false;
      return true;
    }
  };
  struct cache {
    std::mutex m;
    std::map<key, entry> table;
  };
  static constexpr std::size_t max_cached = 4096;
  std::shared_ptr<cache> cache_ = std::make_shared<cache>();
};

}  // namespace lockstep::topology
