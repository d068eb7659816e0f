// lockstep-sim-hybrid: the two papers' hybrid settings projected by the simulator
// (sim/hybrid.hpp: every collective of a step simulated on its own schedule), next to their
// published speedups (docs/scaling.md, "Hybrid parallelism: the papers' settings").
//
//   lockstep-sim-hybrid --setting krizhevsky     1/2/4/8 GPUs; the paper: 6.25x on 8 (98.05 h -> 15.68 h)
//   lockstep-sim-hybrid --setting dettmers       96 GPUs; the paper: ~50x with 8 bits, 23x with 32
//   ... [--ranks 1,2,4,8] [--gbit G] [--latency-us A] [--tflops T] [--rows R] [--json]
//
// The model (both settings): AlexNet as the one-weird-trick paper has it (torchvision's alexnet:
// five convolutions with 2,469,696 parameters and 0.655 G multiply-adds per 224x224 image, then
// FC 9216 -> 4096 -> 4096 -> 1000). Per GPU and step: R images through the convolutions
// (forward + backward = 3 x 2 x 0.655 GFLOP each) at --tflops, data-parallel, their gradients
// all-reduced over the ring after backward; the FC head hybrid (sim::hybrid_step, scheme a, b or
// c, activations in the codec) or data-parallel, its products at --tflops too. Speedup = K x the
// one-GPU step / the K-GPU step (images per second against one GPU). Codec work is free (γ = 0,
// GPU speed); links are full duplex with η = 1.
//   krizhevsky: --tflops 1.40: the rate at which one GPU trains 90 epochs of ImageNet-1k (1.281 M
//               images) of batch 128 in the paper's 98.05 h, assuming 90 epochs; 8 GPUs of one
//               server over PCIe, assumed 6 GB/s per direction, α 10 µs.
//   dettmers:   40 Gbit/s, α 5 µs (as the data-parallel projection of docs/scaling.md), R = 128
//               assumed; --tflops is *calibrated* (bisection) so that 32-bit hybrid (a) gives the
//               paper's 23x at 96 GPUs; the 8-bit rows (dyntree8 activations and gradients) are
//               then the prediction.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/codec/dyntree8.hpp>
#include <lockstep/codec/fp32.hpp>
#include <lockstep/sim/hybrid.hpp>

#include "cli.hpp"

