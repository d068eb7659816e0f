// lockstep/collective/calibrate.hpp: topology::automatic with its link measured on a group.
//
//   topology::automatic a = lockstep::calibrate_automatic(g);   // collective: every rank calls it
//
// Measures gamma of fp32, bf16, int8 and dyntree8 on this machine (sim::measure_rates), times
// fp32 all-reduces over the ring (one-way steps) at 4 KiB, 64 KiB and 1 MiB and, on a power of
// two, over recursive doubling (pairwise exchanges) at the same sizes, each the median of a few
// runs, averages all of it over the group (an all_reduce: the same bits on every rank), and fits
// alpha and beta to the closed forms (sim::fit_alpha_beta; eta held at 1), then the overhead o per
// message (link_params::overhead_s) from the ring at 4 MiB in quarter segments against whole ones. Every rank then holds the same
// parameters and so makes the same choices. About a quarter of a second on an idle machine; on a
// loaded one the fit describes the load too, which is what the choices then face.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>
#include <vector>

#include "../codec/bf16.hpp"
#include "../codec/dyntree8.hpp"
#include "../codec/fp32.hpp"
#include "../codec/int8.hpp"
#include "../sim/fit.hpp"
#include "../topology/automatic.hpp"
#include "collectives.hpp"

namespace lockstep {

template <transport::transport T>
topology::automatic calibrate_automatic(group<T>& g, topology::automatic base = {}) {
  static_assert(!group<T>::ordered, "calibrate_automatic times host groups; give a stream group's link to topology::automatic");
  const int size = g.size();
  const bool pow2 = (size & (size - 1)) == 0;
  // (what, bytes): 0 ring, 1 recursive doubling
  // Sizes where the candidates' times cross (the choices that matter): where latency and
  // bandwidth weigh alike, not far beyond, where every bandwidth-optimal candidate costs the same.
  std::vector<std::pair<int, std::size_t>> cases = {{0, 4u << 10}, {0, 64u << 10}, {0, 1u << 20}};
  if (pow2 && size > 1) cases.insert(cases.end(), {{1, 4u << 10}, {1, 64u << 10}, {1, 1u << 20}});
  // The overhead o per message: the ring at 4 MiB in the group's segments and in quarter ones
  // (2: not part of the alpha-beta fit).
  constexpr std::size_t o_bytes = 4u << 20;
  const std::size_t o_segment = std::max<std::size_t>(4096, g.segment_bytes() / 4);
  const std::size_t o_first = cases.size();
  cases.insert(cases.end(), {{2, o_bytes}, {3, o_bytes}});
  constexpr int codecs = 4;
  // (codec, routine) then (case): this rank's measurements, averaged over the group below
  std::vector<float> m(codecs * 3 + cases.size(), 0.0f);
  auto put_rates = [&](int i, const sim::codec_rates& r) {
    m[3 * i] = static_cast<float>(r.encode_s * 1e9), m[3 * i + 1] = static_cast<float>(r.decode_s * 1e9);
    m[3 * i + 2] = static_cast<float>(r.decode_add_s * 1e9);
  };
  // Out of cache (16 MiB of fp32), as large buffers meet it: where codec work decides a choice,
  // the buffer is large; a small one is decided by alpha.
  const std::size_t gamma_n = std::size_t{1} << 22;
  put_rates(0, sim::measure_rates(codec::fp32{}, gamma_n));
  put_rates(1, sim::measure_rates(codec::bf16{}, gamma_n));
  put_rates(2, sim::measure_rates(codec::int8{}, gamma_n));
  put_rates(3, sim::measure_rates(codec::dyntree8{}, gamma_n));
  codec::fp32 c;
  auto elems = [&](std::size_t bytes) {
    return std::max<std::size_t>(static_cast<std::size_t>(size), bytes / sizeof(float) / size * size);
  };
  if (size > 1)
    for (std::size_t i = 0; i < cases.size(); ++i) {
      std::vector<float> x(elems(cases[i].second), 1.0f);
      const int reps = cases[i].second <= (64u << 10) ? 31 : cases[i].second <= (1u << 20) ? 9 : 5;
      std::vector<double> ts;
      for (int r = 0; r <= reps; ++r) {  // r = 0 warms up
        std::fill(x.begin(), x.end(), 1.0f);
        const auto t0 = std::chrono::steady_clock::now();
        no_epilogue ep;
        if (cases[i].first == 0 || cases[i].first == 2) all_reduce(g, std::span<float>(x), topology::ring{}, c);
        else if (cases[i].first == 1) all_reduce(g, std::span<float>(x), topology::recursive_doubling{}, c);
        else detail::run_call(detail::op_kind::all_reduce, g, std::span<float>(x), topology::ring{}, c, reduce_op::sum, -1, ep, detail::chunk_layout{}, o_segment);
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) ts.push_back(t);
      }
      // The median, not the best: a call meets the machine as it is, load included.
      std::nth_element(ts.begin(), ts.begin() + static_cast<std::ptrdiff_t>(ts.size() / 2), ts.end());
      m[codecs * 3 + i] = static_cast<float>(ts[ts.size() / 2] * 1e6);
    }
  all_reduce(g, std::span<float>(m), topology::ring{}, c, reduce_op::average);

