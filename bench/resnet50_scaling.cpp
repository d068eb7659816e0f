// lockstep-sim-resnet50: one ResNet-50 training step projected from 1 to 1,024 replicas by the
// simulator (sim/simulator.hpp, the topologies' own schedules), with the gradient all-reduced in
// buckets as backward writes them (Ying et al. 2018's setting, docs/scaling.md).
//
//   lockstep-sim-resnet50 --compute-ms 2400 --batch 32 --gbit 10 --latency-us 25
//   lockstep-sim-resnet50 --preset tpu-v3            the paper's chip rate and an assumed link
//   ... --ranks 1,16,256,1024 --topology ring,torus2d --codec fp32,bf16,dyntree8 --bucket-mb 25 --json
//
// The model of one step on one replica:
//   compute     --compute-ms: forward + backward + update of one replica's batch, measured (the
//               sample's `lockstep-train-resnet50 --synthetic --steps N` prints it) or assumed;
//               forward takes 1/3 of it, backward 2/3 (backward computes dX and dW: twice the
//               forward's multiply-adds).
//   gradients   the 161 tensors of bench/resnet50_shapes.hpp; tensor t's gradient is written when
//               backward has done the multiply-adds of every layer after it and of its own; each
//               convolution's and the classifier's multiply-adds at 224x224 (torchvision's v1.5
//               shapes), batch norm counted as free. Buckets as DDP cuts them: tensors in
//               backward order, a new bucket once --bucket-mb of fp32 is reached, no tensor split.
//   all-reduce  bucket k starts when its last tensor is written and the previous bucket's
//               all-reduce is done (one collective at a time, as the sample's group runs them);
//               its time is the simulator's for that many values, topology, codec and link.
//   step        max(compute, the last bucket's end): what backward cannot hide is exposed.
// Printed per row: the step time, images/s of the whole job, scaling efficiency against N times
// one replica, and the exposed communication.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/sim/cost_model.hpp>
#include <lockstep/sim/simulator.hpp>
#include <lockstep/topology.hpp>

#include "resnet50_shapes.hpp"
#include "sim_fit.hpp"
#include "cli.hpp"

