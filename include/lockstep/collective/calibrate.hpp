// lockstep/collective/calibrate.hpp: topology::automatic with its link measured on a group.
//
//   topology::automatic a = lockstep::calibrate_automatic(g);   // collective: every rank calls it
//
// Measures gamma of fp32, bf16, int8 and dyntree8 on this machine (sim::measure_rates), out of
// cache (16 MiB) and in cache (64 KiB), then
// times fp32 all-reduces, each the median of a few runs, the cases taking turns round by round
// (so that a machine that slows down mid-way slows every case alike, not the last ones; the three
// bulk cases take turns in a phase of their own, last):
//   * the ring (one-way steps) at 4 KiB, 64 KiB and 1 MiB and recursive doubling (pairwise
//     exchanges) at the same sizes (1 MiB on a power of two only): alpha and beta, fitted to the
//     closed forms (sim::fit_alpha_beta; recursive doubling on a power of two, where it has
//     them); up to 256 KiB each run times small_row_calls calls in a row, as a step's small
//     all-reduces come;
//   * the ring and halving-doubling at 1 MiB and 4 MiB (3 ranks and more): the same bytes one way
//     and in pairwise exchanges, so eta (link_params::exchange_efficiency) is what makes the
//     simulator's halving-doubling / ring ratio the measured one;
//   * the same two at 32 MiB, cold (evicted from the caches before each run; 3 ranks and more):
//     the bulk tier's eta, for calls from 16 MiB (automatic::bulk_bytes); and direct there too:
//     where it measured faster than both, automatic offers it for every call of that tier;
//   * the same ring and recursive doubling cases up to 64 KiB (recursive doubling here at every
//     group size, folded where it is not a power of two), on their own, with gamma measured in
//     cache, and fp32's gamma fitted with them (fit_cache_link, through the simulator):
//     automatic's cache tier (automatic::cache_bytes), the link small calls meet; and both at
//     256 KiB, which of the two tiers predicts better: where the tier ends;
//   * direct at 1 MiB and 4 MiB (3 ranks and more) against the ring's times there (at 4 MiB in a
//     row of cold calls, as the segment test's pair): where it measured faster, automatic offers
//     it (automatic::direct_sizes);
//   * the ring at 4 MiB in quarter segments against the group's, three calls back to back per run,
//     each on a cold buffer of its own (as a model's gradient buckets come; one warm call alone
//     after a barrier favours the finer segments, which then lost in a row of calls): the
//     overhead o per message, and
//     whether segments finer than the group's pay at all. Where quartering did not measure faster
//     by automatic's segment_margin, automatic keeps no finer segment size among its candidates:
//     the simulator overlaps a segment's reduction with the next one's transfer, which a transport
//     whose "transfer" is the reducing core reading its peer's memory (shared memory by
//     reference) cannot do, and no o makes it see that (the overlap absorbs it).
// The measurements are averaged over the group (an all_reduce: the same bits on every rank) before
// any of this, so every rank holds the same parameters and makes the same choices. 2.3..2.5 s on
// an idle 2-core machine with 4 ranks of shared memory (machine C, before direct's bulk case),
// about a third of it the bulk cases and more than a third the 4 MiB cases in a row, each with
// its fills and flushes; 1.1..1.6 s on machine D (4 processes over the mpi transport) with
// direct's bulk case, 1.1..1.2 without; 2.2..2.3 s for 4 threads over the inproc transport on
// the Intel Xeon VM of 2026-12-06
// (seconds more over a slow network: the bulk cases move 32 MiB per rank twelve times); on a
// loaded machine the fit describes the load too, which is what the choices then face. Nor are
// single calls after a barrier what a loop of calls meets where ranks share cores: on that Xeon
// (4 processes on 2 cores) halving-doubling's and direct's 1 MiB cases read 2x and 3.5x the
// bench's times for them, the ring's 1.2x, and the eta fitted from them chose halving-doubling's
// schedule at 1 MiB where the ring ran 3..5% faster (docs/benchmarks.md, "Issue 18's targets on
// the Intel Xeon VM again": rows of cold calls and of warm ones, tried there, gained nothing
// that six jobs could show).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <span>
#include <vector>

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#endif

#include "../codec/bf16.hpp"
#include "../codec/dyntree8.hpp"
#include "../codec/fp32.hpp"
#include "../codec/int8.hpp"
#include "../sim/fit.hpp"
#include "../topology/automatic.hpp"
#include "collectives.hpp"