  topology::automatic a = std::move(base);
  const char* names[codecs] = {"fp32", "bf16", "int8", "dyntree8"};
  for (int i = 0; i < codecs; ++i)
    a.rates[names[i]] = {m[3 * i] * 1e-9, m[3 * i + 1] * 1e-9, m[3 * i + 2] * 1e-9};
  if (size < 2) return a;
  const sim::codec_model model = sim::model_of(c, a.rates["fp32"]);
  std::vector<sim::sample> samples;
  for (std::size_t i = 0; i < o_first; ++i) {
    const std::size_t n = elems(cases[i].second);
    const sim::cost_terms t = cases[i].first == 0 ? sim::ring_terms(size, n, model, g.segment_bytes(), true, true)
                                                  : sim::recursive_doubling_terms(size, n, model, g.segment_bytes(), true, true);
    sim::sample x = sim::sample_of(t, model.rates, m[codecs * 3 + i] * 1e-6);
    // eta is held at 1: the exchanges measured here are too few to tell it from beta (a fit with
    // it free came out at 0.4 on a loaded 2-core machine, and then never chose an exchange where
    // exchanges measured fastest).
    x.beta_count += x.exchange_count, x.exchange_count = 0;
    samples.push_back(x);
  }
  // On a loaded machine the times may not fit any positive beta (fit_alpha_beta refuses them):
  // then the given link stays, which every rank keeps alike.
  sim::fit_result f;
  f.link = a.link;
  try {
    f = sim::fit_alpha_beta(samples);
  } catch (const error&) {
    return a;
  }
  // A fit the simulator cannot use (no bandwidth: times that fell with size on a noisy machine)
  // keeps the given link's value.
  if (f.link.latency_s >= 0) a.link.latency_s = f.link.latency_s;
  if (f.link.bandwidth_Bps > 0 && std::isfinite(f.link.bandwidth_Bps)) a.link.bandwidth_Bps = f.link.bandwidth_Bps;
  if (f.link.exchange_efficiency > 0 && f.link.exchange_efficiency <= 1) a.link.exchange_efficiency = f.link.exchange_efficiency;
  // o from what quartering the segments cost, through the simulator (the model automatic asks):
  // the predicted difference is linear in o; the o that predicts the measured one, then alpha
  // less the 2o per step its fit took in (one segment per step, posted and read).
  const double measured = (m[codecs * 3 + o_first + 1] - m[codecs * 3 + o_first]) * 1e-6;
  auto predicted = [&](double o) {
    sim::cluster cl;
    cl.nic = a.link;
    cl.nic.overhead_s = o;
    cl.segments_ahead = sim::cluster::as_executor;
    auto run = [&](std::size_t seg) {
      cl.segment_bytes = seg;
      return sim::simulator(cl, model).all_reduce(topology::ring{}, size, elems(o_bytes)).time_s;
    };
    return run(o_segment) - run(g.segment_bytes());
  };
  const double d0 = predicted(0), slope = (predicted(1e-6) - d0) / 1e-6;
  // No more than a whole step of the 4 KiB ring took (a flat slope on a noisy fit would make o
  // anything at all).
  const double o_max = m[codecs * 3] * 1e-6 / (2.0 * (size - 1));
  if (slope > 0 && measured > d0) {
    a.link.overhead_s = std::min((measured - d0) / slope, o_max);
    a.link.latency_s = std::max(0.0, a.link.latency_s - 2 * a.link.overhead_s);
  }
  return a;
}

}  // namespace lockstep