namespace {

using namespace lockstep;

struct options {
  std::vector<int> ranks{1, 4, 16, 64, 256, 1024};
  std::vector<std::string> topologies{"ring", "torus2d"};
  std::vector<std::string> codecs{"fp32", "bf16", "dyntree8"};
  double compute_s = 2.4;
  int batch = 32;
  double bucket_bytes = 25.0 * 1024 * 1024;
  sim::cluster cl;
  bool json = false, measure_gamma = false;
  std::string preset;
};

void usage() {
  std::puts(
      "usage: lockstep-sim-resnet50 [options]\n"
      "  --compute-ms T       forward+backward+update of one replica's batch (default 2400)\n"
      "  --batch B            images per replica per step (default 32)\n"
      "  --ranks LIST         replicas (default 1,4,16,64,256,1024)\n"
      "  --topology LIST      ring,torus2d (default both)\n"
      "  --codec LIST         fp32,bf16,int8,dyntree8 (default fp32,bf16,dyntree8)\n"
      "  --bucket-mb M        DDP-style bucket cap in MiB of fp32 (default 25)\n"
      "  --gbit G             link bandwidth per direction (default 10)\n"
      "  --latency-us A       per-message latency (default 25)\n"
      "  --send-ahead         every send of a step posted at once (alpha per step, the papers' model)\n"
      "  --measure-gamma      codec work at this CPU's measured speed (default: free, as on an accelerator)\n"
      "  --preset tpu-v3      --compute-ms 31.2 --batch 32 --gbit 400 --latency-us 5 --send-ahead:\n"
      "                       the paper's 1.05 M images/s on 1,024 chips read as 1,025 images/s per chip,\n"
      "                       and an assumed interconnect (see docs/scaling.md)\n"
      "  --json               one JSON object per row");
}

options parse(int argc, char** argv) {
  options o;
  o.cl.nic.bandwidth_Bps = 10e9 / 8;
  o.cl.segments_ahead = sim::cluster::as_executor;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw error(errc::invalid_argument, "lockstep-sim-resnet50", -1, -1, a + " needs a value");
      return argv[++i];
    };
    if (a == "--compute-ms") o.compute_s = std::stod(next()) / 1e3;
    else if (a == "--batch") o.batch = std::stoi(next());
    else if (a == "--ranks") {
      o.ranks.clear();
      for (auto& s : lockstep::bench::split_list(next())) o.ranks.push_back(std::stoi(s));
    } else if (a == "--topology") o.topologies = lockstep::bench::split_list(next());
    else if (a == "--codec") o.codecs = lockstep::bench::split_list(next());
    else if (a == "--bucket-mb") o.bucket_bytes = std::stod(next()) * 1024 * 1024;
    else if (a == "--gbit") o.cl.nic.bandwidth_Bps = std::stod(next()) * 1e9 / 8;
    else if (a == "--latency-us") o.cl.nic.latency_s = std::stod(next()) / 1e6;
    else if (a == "--send-ahead") o.cl.send_ahead = true;
    else if (a == "--measure-gamma") o.measure_gamma = true;
    else if (a == "--json") o.json = true;
    else if (a == "--preset") {
      o.preset = next();
      if (o.preset != "tpu-v3")
        throw error(errc::invalid_argument, "lockstep-sim-resnet50", -1, -1, "unknown preset '" + o.preset + "' (tpu-v3)");
      o.compute_s = 32.0 / (1.05e6 / 1024);
      o.batch = 32;
      o.cl.nic.bandwidth_Bps = 400e9 / 8;
      o.cl.nic.latency_s = 5e-6;
      o.cl.send_ahead = true;
    } else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      throw error(errc::invalid_argument, "lockstep-sim-resnet50", -1, -1, "unknown flag '" + a + "' (--help lists them)");
    }
  }
  if (o.compute_s <= 0 || o.batch <= 0 || o.bucket_bytes <= 0)
    throw error(errc::invalid_argument, "lockstep-sim-resnet50", -1, -1, "--compute-ms, --batch and --bucket-mb must be positive");
  return o;
}

// Multiply-adds of one image's forward pass through the layer that owns tensor `t` (0 for batch
// norm and biases), at 224x224: conv1 writes 112x112, the stages 56, 28, 14, 7; stride 2 on the
// 3x3 of a stage's first block (v1.5) and on its downsample.
double forward_macs(const bench::tensor_shape& t) {
  if (t.exempt) return 0;
  if (t.name == "fc.weight") return double(t.size());
  const double k = double(t.size());  // out * in * kh * kw
  if (t.name == "conv1.weight") return k * 112 * 112;
  const int stage = t.name[5] - '1';                      // "layerS.B.conv..."
  const bool first = t.name.compare(7, 2, "0.") == 0;      // block 0 of the stage
  const double out_side = 56.0 / (1 << stage);
  const double in_side = (stage > 0 && first) ? out_side * 2 : out_side;
  // a first block's conv1 reads (and writes) the stage's input size; its conv2 strides down
  const bool at_input = first && t.name.find(".conv1.") != std::string::npos;
  const double side = at_input ? in_side : out_side;
  return k * side * side;
}

struct bucket_plan {
  std::size_t elements = 0;
  double ready_fraction = 0;  // of backward's multiply-adds done when its last tensor is written
};

// DDP's cut: walk the tensors in backward order (last first), close a bucket at the cap.
std::vector<bucket_plan> buckets_of(const std::vector<bench::tensor_shape>& ts, double cap_bytes) {
  double total = 0;
  for (const auto& t : ts) total += forward_macs(t);
  std::vector<bucket_plan> out;
  bucket_plan cur;
  double done = 0;
  for (auto it = ts.rbegin(); it != ts.rend(); ++it) {
    done += forward_macs(*it);
    cur.elements += it->size();
    cur.ready_fraction = done / total;
    if (double(cur.elements) * sizeof(float) >= cap_bytes) {
      out.push_back(cur);
      cur = {};
    }
  }
  if (cur.elements) out.push_back(cur);
  return out;
}

