// lockstep/sim/hybrid.hpp: one training step of a column-split FC followed by a row-split FC
// (parallel/), against the same layers data-parallel, modelled: every collective of the step is
// simulated on its own schedule (simulator::run, per-rank counts as all_gather_v and
// reduce_scatter_v cut them), and the products take flops / rate (the caller's measured matmul
// rate). Two resources per rank, as the layers use them: the group's worker runs the collectives
// one after another, the calling thread the products; parallel/exchange.hpp's order decides what
// waits for what:
//   gather phase (fc1 forward, fc2 backward): every round posted at once; round r's product starts
//     when round r has arrived and round r-1's product is done;
//   reduce phase (fc1 backward, fc2 forward): round r's product, then its collective, which starts
//     when the product is done and round r-1's collective is; `overlap` work (dW) after the last
//     product.
// Broadcasts (by_rank's gather rounds) are the root's scatter in closed form plus the simulated
// all-gather. Where a rank has fewer cores than its lanes have threads (host_cores), the two lanes
// are not independent: a collective's CPU part (its time on links of unbounded bandwidth: the
// latency of its messages, which on shared cores is mostly waiting to be scheduled, their o and the
// codec's work) comes out of the products' time while the two run at once, and where
// host_cores::busy_latency_s is given, the collective's messages wait that long each (for their
// receiver to be scheduled between the products' threads) for the part of its time the products
// run beside it, as measured on netlab's hosts sharing 2 cores. What it leaves out: the
// descriptor's latency beyond one small all-gather, and the classifier (replicated, tiny) beyond
// its product and one all-reduce. Ranks are taken to hold equal rows, so the slowest rank is any rank.
// hybrid_model_step / data_parallel_model_step put the head between data-parallel convolutions
// (a whole CNN step, the papers' settings: bench/hybrid_projection.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "../collective/executor.hpp"
#include "../parallel/scheme.hpp"
#include "../topology/ring.hpp"
#include "simulator.hpp"