namespace {

using namespace lockstep;

struct options {
  std::string setting = "krizhevsky";
  std::vector<int> ranks;
  double gbit = 0, latency_us = -1, tflops = 0;
  std::size_t rows = 128;
  bool json = false;
};

constexpr std::size_t conv_params = 2469696;
constexpr double conv_gflop_per_image = 3 * 2 * 0.655;  // forward + backward

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) std::fprintf(stderr, "lockstep-sim-hybrid: %s needs a value\n", a.c_str()), std::exit(2);
      return argv[++i];
    };
    if (a == "--setting") o.setting = next();
    else if (a == "--ranks") {
      o.ranks.clear();
      for (const auto& r : lockstep::bench::split_list(next())) o.ranks.push_back(std::atoi(r.c_str()));
    }
    else if (a == "--gbit") o.gbit = std::atof(next().c_str());
    else if (a == "--latency-us") o.latency_us = std::atof(next().c_str());
    else if (a == "--tflops") o.tflops = std::atof(next().c_str());
    else if (a == "--rows") o.rows = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--json") o.json = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: lockstep-sim-hybrid --setting krizhevsky|dettmers [--ranks 1,2,4,8] [--gbit G]\n"
                  "       [--latency-us A] [--tflops T] [--rows R] [--json]\n");
      std::exit(0);
    } else {
      std::fprintf(stderr, "lockstep-sim-hybrid: unknown flag %s (--help)\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.setting != "krizhevsky" && o.setting != "dettmers")
    std::fprintf(stderr, "lockstep-sim-hybrid: --setting is krizhevsky or dettmers\n"), std::exit(2);
  const bool k = o.setting == "krizhevsky";
  if (o.ranks.empty()) o.ranks = k ? std::vector<int>{1, 2, 4, 8} : std::vector<int>{1, 8, 32, 96};
  if (o.gbit <= 0) o.gbit = k ? 48 : 40;
  if (o.latency_us < 0) o.latency_us = k ? 10 : 5;
  return o;
}

sim::model_estimate step(const options& o, const std::string& m, int K, double tflops) {
  sim::cluster cl;
  cl.nic = {o.latency_us * 1e-6, o.gbit * 1e9 / 8, 1.0};
  cl.segments_ahead = sim::cluster::as_executor;
  sim::cnn_step s;
  s.head = {K, o.rows, 9216, 4096, 4096, 1000};
  s.conv_params = conv_params;
  const double flops = tflops * 1e12;
  s.conv_s = static_cast<double>(o.rows) * conv_gflop_per_image * 1e9 / flops;
  const auto dash = m.find('-');
  const std::string kind = m.substr(0, dash), cname = m.substr(dash + 1);
  const sim::codec_model c = cname == "dyntree8" ? sim::model_of(codec::dyntree8{}) : sim::model_of(codec::fp32{});
  if (kind == "dp") return sim::data_parallel_model_step(cl, c, s, flops);
  if (kind == "a") return sim::hybrid_model_step<parallel::gather_all>(cl, c, c, s, flops);
  if (kind == "b") return sim::hybrid_model_step<parallel::by_rank>(cl, c, c, s, flops);
  return sim::hybrid_model_step<parallel::by_slice>(cl, c, c, s, flops);
}

double speedup(const options& o, const std::string& m, int K, double tflops) {
  const double one = step(o, m, 1, tflops).step_s;
  return K * one / step(o, m, K, tflops).step_s;
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse(argc, argv);
  const bool kriz = o.setting == "krizhevsky";
  const int K_max = *std::max_element(o.ranks.begin(), o.ranks.end());
  bool calibrated = false;
  if (o.tflops <= 0 && kriz) o.tflops = 1.40;
  if (o.tflops <= 0) {
    // The rate at which 32-bit hybrid (a) gives the paper's 23x at the largest K: the speedup
    // grows with compute time per step, so bisect on log(rate).
    double lo = std::log(0.01), hi = std::log(1000.0);
    for (int i = 0; i < 40; ++i) {
      const double mid = 0.5 * (lo + hi);
      (speedup(o, "a-fp32", K_max, std::exp(mid)) > 23.0 ? lo : hi) = mid;
    }
    o.tflops = std::exp(0.5 * (lo + hi));
    calibrated = true;
  }
  const std::vector<std::string> modes = {"dp-fp32", "dp-dyntree8", "a-fp32", "a-dyntree8", "b-fp32", "b-dyntree8",
                                          "c-fp32", "c-dyntree8"};
  if (!o.json) {
    std::printf("%s: AlexNet (conv %zu params, FC 9216-4096-4096-1000), %zu images per GPU, %.2f TFLOP/s%s,\n"
                "%.1f Gbit/s per direction, alpha %.1f us; speedup = K x one GPU's step / K GPUs' step\n",
                o.setting.c_str(), conv_params, o.rows, o.tflops, calibrated ? " (calibrated: a-fp32 = 23x)" : "", o.gbit,
                o.latency_us);
    std::printf("%-12s", "mode");
    for (int K : o.ranks) {
      char k[16];
      std::snprintf(k, sizeof k, "K=%d", K);
      std::printf(" %12s", k);
    }
    std::printf("  step ms at K=%d (head, conv all-reduce)\n", K_max);
  }
  for (const auto& m : modes) {
    if (!o.json) std::printf("%-12s", m.c_str());
    for (int K : o.ranks) {
      const double s = speedup(o, m, K, o.tflops);
      if (o.json)
        std::printf("{\"bench\":\"sim_hybrid\",\"setting\":\"%s\",\"mode\":\"%s\",\"ranks\":%d,\"speedup\":%.4f,\"tflops\":%.4f,"
                    "\"gbit\":%.3f,\"alpha_us\":%.3f,\"rows\":%zu}\n",
                    o.setting.c_str(), m.c_str(), K, s, o.tflops, o.gbit, o.latency_us, o.rows);
      else std::printf(" %11.2fx", s);
    }
    if (!o.json) {
      const sim::model_estimate e = step(o, m, K_max, o.tflops);
      std::printf("  %.1f (%.1f, %.1f)\n", e.step_s * 1e3, e.head_s * 1e3, e.conv_allreduce_s * 1e3);
    }
  }
  if (!o.json)
    std::printf("paper: %s\n", kriz ? "6.25x on 8 GPUs (98.05 h -> 15.68 h), Krizhevsky 2014"
                                    : "about 50x on 96 GPUs with 8-bit, 23x with 32-bit, Dettmers 2016");
  return 0;
}