double all_reduce_seconds(const std::string& topo, const sim::codec_model& c, int size, std::size_t n,
                          const sim::cluster& cl) {
  if (size == 1) return 0;
  n -= n % static_cast<std::size_t>(size);
  sim::simulator s(cl, c);
  if (topo == "ring") return s.all_reduce(topology::ring{}, size, n).time_s;
  if (topo == "torus2d") {
    auto [rows, cols] = topology::torus2d{}.shape(size);
    return s.all_reduce(topology::torus2d{rows, cols}, size, n).time_s;
  }
  throw error(errc::invalid_argument, "lockstep-sim-resnet50", -1, -1, "unknown topology '" + topo + "' (ring, torus2d)");
}

int run(const options& o) {
  const auto shapes = bench::resnet50_shapes();
  const auto buckets = buckets_of(shapes, o.bucket_bytes);
  std::size_t params = 0;
  for (const auto& t : shapes) params += t.size();
  const double forward = o.compute_s / 3, backward = o.compute_s - forward;
  if (!o.json)
    std::printf("# ResNet-50: %zu parameters in %zu tensors, %zu buckets of <= %.0f MiB; one replica: %.1f ms "
                "for %d images (%.1f images/s); link %.0f Gbit/s, alpha %.1f us%s%s\n",
                params, shapes.size(), buckets.size(), o.bucket_bytes / (1024 * 1024), o.compute_s * 1e3, o.batch,
                o.batch / o.compute_s, o.cl.nic.bandwidth_Bps * 8 / 1e9, o.cl.nic.latency_s * 1e6,
                o.cl.send_ahead ? ", sends ahead" : "", o.preset.empty() ? "" : (", preset " + o.preset).c_str());
  if (!o.json)
    std::printf("%-8s %-9s %6s %10s %10s %14s %8s\n", "topology", "codec", "ranks", "step_ms", "exposed_ms",
                "images/s", "scaling");
  std::map<std::string, sim::codec_model> models;
  for (const auto& cn : o.codecs) models.emplace(cn, bench::codec_by_name(cn, 0, o.measure_gamma));
  for (const auto& topo : o.topologies)
    for (const auto& cn : o.codecs)
      for (int size : o.ranks) {
        double end = 0;  // when the network is free: the previous bucket's all-reduce done
        for (const auto& b : buckets) {
          const double ready = forward + backward * b.ready_fraction;
          end = std::max(end, ready) + all_reduce_seconds(topo, models.at(cn), size, b.elements, o.cl);
        }
        const double step = std::max(o.compute_s, end);
        const double images = double(size) * o.batch / step;
        const double scaling = o.compute_s / step;
        if (o.json)
          std::printf("{\"kind\":\"resnet50_step\",\"topology\":\"%s\",\"codec\":\"%s\",\"ranks\":%d,\"batch\":%d,"
                      "\"compute_ms\":%.3f,\"step_ms\":%.3f,\"exposed_ms\":%.3f,\"images_per_s\":%.1f,\"scaling\":%.4f,"
                      "\"gbit\":%.2f,\"latency_us\":%.2f,\"buckets\":%zu,\"send_ahead\":%s}\n",
                      topo.c_str(), cn.c_str(), size, o.batch, o.compute_s * 1e3, step * 1e3,
                      (step - o.compute_s) * 1e3, images, scaling, o.cl.nic.bandwidth_Bps * 8 / 1e9,
                      o.cl.nic.latency_s * 1e6, buckets.size(), o.cl.send_ahead ? "true" : "false");
        else
          std::printf("%-8s %-9s %6d %10.1f %10.1f %14.0f %7.1f%%\n", topo.c_str(), cn.c_str(), size, step * 1e3,
                      (step - o.compute_s) * 1e3, images, 100 * scaling);
      }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-sim-resnet50: %s\n", e.what());
    return 2;
  }
}