namespace lockstep {

namespace detail {

// One timed case of the calibration.
struct calibration_case {
  enum kind_t : int { ring, recursive_doubling, ring_quarter, halving_doubling, direct } kind = ring;
  std::size_t bytes = 0;
  double seconds = 0;  // the group's mean of every rank's median, per call
  int calls = 1;       // calls back to back per timed run (the segment test's pair)
};

// The size of the bulk tier's cases, per rank: far out of cache, where the bulk calls are (on
// machine C the bench ran halving-doubling 2..7% ahead of the ring at 16 and 64 MiB, cold).
inline constexpr std::size_t bulk_probe_bytes = std::size_t{32} << 20;
// Calls per timed run of the cases that compare large calls as they come: back to back, each on a
// buffer of its own that starts out of cache (a model's gradient buckets, written during the
// backward pass and queued one behind the other; the bench's rotating buffers): the segment test's
// pair, and direct against the ring at 4 MiB (calibration_cases).
inline constexpr int row_calls = 3;
// Calls per timed run of the small cases (up to 256 KiB: the link's alpha and the cache tier):
// back to back, as a training step's small all-reduces come (one per layer's statistics, per
// parameter's norms). One call alone, between other cases, times the ranks' wake-ups more than the
// call where ranks share cores: on the Intel Xeon VM (4 processes on 2 cores) the single 4 KiB ring
// read 41..98 us in two jobs where the bench's loops ran it in 28..32.
inline constexpr int small_row_calls = 8;
inline constexpr std::size_t small_row_max_bytes = std::size_t{256} << 10;
// The calls per run of the ring's and recursive doubling's case of this size.
constexpr int calls_for(std::size_t bytes) { return bytes <= small_row_max_bytes ? small_row_calls : 1; }

// Writes bytes at p back to memory and out of every cache level (x86 with SSE2: clflush;
// elsewhere, and in a CUDA translation unit, nothing: the bulk cases are then timed warm): the
// bulk cases time their buffers cold, as large calls meet theirs (a bucket written long before
// its all-reduce; lockstep-bench-allreduce's rotating buffers). Refilled and timed warm on machine
// C (whose VM reports a 480 MiB L3), halving-doubling and the ring measured alike at 16 and 32
// MiB, while the bench, cold, ran halving-doubling 2..7% ahead at 16 and 64 MiB.
inline void evict(const void* p, std::size_t bytes) {
#if defined(__SSE2__) && !defined(__CUDACC__)
  if (bytes == 0) return;
  const char* c = static_cast<const char*>(p);
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(c) & ~std::uintptr_t{63};
  for (std::uintptr_t a = first; a < reinterpret_cast<std::uintptr_t>(c) + bytes; a += 64)
    _mm_clflush(reinterpret_cast<const void*>(a));
  _mm_mfence();
#else
  (void)p, (void)bytes;
#endif
}

// The cases calibrate_automatic times on a group of `size` ranks.
inline std::vector<calibration_case> calibration_cases(int size) {
  using K = calibration_case;
  std::vector<K> cases;
  if (size < 2) return cases;
  // Sizes where the candidates' times cross (the choices that matter): where latency and
  // bandwidth weigh alike, not far beyond, where every bandwidth-optimal candidate costs the same.
  for (std::size_t b : {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{1} << 20})
    cases.push_back({.kind = K::ring, .bytes = b, .calls = calls_for(b)});
  // Recursive doubling: in the cache tier at every group size (folded where it is not a power of
  // two, fit_cache_link); at 1 MiB, for the link, on a power of two only (its closed forms).
  const bool power_of_two = (size & (size - 1)) == 0;
  for (std::size_t b : {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{1} << 20})
    if (power_of_two || b < (std::size_t{1} << 20))
      cases.push_back({.kind = K::recursive_doubling, .bytes = b, .calls = calls_for(b)});
  // Where the cache tier ends: 256 KiB, the ring's and recursive doubling's.
  constexpr std::size_t probe = std::size_t{256} << 10;
  cases.push_back({.kind = K::ring, .bytes = probe, .calls = calls_for(probe)});
  cases.push_back({.kind = K::recursive_doubling, .bytes = probe, .calls = calls_for(probe)});
  cases.push_back({K::ring, std::size_t{4} << 20});
  // The segment test's pair, row_calls calls back to back per run, each on a cold buffer of its
  // own, as large calls come: one call alone after a barrier read the quarter segments 10% faster
  // in most 4-rank jobs of 2026-12-05 on machine C, whose bench then ran them 10-18% slower
  // (docs/benchmarks.md).
  cases.push_back({.kind = K::ring, .bytes = std::size_t{4} << 20, .calls = row_calls});
  cases.push_back({.kind = K::ring_quarter, .bytes = std::size_t{4} << 20, .calls = row_calls});
  // At 2 ranks every step of every candidate is an exchange: eta is then not told apart from beta.
  if (size > 2)
    for (std::size_t b : {std::size_t{1} << 20, std::size_t{4} << 20}) cases.push_back({K::halving_doubling, b});
  // direct against the ring at the same sizes; at 2 ranks direct is the ring's one exchange. At
  // 4 MiB as the segment test's pair, against its ring: one warm call alone measured direct's
  // margin (memory traffic) away in 4 of 6 4-rank jobs whose bench ran it 12-15% ahead.
  // Not above automatic::direct_max_ranks, where direct is never offered.
  const bool time_direct = size > 2 && size <= topology::automatic::direct_max_ranks;
  if (time_direct) {
    cases.push_back({K::direct, std::size_t{1} << 20});
    cases.push_back({.kind = K::direct, .bytes = std::size_t{4} << 20, .calls = row_calls});
  }
  // The ring and halving-doubling out of cache: the bulk tier's eta (automatic::bulk_bytes); and
  // direct beside them, whether it is offered there. Over the inproc transport on machine D (4
  // ranks) direct took 12..35% less time than either at 16 and 64 MiB in three jobs; over the mpi
  // transport, the same jobs, 8..26% more (its fan-in reads three peers' memory at once, which
  // the threads of one process do from one address space and the processes through the
  // transport's copies).
  if (size > 2) {
    for (K::kind_t k : {K::ring, K::halving_doubling}) cases.push_back({k, bulk_probe_bytes});
    if (time_direct) cases.push_back({K::direct, bulk_probe_bytes});
  }
  return cases;
}

// The elements of a case's buffer: whole chunks of the group.
inline std::size_t calibration_elems(int size, std::size_t bytes) {
  return std::max<std::size_t>(static_cast<std::size_t>(size), bytes / sizeof(float) / static_cast<std::size_t>(size) * static_cast<std::size_t>(size));
}

inline std::size_t quarter_segment(std::size_t group_segment) { return std::max<std::size_t>(4096, group_segment / 4); }

// alpha and beta fitted to the closed forms of the ring's and recursive doubling's cases whose
// size `use` takes; where the two fit no positive beta together, to the ring's alone.
template <class Use>
std::optional<sim::fit_result> fit_ring_and_doubling(const std::vector<calibration_case>& cases, int size,
                                                     std::size_t group_segment, const sim::codec_model& model,
                                                     double eta, Use use) {
  using K = calibration_case;
  std::vector<sim::sample> ring_only, both;
  for (const K& c : cases) {
    if ((c.kind != K::ring && c.kind != K::recursive_doubling) || !use(c.bytes)) continue;
    // recursive doubling has closed forms on a power of two only (folded, its time is no one
    // linear form: fit_cache_link reads its rows off the simulator instead).
    if (c.kind == K::recursive_doubling && (size & (size - 1)) != 0) continue;
    const std::size_t n = calibration_elems(size, c.bytes);
    const sim::cost_terms t = c.kind == K::ring ? sim::ring_terms(size, n, model, group_segment, true, true)
                                                : sim::recursive_doubling_terms(size, n, model, group_segment, true, true);
    sim::sample x = sim::sample_of(t, model.rates, c.seconds);
    // eta is not a free column of this fit: the few exchanges here (whole buffers, in cache up
    // to 1 MiB) cannot tell it from beta (free, it came out at 0.4 on a loaded 2-core machine,
    // and then never chose an exchange where exchanges measured fastest). It is set from the
    // bandwidth-bound pair (fit_calibration), and the exchanges count at beta / eta.
    x.beta_count += x.exchange_count / eta, x.exchange_count = 0;
    both.push_back(x);
    if (c.kind == K::ring) ring_only.push_back(x);
  }
  try {
    return sim::fit_alpha_beta(both);
  } catch (const error&) {
    // Recursive doubling's whole buffer stays in cache up to 1 MiB, where its reductions run
    // faster than the gamma measured out of cache: at 2 ranks its times can fall below that
    // gamma's share alone (no positive beta then).
  }
  try {
    return sim::fit_alpha_beta(ring_only);
  } catch (const error&) {
    // On a loaded machine the times may fit no positive beta.
    return std::nullopt;
  }
}

// The simulator's time for an fp32 all-reduce of `bytes` over `topo`, as automatic asks it.
template <class T>
double simulated_all_reduce(const sim::link_params& link, const sim::codec_model& model, const T& topo, int size,
                            std::size_t bytes, std::size_t segment) {
  sim::cluster cl;
  cl.nic = link;
  cl.segment_bytes = segment;
  cl.segments_ahead = sim::cluster::as_executor;
  return sim::simulator(cl, model).all_reduce(topo, size, calibration_elems(size, bytes)).time_s;
}

// The size whose cases tell where automatic's cache tier ends; no fit takes them in.
inline constexpr std::size_t tier_probe_bytes = std::size_t{256} << 10;

// The cache tier's link (alpha, beta) and, with_gamma, fp32's gamma (its decode-add, the
// reduction) fitted to the ring's and recursive doubling's cases up to in_cache bytes, as the
// simulator times them. Recursive doubling has a closed form only on a power of two; folded onto
// one (3 ranks: 2 alpha, two one-way buffers and 3n reductions, as rank 2's exchange message
// arrives while rank 1 receives the fold; 5 ranks: the later of two chains) it has none that one
// linear form gives. But the simulator's time is, for a fixed schedule, the longest of its paths,
// each linear in alpha, beta and gamma: at a point its derivatives in them are the critical
// path's counts of messages, bytes and values reduced. So each case's row is read off the
// simulator (each parameter moved alone by a part in a thousand), the weighted least squares
// (weights 1 / time) solved, the rows read again at the solution, until the solution stands
// (Gauss-Newton on a piecewise-linear model, at most fit_iterations rounds). Exchanges cost
// beta / eta, eta the start link's; no token bucket (small calls do not fill one). Where one
// segment carries a step (the calibration's sizes at the default 1 MiB segments) the paths on a
// power of two are the closed forms' (sim::ring_terms, recursive_doubling_terms), and so is the
// fit; with finer segments it follows the simulator's pipelining, as automatic's predictions do.
// The ring reduces (N-1)/N of the buffer in all; recursive doubling all of it at every step (fp32:
// 2n values per exchange, its copy of the span aside; folded, once more on the extra ranks'
// partners), so the two kinds tell gamma from beta. The gamma measured alone (sim::measure_rates
// on 64 KiB) is the reduction on a core with nothing else to do; inside a call it can cost more: on
// the Intel Xeon VM (2 processes over the mpi transport) recursive doubling's 64 KiB calls ran
// 22..29% behind the ring's in the calibration and 16..32% in the bench, where the measured gamma
// predicted them ahead (docs/benchmarks.md). At 2 ranks every byte of both is an exchange and eta
// is not fitted, so the fit cannot tell a dearer reduction from dearer exchanges: it charges what
// recursive doubling pays beyond the model per value reduced, which is where that cost grows with
// the size.
// No fit (nullopt) without both kinds at two sizes or more (with_gamma; without it, two cases of
// any kind); where the least squares at the best point reached want alpha or beta at or below 0
// (times that fell with size, a noisy machine), however close to 0 the damped steps came; where
// the rounds did not settle (the best point's own solution more than fit_settle away from it: two
// paths that keep trading places); and, with_gamma, where gamma comes out under
// cache_gamma_margin times the one measured alone: that one is the best of 64 runs and the cases
// are medians of calls, so noise alone puts a free fit at or a little above it (and a reduction
// inside a call is not faster than alone).
inline constexpr double cache_gamma_margin = 1.2;
inline constexpr int fit_iterations = 16;
inline constexpr double fit_settle = 0.05;
struct cache_link_fit {
  double latency_s = 0;
  double beta_s = 0;  // seconds per one-way byte; exchanges at beta / eta
  double decode_add_s = 0;
};

// The simulator's time for a ring or recursive doubling case on alpha, beta (exchanges at
// beta / eta) and fp32's decode-add gamma, theta = {alpha, beta, gamma}; no o, no token bucket.
inline double simulated_case(const calibration_case& c, int size, std::size_t group_segment, const sim::codec_model& model,
                             const sim::link_params& link, const std::array<double, 3>& theta) {
  sim::link_params l = link;
  l.latency_s = theta[0];
  l.bandwidth_Bps = 1.0 / theta[1];
  l.overhead_s = 0;
  l.burst_bytes = 0, l.burst_rate_Bps = 0;
  sim::codec_model m = model;
  m.rates.decode_add_s = theta[2];
  return c.kind == calibration_case::ring
             ? simulated_all_reduce(l, m, topology::ring{}, size, c.bytes, group_segment)
             : simulated_all_reduce(l, m, topology::recursive_doubling{}, size, c.bytes, group_segment);
}

inline std::optional<cache_link_fit> fit_cache_link(const std::vector<calibration_case>& cases, int size,
                                                    std::size_t group_segment, const sim::codec_model& model,
                                                    const sim::link_params& start, std::size_t in_cache,
                                                    bool with_gamma) {
  using K = calibration_case;
  std::vector<const K*> used;
  int rings = 0, doublings = 0;
  for (const K& c : cases)
    if ((c.kind == K::ring || c.kind == K::recursive_doubling) && c.bytes <= in_cache && c.seconds > 0) {
      used.push_back(&c);
      (c.kind == K::ring ? rings : doublings)++;
    }
  if (size < 2 || used.size() < (with_gamma ? 4u : 2u) || (with_gamma && (rings < 2 || doublings < 2))) return std::nullopt;
  const std::size_t k = with_gamma ? 3 : 2;
  // theta: alpha, beta, gamma; a start that is not positive would have no derivative to read.
  std::array<double, 3> theta = {start.latency_s > 0 ? start.latency_s : 1e-6,
                                 start.bandwidth_Bps > 0 && std::isfinite(start.bandwidth_Bps) ? start.beta() : 1e-10,
                                 model.rates.decode_add_s > 0 ? model.rates.decode_add_s : 1e-11};
  auto time_at = [&](const std::array<double, 3>& t, const K& c) { return simulated_case(c, size, group_segment, model, start, t); };
  auto positive = [](const std::array<double, 3>& t) { return t[0] > 0 && t[1] > 0 && t[2] > 0; };
  // The point with the least residual among those the rounds read their rows at (not the start:
  // no fit), and the least squares' solution at it.
  std::optional<std::array<double, 3>> best, best_next;
  double best_residual = 0;
  for (int round = 0; round < fit_iterations; ++round) {
    std::vector<sim::detail::wls_row> rows;
    double residual = 0;
    for (const K* c : used) {
      const double t0 = time_at(theta, *c), w = 1.0 / c->seconds;
      residual += (t0 - c->seconds) * (t0 - c->seconds) * w * w;
      // What no fitted column moves: codec work besides the reduction, and gamma's share where
      // it is not fitted.
      double fixed = t0;
      sim::detail::wls_row r;
      for (std::size_t i = 0; i < k; ++i) {
        std::array<double, 3> moved = theta;
        moved[i] *= 1.001;
        const double d = (time_at(moved, *c) - t0) / (moved[i] - theta[i]);
        fixed -= d * theta[i];
        r.x[i] = d * w;
      }
      r.y = (c->seconds - fixed) * w;
      rows.push_back(r);
    }
    std::array<double, 3> next{};
    const bool solved = sim::detail::least_squares(rows, k, next, 1e-9);
    if (!with_gamma) next[2] = theta[2];
    if (round > 0 && (!best || residual < best_residual)) {
      best = theta, best_residual = residual;
      best_next = solved ? std::optional(next) : std::nullopt;
    }
    if (!solved) break;
    // Rows read on another path than the solution's can point past zero (3 ranks, from the
    // measured gamma: beta < 0): a step part of the way there, halved until every parameter
    // stays positive, and the rows read again.
    for (int halving = 0; halving < 12 && !positive(next); ++halving)
      for (std::size_t i = 0; i < 3; ++i) next[i] = 0.5 * (theta[i] + next[i]);
    if (!positive(next)) break;
    double moved = 0;
    for (std::size_t i = 0; i < 3; ++i) moved = std::max(moved, std::abs(next[i] / theta[i] - 1));
    theta = next;
    // Settled: the rows read at this point give it back (round 0's point is the start, which the
    // next round reads).
    if (moved < 1e-6 && round > 0) break;
  }
  if (!best || !best_next || !positive(*best_next)) return std::nullopt;
  for (std::size_t i = 0; i < 3; ++i)
    if (std::abs((*best_next)[i] / (*best)[i] - 1) > fit_settle) return std::nullopt;
  const cache_link_fit f{(*best)[0], (*best)[1], (*best)[2]};
  if (with_gamma && !(f.decode_add_s >= cache_gamma_margin * model.rates.decode_add_s)) return std::nullopt;
  return f;
}

// Whether some recursive doubling case up to in_cache ran in less time than its reductions alone
// take at the given gamma (alpha and beta next to nothing): its whole buffer reduces in cache,
// faster than the gamma measured; no positive beta fits it then, and the ring's cases alone give
// the tier's link.
inline bool doubling_below_reductions(const std::vector<calibration_case>& cases, int size, std::size_t group_segment,
                                      const sim::codec_model& model, const sim::link_params& link, std::size_t in_cache) {
  for (const calibration_case& c : cases)
    if (c.kind == calibration_case::recursive_doubling && c.bytes <= in_cache && c.seconds > 0 &&
        c.seconds <= simulated_case(c, size, group_segment, model, link, {1e-15, 1e-18, model.rates.decode_add_s}))
      return true;
  return false;
}

// automatic's cache tier (automatic::cache_bytes): alpha and beta fitted (fit_cache_link) to the
// ring's and recursive doubling's times at the sizes that stay in cache (up to 64 KiB), with the
// link's eta and the codecs' gamma measured in cache (a.cache_rates; a.rates where it has none),
// and fp32's gamma with them where the fit takes it (written back to a.cache_rates). Where the two
// kinds fit no positive alpha and beta together, the ring's alone; no tier where those do not
// either (two ring times give the two parameters exactly, noise included: the guards drop what
// noise makes nonsense of). The tier covers the 256 KiB calls too where it predicted their
// measured times better than the link does: where a cache ends depends on the machine (and on how
// many ranks share a core's), so it is measured, not assumed.
inline void fit_cache_tier(topology::automatic& a, int size, std::size_t group_segment,
                           const std::vector<calibration_case>& cases) {
  using K = calibration_case;
  constexpr std::size_t in_cache = std::size_t{64} << 10;
  a.cache_bytes = 0;
  sim::codec_rates fp32_rates = a.cache_rates.count("fp32") ? a.cache_rates.at("fp32") : a.rates["fp32"];
  sim::codec_model model = sim::model_of(codec::fp32{}, fp32_rates);
  std::size_t largest = 0;
  for (const K& c : cases)
    if (c.bytes <= in_cache && (c.kind == K::ring || c.kind == K::recursive_doubling)) largest = std::max(largest, c.bytes);
  a.cache_link = a.link;
  if (const auto g = fit_cache_link(cases, size, group_segment, model, a.link, in_cache, true)) {
    // The tier's fp32 reduces at the gamma its calls measured (the other codecs keep the ones
    // measured alone: no case times them inside a call).
    a.cache_link.latency_s = g->latency_s;
    a.cache_link.bandwidth_Bps = 1.0 / g->beta_s;
    fp32_rates.decode_add_s = g->decode_add_s;
    a.cache_rates["fp32"] = fp32_rates;
    model = sim::model_of(codec::fp32{}, fp32_rates);
  } else {
    // Small calls are alpha's: a fit with no positive alpha (times that fell with size, a noisy
    // machine) would choose them as if messages were free: no tier. Recursive doubling's whole
    // buffer reduces in cache, which can put its times below the measured gamma's share alone (no
    // positive beta with them): then, and only then, the ring's alone.
    std::vector<K> fitted = cases;
    if (doubling_below_reductions(cases, size, group_segment, model, a.link, in_cache))
      std::erase_if(fitted, [](const K& c) { return c.kind != K::ring; });
    const auto f = fit_cache_link(fitted, size, group_segment, model, a.link, in_cache, false);
    if (!f) return;
    a.cache_link.latency_s = f->latency_s;
    a.cache_link.bandwidth_Bps = 1.0 / f->beta_s;
  }
  // Its alpha took in whatever a message costs the core: no o besides (one segment per step here).
  a.cache_link.overhead_s = 0;
  a.cache_bytes = largest;

  // The probe: each tier's predictions of the 256 KiB cases, by the simulator automatic asks;
  // the summed |log(predicted / measured)| of the cache tier no larger than the link's extends it.
  const sim::codec_model link_model = sim::model_of(codec::fp32{}, a.rates["fp32"]);
  double err_cache = 0, err_link = 0;
  int probes = 0;
  for (const K& c : cases) {
    if (c.bytes != tier_probe_bytes || !(c.seconds > 0) || (c.kind != K::ring && c.kind != K::recursive_doubling)) continue;
    auto predict = [&](const sim::link_params& l, const sim::codec_model& m) {
      return c.kind == K::ring ? simulated_all_reduce(l, m, topology::ring{}, size, c.bytes, group_segment)
                               : simulated_all_reduce(l, m, topology::recursive_doubling{}, size, c.bytes, group_segment);
    };
    err_cache += std::abs(std::log(predict(a.cache_link, model) / c.seconds));
    err_link += std::abs(std::log(predict(a.link, link_model) / c.seconds));
    ++probes;
  }
  if (probes > 0 && err_cache <= err_link) a.cache_bytes = tier_probe_bytes;
}

// How much faster than the ring direct must measure to be offered: more than two runs of one case
// differ by on an idle machine (the 4-rank 1 MiB ring ran 543..683 us in six jobs on machine C,
// direct 602..636; at 4 MiB direct measured 10..14% faster).
inline constexpr double direct_margin = 0.05;

// The eta at which the simulator's halving-doubling / ring ratio, ratio(eta), meets the measured
// one (bisection: the ratio falls as eta rises); 1 where exchanges measured no slower than
// predicted at 1, and no lower than 0.3: a slower exchange than that is a machine busy with
// something else (a measured ratio beyond ratio(0.3) converges on 0.3).
template <class Ratio>
double eta_meeting(double measured, Ratio&& ratio) {
  constexpr double eta_min = 0.3;
  if (!(measured > ratio(1.0))) return 1.0;
  double lo = eta_min, hi = 1.0;
  for (int i = 0; i < 24; ++i) {
    const double mid = 0.5 * (lo + hi);
    (ratio(mid) < measured ? hi : lo) = mid;
  }
  return 0.5 * (lo + hi);
}

// The link calibrate_automatic derives from its timed cases (a pure function: tests feed it times
// of their own). `a` carries the rates already and the link to keep where a fit fails.
inline topology::automatic fit_calibration(topology::automatic a, int size, std::size_t group_segment,
                                           const std::vector<calibration_case>& cases) {
  using K = calibration_case;
  if (size < 2) return a;
  auto time_of = [&](K::kind_t k, std::size_t bytes, int calls = 1) {
    for (const K& c : cases)
      if (c.kind == k && c.bytes == bytes && c.calls == calls) return c.seconds;
    return -1.0;
  };
  // The closed forms fitted below have no o term: what a message costs the core ends up in alpha,
  // so an o the link already had (an earlier calibration's) would count twice. A bulk tier from
  // before is not kept either.
  a.link.overhead_s = 0;
  a.bulk_bytes = 0;
  a.bulk_exchange_efficiency = 1.0;
  // direct where it measured faster than the ring by direct_margin (automatic::direct_sizes): a
  // measurement, not a fit, so decided before any fit, which may fail.
  a.direct_sizes.clear();
  for (std::size_t b : {std::size_t{1} << 20, std::size_t{4} << 20}) {
    const int calls = b == (std::size_t{1} << 20) ? 1 : row_calls;
    if (const double d = time_of(K::direct, b, calls), r = time_of(K::ring, b, calls); d > 0 && r > 0 && d < r * (1 - direct_margin))
      a.direct_sizes.push_back(b);
  }
  // Out of cache, against the faster of the ring and halving-doubling (the bulk tier's eta makes
  // the model choose between those two as they measured): offered for every call of the bulk tier
  // (automatic::offers_direct), which starts at half this size where the bulk cases were timed.
  {
    const double d = time_of(K::direct, bulk_probe_bytes), r = time_of(K::ring, bulk_probe_bytes),
                 h = time_of(K::halving_doubling, bulk_probe_bytes);
    if (size > 2 && d > 0 && r > 0 && h > 0 && d < std::min(r, h) * (1 - direct_margin))
      a.direct_sizes.push_back(bulk_probe_bytes);
  }
  // The segment test: the ring at 4 MiB in quarter segments against the group's. It says
  // something only where a ring chunk (4 MiB / size) holds more than one quarter segment (else
  // the two runs are one schedule, from 16 ranks at the default 1 MiB) and the quarter is finer
  // than the group's segment (the 4 KiB floor).
  const std::size_t q = quarter_segment(group_segment), o_bytes = std::size_t{4} << 20;
  const double whole = time_of(K::ring, o_bytes, row_calls), quarter = time_of(K::ring_quarter, o_bytes, row_calls);
  const bool segment_test = whole > 0 && quarter > 0 && q < group_segment && o_bytes / static_cast<std::size_t>(size) > q;
  // Finer segments only where finer segments measured faster, by the margin a choice of them
  // needs (a 4-rank job on 2 cores read quarter / whole from 1.02 to 1.29 in eight calibrations,
  // and once below 1, where they then ran 25% slower). Decided before any fit, which may fail.
  if (segment_test && quarter >= whole * (1 - a.segment_margin))
    std::erase_if(a.segment_choices, [&](std::size_t s) { return s < group_segment; });
  const sim::codec_model model = sim::model_of(codec::fp32{}, a.rates["fp32"]);
  // alpha and beta from the one-way ring and the exchanges of recursive doubling, eta given;
  // where those do not fit together, from the ring alone.
  auto fit_link = [&](double eta) -> bool {
    const auto f = fit_ring_and_doubling(cases, size, group_segment, model, eta, [](std::size_t b) {
      return b <= (std::size_t{1} << 20) && b != tier_probe_bytes;
    });
    if (!f) return false;  // the given link stays
    if (f->link.latency_s >= 0) a.link.latency_s = f->link.latency_s;
    // A fit the simulator cannot use (no bandwidth: times that fell with size on a noisy
    // machine) keeps the given link's value.
    if (f->link.bandwidth_Bps > 0 && std::isfinite(f->link.bandwidth_Bps)) a.link.bandwidth_Bps = f->link.bandwidth_Bps;
    return true;
  };
  auto simulate = [&](const sim::link_params& link, auto topo, std::size_t bytes, std::size_t segment) {
    return simulated_all_reduce(link, model, topo, size, bytes, segment);
  };
  // An eta outside (0, 1] (a caller's) would divide the exchanges' bytes by nothing.
  const double eta_given = a.link.exchange_efficiency > 0 && a.link.exchange_efficiency <= 1 ? a.link.exchange_efficiency : 1.0;
  a.link.exchange_efficiency = eta_given;
  if (!fit_link(eta_given)) {
    fit_cache_tier(a, size, group_segment, cases);
    return a;
  }

  // eta: the measured halving-doubling / ring ratio over 1 and 4 MiB, which the simulator's
  // ratio falls with eta to meet (bisection); 1 where exchanges measured no slower than predicted.
  const double hd1 = time_of(K::halving_doubling, std::size_t{1} << 20), hd4 = time_of(K::halving_doubling, std::size_t{4} << 20);
  const double rg1 = time_of(K::ring, std::size_t{1} << 20), rg4 = time_of(K::ring, std::size_t{4} << 20);
  const double hd = hd1 + hd4, rg = rg1 + rg4;
  if (size > 2 && hd1 > 0 && hd4 > 0 && rg1 > 0 && rg4 > 0) {
    auto ratio = [&](double eta) {
      sim::link_params l = a.link;
      l.exchange_efficiency = eta;
      double h = 0, r = 0;
      for (std::size_t b : {std::size_t{1} << 20, std::size_t{4} << 20}) {
        h += simulate(l, topology::halving_doubling{}, b, group_segment);
        r += simulate(l, topology::ring{}, b, group_segment);
      }
      return h / r;
    };
    const double eta = eta_meeting(hd / rg, ratio);
    a.link.exchange_efficiency = eta;
    // recursive doubling's samples counted their exchanges at beta / eta: once more with this eta
    // (where that fit fails, alpha and beta stay those fitted with eta_given, a close second).
    if (eta != eta_given) fit_link(eta);
  }

  // o from what quartering the segments cost, through the simulator (the model automatic asks):
  // the predicted difference is linear in o; the o that predicts the measured one, then alpha
  // less the 2o per step its fit took in (one segment per step, posted and read).
  if (segment_test) {
    const double measured = quarter - whole;
    auto predicted = [&](double o) {
      sim::link_params l = a.link;
      l.overhead_s = o;
      return simulate(l, topology::ring{}, o_bytes, q) - simulate(l, topology::ring{}, o_bytes, group_segment);
    };
    const double d0 = predicted(0), slope = (predicted(1e-6) - d0) / 1e-6;
    // No more than a whole step of the 4 KiB ring took (a flat slope on a noisy fit would make o
    // anything at all).
    const double o_max = time_of(K::ring, std::size_t{4} << 10, calls_for(std::size_t{4} << 10)) / (2.0 * (size - 1));
    // And only from a difference beyond what separates two runs of one case (a few percent on a
    // shared machine): the overlap makes the slope small, so a model a little off (a fitted eta of
    // 0.62 for 0.6) would otherwise read as microseconds of o.
    if (slope > 0 && measured - d0 > 0.02 * whole && o_max > 0) {
      a.link.overhead_s = std::min((measured - d0) / slope, o_max);
      a.link.latency_s = std::max(0.0, a.link.latency_s - 2 * a.link.overhead_s);
    }
  }
  // The bulk tier: eta again, from the two bulk cases alone, on the link as fitted (o included).
  // The tier starts at half their size: above the 4 MiB the link's eta comes from.
  const double hd_bulk = time_of(K::halving_doubling, bulk_probe_bytes), rg_bulk = time_of(K::ring, bulk_probe_bytes);
  if (size > 2 && hd_bulk > 0 && rg_bulk > 0) {
    a.bulk_exchange_efficiency = eta_meeting(hd_bulk / rg_bulk, [&](double eta) {
      sim::link_params l = a.link;
      l.exchange_efficiency = eta;
      return simulate(l, topology::halving_doubling{}, bulk_probe_bytes, group_segment) /
             simulate(l, topology::ring{}, bulk_probe_bytes, group_segment);
    });
    a.bulk_bytes = bulk_probe_bytes / 2;
  }
  // Last: its 256 KiB probe compares the cache tier with the link as automatic will use it, o
  // included.
  fit_cache_tier(a, size, group_segment, cases);
  return a;
}

}  // namespace detail

template <transport::transport T>
topology::automatic calibrate_automatic(group<T>& g, topology::automatic base = {}) {
  static_assert(!group<T>::ordered, "calibrate_automatic times host groups; give a stream group's link to topology::automatic");
  const int size = g.size();
  std::vector<detail::calibration_case> cases = detail::calibration_cases(size);
  constexpr int codecs = 4;
  // (codec, routine) out of cache, then in cache, then (case): this rank's measurements, averaged
  // over the group below
  const std::size_t cases_at = 2 * codecs * 3;
  std::vector<float> m(cases_at + cases.size(), 0.0f);
  auto put_rates = [&](int i, const sim::codec_rates& r) {
    m[3 * i] = static_cast<float>(r.encode_s * 1e9), m[3 * i + 1] = static_cast<float>(r.decode_s * 1e9);
    m[3 * i + 2] = static_cast<float>(r.decode_add_s * 1e9);
  };
  // Out of cache (16 MiB of fp32), as large buffers meet it, and in cache (64 KiB, the cache
  // tier's largest size; the best of many runs of a few microseconds each).
  for (int tier = 0; tier < 2; ++tier) {
    const std::size_t n = tier == 0 ? std::size_t{1} << 22 : std::size_t{1} << 14;
    const int reps = tier == 0 ? 3 : 64;
    put_rates(tier * codecs + 0, sim::measure_rates(codec::fp32{}, n, reps));
    put_rates(tier * codecs + 1, sim::measure_rates(codec::bf16{}, n, reps));
    put_rates(tier * codecs + 2, sim::measure_rates(codec::int8{}, n, reps));
    put_rates(tier * codecs + 3, sim::measure_rates(codec::dyntree8{}, n, reps));
  }
  codec::fp32 c;
  if (size > 1) {
    using K = detail::calibration_case;
    // Fewer runs of the bulk cases: each takes milliseconds.
    auto reps_of = [](const K& k) { return k.bytes <= (64u << 10) ? 31 : k.bytes >= detail::bulk_probe_bytes ? 3 : 9; };
    // The bulk cases in a phase of their own, after the others: run among them, their buffers
    // would leave every smaller case's run after them to start from cold caches (direct's margin
    // over the ring at 4 MiB, which is memory traffic, was then measured away). They share one
    // buffer, made when the others' are gone.
    auto bulk = [](const K& k) { return k.bytes >= detail::bulk_probe_bytes; };
    std::vector<std::vector<float>> bufs(cases.size());
    std::vector<std::vector<double>> ts(cases.size());
    for (std::size_t i = 0; i < cases.size(); ++i)
      if (!bulk(cases[i]))
        bufs[i].assign(detail::calibration_elems(size, cases[i].bytes) * static_cast<std::size_t>(cases[i].calls), 1.0f);
    std::vector<float> bulk_buf;
    for (const bool phase : {false, true}) {
      if (phase) {
        bufs.clear();
        bulk_buf.assign(detail::calibration_elems(size, detail::bulk_probe_bytes), 1.0f);
      }
      int rounds = 0;
      for (const K& k : cases)
        if (bulk(k) == phase) rounds = std::max(rounds, reps_of(k));
      // Round 0 warms up; then each round times every case that still wants runs, in turn.
      for (int r = 0; r <= rounds; ++r)
        for (std::size_t i = 0; i < cases.size(); ++i) {
          if (bulk(cases[i]) != phase || r > reps_of(cases[i])) continue;
          std::vector<float>& x = phase ? bulk_buf : bufs[i];
          std::fill(x.begin(), x.end(), 1.0f);
          if (phase || cases[i].calls > 1) {
            // Large rows start out of cache, as large calls come; small rows as the fill left them.
            if (phase || cases[i].bytes > detail::small_row_max_bytes) detail::evict(x.data(), x.size() * sizeof(float));
            // Every rank's flush done before any clock starts: on shared cores a rank still
            // flushing would add its flush to both cases' times alike, pulling their ratio to 1.
            barrier(g);
          }
          const std::size_t per_call = x.size() / static_cast<std::size_t>(cases[i].calls);
          const auto t0 = std::chrono::steady_clock::now();
          no_epilogue ep;
          for (int call = 0; call < cases[i].calls; ++call) {
            const std::span<float> s(x.data() + static_cast<std::size_t>(call) * per_call, per_call);
            switch (cases[i].kind) {
              case K::ring: all_reduce(g, s, topology::ring{}, c); break;
              case K::recursive_doubling: all_reduce(g, s, topology::recursive_doubling{}, c); break;
              case K::halving_doubling: all_reduce(g, s, topology::halving_doubling{}, c); break;
              case K::direct: all_reduce(g, s, topology::direct{}, c); break;
              case K::ring_quarter:
                detail::run_call(detail::op_kind::all_reduce, g, s, topology::ring{}, c, reduce_op::sum, -1, ep,
                                 detail::chunk_layout{}, detail::quarter_segment(g.segment_bytes()));
                break;
            }
          }
          const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / cases[i].calls;
          if (r > 0) ts[i].push_back(t);
        }
    }
    // The median, not the best: a call meets the machine as it is, load included.
    for (std::size_t i = 0; i < cases.size(); ++i) {
      std::nth_element(ts[i].begin(), ts[i].begin() + static_cast<std::ptrdiff_t>(ts[i].size() / 2), ts[i].end());
      m[cases_at + i] = static_cast<float>(ts[i][ts[i].size() / 2] * 1e6);
    }
  }
  all_reduce(g, std::span<float>(m), topology::ring{}, c, reduce_op::average);

  topology::automatic a = std::move(base);
  a.forget_choices();  // made on the parameters it had
  const char* names[codecs] = {"fp32", "bf16", "int8", "dyntree8"};
  for (int i = 0; i < codecs; ++i) {
    a.rates[names[i]] = {m[3 * i] * 1e-9, m[3 * i + 1] * 1e-9, m[3 * i + 2] * 1e-9};
    const int j = codecs + i;
    a.cache_rates[names[i]] = {m[3 * j] * 1e-9, m[3 * j + 1] * 1e-9, m[3 * j + 2] * 1e-9};
  }
  for (std::size_t i = 0; i < cases.size(); ++i) cases[i].seconds = m[cases_at + i] * 1e-6;
  return detail::fit_calibration(std::move(a), size, g.segment_bytes(), cases);
}

}  // namespace lockstep