namespace lockstep::sim {

struct fc_head {
  int ranks = 4;
  std::size_t rows = 32;  // per rank
  std::size_t F = 2048, H1 = 4096, H2 = 4096, NC = 10;
};

// The cores one rank's lanes share. The worker (collectives) has a core of its own beside the
// compute_threads of the products only where cores_per_rank >= compute_threads + 1; with fewer,
// the fraction serial() of a collective's CPU part delays the products it runs beside (1 where
// the products alone fill the rank's cores, as netlab's hosts sharing one machine). 0: a core for
// each lane, the lanes independent.
struct host_cores {
  double cores_per_rank = 0;
  int compute_threads = 1;
  // α of a message while the products fill the rank's cores (0: as idle). Where serial() > 0, a
  // collective that runs while the products run sees it for the part of its time they overlap:
  // each hop waits for its receiver to be scheduled between the products' threads.
  double busy_latency_s = 0;
  constexpr double serial() const noexcept {
    if (cores_per_rank <= 0) return 0.0;
    return std::clamp(compute_threads + 1.0 - cores_per_rank, 0.0, 1.0);
  }
};

struct step_estimate {
  double step_s = 0;
  double compute_s = 0;  // products alone
  double comm_s = 0;     // collectives alone, back to back (no products beside them: the idle α)
};

namespace detail {

inline double collective_s(const cluster& cl, const codec_model& c, int K, std::size_t n,
                           const std::function<topology::schedule(int)>& sched, bool finalize,
                           std::span<const std::size_t> offsets = {}) {
  if (K < 2 || n == 0) return 0.0;
  simulator s(cl, c);
  return s.run(K, n, sched, finalize, offsets).time_s;
}

// The cluster with links of unbounded bandwidth: what a collective takes there is its CPU part
// (the latencies, o and the codec's work), the rest is the wire's.
inline cluster without_wire(cluster cl) {
  for (link_params* l : {&cl.nic, &cl.local}) {
    l->bandwidth_Bps *= 1e9;
    l->burst_bytes = 0;
    l->burst_rate_Bps = 0;
  }
  cl.switch_bandwidth_Bps = 0;
  return cl;
}

// A collective's time and its CPU part.
struct cost {
  double t = 0, cpu = 0;
  double t_busy = 0;  // its time with host_cores::busy_latency_s per message (0: not simulated)
};

// The cluster whose messages wait `latency_s` each (the busy α), where that is more than its own.
inline cluster with_latency(cluster cl, double latency_s) {
  for (link_params* l : {&cl.nic, &cl.local}) l->latency_s = std::max(l->latency_s, latency_s);
  return cl;
}

// One round's collective: a gather (all_gather_v, or a broadcast from the one rank taking part)
// or a reduce (reduce_scatter_v) of `width` values per row.
inline double round_time_s(const cluster& cl, const codec_model& c, int K, const parallel::round_blocks& r, std::size_t width,
                           bool gather) {
  std::vector<std::size_t> off(static_cast<std::size_t>(K) + 1, 0);
  int contributors = 0, root = -1;
  for (int k = 0; k < K; ++k) {
    const std::size_t m = r[static_cast<std::size_t>(k)].size();
    off[static_cast<std::size_t>(k) + 1] = off[static_cast<std::size_t>(k)] + m * width;
    if (m) ++contributors, root = k;
  }
  const std::size_t n = off.back();
  const topology::ring ring;
  if (gather && contributors == 1) {
    // broadcast = the root's scatter (K - 1 chunks, one after another out of its NIC) + the ring's
    // all-gather. The simulator matches a message to its step number, and the root's k-th scatter
    // send meets its receiver's first step, so the scatter is costed here in closed form.
    (void)root;
    const double chunk_bytes = static_cast<double>(c.message_bytes((n + static_cast<std::size_t>(K) - 1) / static_cast<std::size_t>(K)));
    const double scatter = (K - 1) * (cl.nic.latency_s + chunk_bytes / cl.nic.bandwidth_Bps);
    return scatter + collective_s(cl, c, K, n, [&](int q) { return ring.all_gather(q, K); }, true);
  }
  if (gather) return collective_s(cl, c, K, n, [&](int q) { return ring.all_gather(q, K); }, true, off);
  return collective_s(cl, c, K, n, [&](int q) { return ring.reduce_scatter(q, K); }, false, off);
}

// The CPU part is simulated only where the lanes share cores (with_cpu): it costs a second run.
inline cost round_cost(const cluster& cl, const codec_model& c, int K, const parallel::round_blocks& r, std::size_t width,
                       bool gather, bool with_cpu, double busy_latency_s = 0) {
  cost x{round_time_s(cl, c, K, r, width, gather), with_cpu ? round_time_s(without_wire(cl), c, K, r, width, gather) : 0.0};
  if (with_cpu && busy_latency_s > 0) x.t_busy = round_time_s(with_latency(cl, busy_latency_s), c, K, r, width, gather);
  return x;
}

inline cost collective_cost(const cluster& cl, const codec_model& c, int K, std::size_t n,
                            const std::function<topology::schedule(int)>& sched, bool finalize, bool with_cpu,
                            double busy_latency_s = 0) {
  cost x{collective_s(cl, c, K, n, sched, finalize), with_cpu ? collective_s(without_wire(cl), c, K, n, sched, finalize) : 0.0};
  if (with_cpu && busy_latency_s > 0) x.t_busy = collective_s(with_latency(cl, busy_latency_s), c, K, n, sched, finalize);
  return x;
}

struct timeline {
  double compute = 0, comm = 0;  // when each resource is next free
  double computing = 0, communicating = 0;
  double serial = 0;             // host_cores::serial()
  bool busy_pace = true;         // false: every collective at its idle pace (t_busy ignored)
  // What collective x, running from `start`, takes from the products while the compute lane is
  // busy until `busy_until`: its CPU part in proportion to the time the two overlap.
  double contention(const cost& x, double start, double busy_until) const {
    if (serial <= 0 || x.t <= 0) return 0.0;
    const double overlap = std::clamp(busy_until - start, 0.0, x.t);
    return serial * x.cpu * overlap / x.t;
  }
  // Collective x started at `start` while the products run until `busy_until`: it moves at its busy
  // pace (t_busy) while they overlap, at its idle pace (t) after. Its time; what the products lose
  // to it stays contention(x, ...) of its idle pace: the longer time is its messages waiting for
  // the products' threads, not more work of its own.
  double running(const cost& x, double start, double busy_until) const {
    const double window = busy_until - start;
    if (!busy_pace || serial <= 0 || x.t_busy <= x.t || window <= 0) return x.t;
    if (x.t_busy <= window) return x.t_busy;
    return window + (1.0 - window / x.t_busy) * x.t;
  }
};

inline double step_end(const timeline& t) { return std::max(t.compute, t.comm); }

// rounds: the round's collective, its product's seconds.
inline void gather_phase(timeline& t, const std::vector<cost>& comm, const std::vector<double>& work) {
  double c = std::max(t.comm, t.compute);
  for (std::size_t r = 0; r < comm.size(); ++r) {
    const double start = c;
    // earlier rounds' products run until t.compute while round r moves
    const double took = t.running(comm[r], start, t.compute);
    c += took;
    t.compute += t.contention(comm[r], start, t.compute);
    t.compute = std::max(t.compute, c) + work[r];
    t.communicating += comm[r].t, t.computing += work[r];
  }
  t.comm = c;
}
inline void reduce_phase(timeline& t, const std::vector<double>& work, const std::vector<cost>& comm, double overlap) {
  t.compute = std::max(t.compute, t.comm);
  for (std::size_t r = 0; r < comm.size(); ++r) {
    t.compute += work[r];
    const double start = std::max(t.comm, t.compute);
    // The products do not wait for the rounds: round r moves while every later product and the
    // overlap work run back to back (rounds never overlap each other, so nothing counts twice).
    double rest = overlap;
    for (std::size_t q = r + 1; q < work.size(); ++q) rest += work[q];
    t.comm = start + t.running(comm[r], start, t.compute + rest);
    t.compute += t.contention(comm[r], start, t.compute + rest);
    t.communicating += comm[r].t, t.computing += work[r];
  }
  t.compute += overlap;
  t.computing += overlap;
}

}  // namespace detail

// The hybrid step of parallel::column_linear (F -> H1) + row_linear (H1 -> H2) with scheme S and
// activations in `act`, then the replicated classifier (H2 -> NC, its gradients all-reduced in fp32).
template <parallel::scheme S>
step_estimate hybrid_step(const cluster& cl, const codec_model& act, const codec_model& fp32, const fc_head& h,
                          double flops_per_s, const host_cores& cores = {}) {
  const int K = h.ranks;
  const std::vector<std::size_t> rows(static_cast<std::size_t>(K), h.rows);
  const auto rounds = S::rounds(rows);
  const std::size_t B = h.rows * static_cast<std::size_t>(K);
  const double n_k = static_cast<double>(h.H1) / K;  // columns of fc1, input rows of fc2, per rank
  auto mm = [&](double m, double n, double k) { return 2.0 * m * n * k / flops_per_s; };
  const bool with_cpu = cores.serial() > 0;
  std::vector<detail::cost> g_fwd, r_fwd, g_bwd, r_bwd;
  std::vector<double> w1, w2, w3, w4;
  for (const auto& r : rounds) {
    std::size_t m = 0;
    for (const auto& b : r) m += b.size();
    const double md = static_cast<double>(m);
    const double busy = cores.busy_latency_s;
    g_fwd.push_back(detail::round_cost(cl, act, K, r, h.F, true, with_cpu, busy));    // X rows
    w1.push_back(mm(md, n_k, static_cast<double>(h.F)));            // Y_k = X W_k
    w2.push_back(mm(md, static_cast<double>(h.H2), n_k));           // partial Y2 = H_k W2_k
    r_fwd.push_back(detail::round_cost(cl, act, K, r, h.H2, false, with_cpu, busy));   // Y2 to its rows' owners
    g_bwd.push_back(detail::round_cost(cl, act, K, r, h.H2, true, with_cpu, busy));    // dY2 rows
    w3.push_back(mm(md, n_k, static_cast<double>(h.H2)));           // dH_k = dY2 W2_kᵀ
    w4.push_back(mm(md, static_cast<double>(h.F), n_k));           // dX partial = dY1_k W_kᵀ
    r_bwd.push_back(detail::round_cost(cl, act, K, r, h.F, false, with_cpu, busy));    // dX to its rows' owners
  }
  const double Bd = static_cast<double>(B), rows_d = static_cast<double>(h.rows);
  const double desc = detail::collective_s(cl, fp32, K, 10u * static_cast<std::size_t>(K),
                                           [&](int q) { return topology::ring{}.all_gather(q, K); }, true);
  const double classifier = 3 * mm(rows_d, static_cast<double>(h.NC), static_cast<double>(h.H2));
  const double classifier_ar = detail::collective_s(cl, fp32, K, h.H2 * h.NC,
                                                    [&](int q) { return topology::all_reduce_schedule(topology::ring{}, q, K); }, true);
  auto run = [&](bool busy_pace) {
    detail::timeline t;
    t.serial = cores.serial();
    t.busy_pace = busy_pace;
    t.comm = t.compute = desc;
    detail::gather_phase(t, g_fwd, w1);
    t.compute = t.comm = std::max(t.compute, t.comm) + desc;  // fc2's descriptor, after fc1's products
    detail::reduce_phase(t, w2, r_fwd, 0.0);
    t.compute = std::max(t.compute, t.comm) + classifier;
    // the worker runs it before fc2's backward rounds, queued behind it; nothing overlaps it but ReLU
    t.comm = std::max(t.comm, t.compute) + classifier_ar;
    detail::gather_phase(t, g_bwd, w3);
    t.compute += mm(n_k, static_cast<double>(h.H2), Bd);  // dW2 = H_kᵀ dY2
    detail::reduce_phase(t, w4, r_bwd, mm(static_cast<double>(h.F), n_k, Bd));  // overlap: dW1 = Xᵀ dY1_k
    return t;
  };
  const detail::timeline t = run(true);
  step_estimate e;
  // A round that waits longer starts the next one later, which then overlaps fewer products and
  // charges them less of its CPU part: the busy pace can shorten the timeline. Messages that wait
  // longer never make a step faster, so the step is at least its idle-paced one.
  e.step_s = std::max(std::max(t.compute, t.comm), detail::step_end(run(false)));
  e.compute_s = t.computing + classifier + mm(n_k, static_cast<double>(h.H2), Bd);
  e.comm_s = t.communicating + 2 * desc + classifier_ar;
  return e;
}

// The same head data-parallel: every rank computes its rows through the whole head and all-reduces
// each layer's gradients (codec `grads`) as backward produces them, one after another.
inline step_estimate data_parallel_step(const cluster& cl, const codec_model& grads, const fc_head& h, double flops_per_s,
                                        const host_cores& cores = {}) {
  const int K = h.ranks;
  const double m = static_cast<double>(h.rows);
  auto mm = [&](double a, double b, double c) { return 2.0 * a * b * c / flops_per_s; };
  auto ar = [&](std::size_t n) {
    return detail::collective_cost(cl, grads, K, n,
                                   [&](int q) { return topology::all_reduce_schedule(topology::ring{}, q, K); }, true,
                                   cores.serial() > 0, cores.busy_latency_s);
  };
  const double F = static_cast<double>(h.F), H1 = static_cast<double>(h.H1), H2 = static_cast<double>(h.H2),
               NC = static_cast<double>(h.NC);
  const double fwd = mm(m, H1, F) + mm(m, H2, H1) + mm(m, NC, H2);
  const double b3 = 2 * mm(m, NC, H2), b2 = 2 * mm(m, H2, H1), b1 = 2 * mm(m, H1, F);
  const detail::cost a3 = ar(h.H2 * h.NC), a2 = ar(h.H1 * h.H2), a1 = ar(h.F * h.H1);
  auto run = [&](bool busy_pace) {
    detail::timeline t;
    t.serial = cores.serial();
    t.busy_pace = busy_pace;
    double compute = fwd + b3;
    const double t3 = t.running(a3, compute, compute + b2 + b1);  // a3 moves while b2 and b1 run
    double comm = compute + t3;
    compute += t.contention(a3, compute, compute + b2 + b1) + b2;
    const double start2 = std::max(comm, compute);  // a2 moves while b1 runs
    const double t2 = t.running(a2, start2, compute + b1);
    comm = start2 + t2;
    compute += b1 + t.contention(a2, start2, compute + b1);
    comm = std::max(comm, compute) + a1.t;
    return std::max(compute, comm);
  };
  // at least the idle-paced step, as hybrid_step's
  return {std::max(run(true), run(false)), fwd + b3 + b2 + b1, a1.t + a2.t + a3.t};
}

// A whole CNN step (the papers' settings): the convolutions data-parallel on every rank's rows
// (forward, then backward, their gradients all-reduced over the ring in `grads` once backward is
// done: no overlap, as Dettmers' speedup model has it), and between them the FC head, hybrid
// (scheme S, activations in `act`) or data-parallel (its gradients in `grads`). The hybrid head's
// classifier stays data-parallel as in lockstep's trainer, its gradients all-reduced in `grads`
// beside the FC products (the papers split it too: with 1,000 classes this over-counts a little).
struct cnn_step {
  fc_head head;
  std::size_t conv_params = 0;  // all-reduced every step
  double conv_s = 0;            // one rank's convolutions, forward + backward, on its rows
};

struct model_estimate {
  double step_s = 0;
  double head_s = 0;             // the head's step (sim::hybrid_step or data_parallel_step)
  double conv_allreduce_s = 0;   // exposed: after the convolutions' backward
  double images_per_s = 0;       // all ranks
};

template <parallel::scheme S>
model_estimate hybrid_model_step(const cluster& cl, const codec_model& act, const codec_model& grads, const cnn_step& m,
                                 double flops_per_s, const host_cores& cores = {}) {
  const int K = m.head.ranks;
  model_estimate e;
  e.head_s = hybrid_step<S>(cl, act, grads, m.head, flops_per_s, cores).step_s;
  e.conv_allreduce_s = detail::collective_s(
      cl, grads, K, m.conv_params, [&](int q) { return topology::all_reduce_schedule(topology::ring{}, q, K); }, true);
  e.step_s = m.conv_s + e.head_s + e.conv_allreduce_s;
  e.images_per_s = static_cast<double>(K) * static_cast<double>(m.head.rows) / e.step_s;
  return e;
}

inline model_estimate data_parallel_model_step(const cluster& cl, const codec_model& grads, const cnn_step& m,
                                               double flops_per_s, const host_cores& cores = {}) {
  const int K = m.head.ranks;
  model_estimate e;
  e.head_s = data_parallel_step(cl, grads, m.head, flops_per_s, cores).step_s;
  e.conv_allreduce_s = detail::collective_s(
      cl, grads, K, m.conv_params, [&](int q) { return topology::all_reduce_schedule(topology::ring{}, q, K); }, true);
  e.step_s = m.conv_s + e.head_s + e.conv_allreduce_s;
  e.images_per_s = static_cast<double>(K) * static_cast<double>(m.head.rows) / e.step_s;
  return e;
}

}  // namespace lockstep::sim
