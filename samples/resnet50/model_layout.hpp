// samples/resnet50/model_layout.hpp: the configuration, parameter layout and initial parameters of
// ResNet-50 v1.5, shared by the backends so that a seed gives the same model on either.
//
// ResNet-50 v1.5 (torchvision's resnet50): a 7x7/2 stem convolution, 3x3/2 max pooling, then four
// stages of 3, 4, 6, 3 bottlenecks of widths 64, 128, 256, 512 (outputs 4x the width); the first
// bottleneck of stages 2-4 downsamples with stride 2 on its 3x3 convolution (v1.5; v1 strides the
// first 1x1) and on its 1x1 projection shortcut. Global average pooling and a 2048 -> classes
// classifier end it. With 1000 classes: 25,557,032 parameters in 161 tensors, 53 batch norms.
//
// The parameters are one flat block in torchvision's state_dict order (conv weights OIHW, the
// classifier (classes, 2048)), so gradients are one buffer; buckets are element ranges: the stem,
// each bottleneck, the classifier, in layout order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../common/pipeline.hpp"

namespace resnet {

struct config {
  int classes = 1000;
  int size = 224;                   // input images are size x size, 3 channels
  bool zero_init_residual = false;  // last batch-norm scale of each bottleneck starts at 0 (Goyal et al. 2017)
  float label_smoothing = 0.0f;
  float bn_momentum = 0.1f;
  float bn_eps = 1e-5f;
};

constexpr int nstages = 4;
constexpr int stage_blocks[nstages] = {3, 4, 6, 3};
constexpr int stage_width[nstages] = {64, 128, 256, 512};
constexpr int nblocks = 16;
constexpr int expansion = 4;
constexpr int stem_channels = 64;
constexpr int features = 2048;

// One named tensor of the flat block. `plain` marks batch-norm scales/shifts and biases:
// optimizers exempt them from weight decay and from LARS' trust ratio.
struct tensor_info {
  std::string name;
  std::size_t offset, size;
  bool plain;
};

// A convolution followed by its batch norm: where its three tensors and its running statistics are.
struct conv_bn {
  int C, K, R, S;         // in, out channels, kernel side, stride
  int H, W;               // input side
  std::size_t w, gamma, beta;  // offsets into the flat parameter block
  std::size_t run;        // offset of running mean (K) then running var (K) in the running block
  int OH() const { return (H + 2 * (R / 2) - R) / S + 1; }
  int OW() const { return (W + 2 * (R / 2) - R) / S + 1; }
};

// A bottleneck: conv1 1x1 (Cin -> M), conv2 3x3 stride s (M -> M), conv3 1x1 (M -> 4M), and on the
// first of a stage the projection down 1x1 stride s (Cin -> 4M).
struct block_info {
  conv_bn c1, c2, c3, down;
  bool has_down;
};

struct layout {
  std::vector<tensor_info> tensors;
  std::vector<std::pair<std::size_t, std::size_t>> buckets;  // [first, last): stem, blocks 0..15, classifier
  std::size_t total = 0, running = 0;                        // parameters, running-statistics floats
  conv_bn stem;
  int pool_side;  // side after the max pooling
  block_info blocks[nblocks];
  int final_side;  // side of the last block's output
  std::size_t fc_w, fc_b;
  int nbn = 0;
};

inline layout make_layout(const config& cfg) {
  layout L;
  auto add = [&](const std::string& name, std::size_t n, bool plain) {
    L.tensors.push_back({name, L.total, n, plain});
    L.total += n;
    return L.tensors.back().offset;
  };
  auto conv = [&](const std::string& cname, const std::string& bname, int C, int K, int R, int S, int H) {
    conv_bn c{C, K, R, S, H, H, 0, 0, 0, 0};
    c.w = add(cname + ".weight", static_cast<std::size_t>(K) * C * R * R, false);
    c.gamma = add(bname + ".weight", static_cast<std::size_t>(K), true);
    c.beta = add(bname + ".bias", static_cast<std::size_t>(K), true);
    c.run = L.running;
    L.running += 2 * static_cast<std::size_t>(K);
    ++L.nbn;
    return c;
  };
  L.stem = conv("conv1", "bn1", 3, stem_channels, 7, 2, cfg.size);
  L.buckets.push_back({0, L.total});
  L.pool_side = (L.stem.OH() + 2 - 3) / 2 + 1;
  int C = stem_channels, H = L.pool_side, b = 0;
  for (int s = 0; s < nstages; ++s)
    for (int j = 0; j < stage_blocks[s]; ++j, ++b) {
      const std::string p = "layer" + std::to_string(s + 1) + "." + std::to_string(j);
      const int M = stage_width[s], K = M * expansion, S = (s > 0 && j == 0) ? 2 : 1;
      const std::size_t first = L.total;
      block_info& B = L.blocks[b];
      B.c1 = conv(p + ".conv1", p + ".bn1", C, M, 1, 1, H);
      B.c2 = conv(p + ".conv2", p + ".bn2", M, M, 3, S, H);
      B.c3 = conv(p + ".conv3", p + ".bn3", M, K, 1, 1, B.c2.OH());
      B.has_down = j == 0;
      if (B.has_down) B.down = conv(p + ".downsample.0", p + ".downsample.1", C, K, 1, S, H);
      L.buckets.push_back({first, L.total});
      C = K, H = B.c2.OH();
    }
  L.final_side = H;
  const std::size_t first = L.total;
  L.fc_w = add("fc.weight", static_cast<std::size_t>(cfg.classes) * features, false);
  L.fc_b = add("fc.bias", static_cast<std::size_t>(cfg.classes), true);
  L.buckets.push_back({first, L.total});
  return L;
}

// Activation sizes, shared by the backends' model_resize: a convolution's output for batch B, and
// the largest activation gradient (the size of each gradient scratch buffer).
inline std::size_t out_elems(const conv_bn& c, int B) {
  return static_cast<std::size_t>(B) * c.OH() * c.OW() * c.K;
}
inline std::size_t gradient_elems(const layout& L, int B) {
  std::size_t biggest = out_elems(L.stem, B);
  for (const block_info& bi : L.blocks)
    biggest = std::max({biggest, out_elems(bi.c1, B), out_elems(bi.c3, B),
                        static_cast<std::size_t>(B) * bi.c1.H * bi.c1.W * bi.c1.C});
  return biggest;
}

// Fresh parameters as torchvision initialises resnet50: convolutions He-normal with fan-out
// (kaiming_normal_, mode fan_out, relu), batch-norm scales 1 and shifts 0 (the last scale of each
// bottleneck 0 with zero_init_residual), the classifier uniform in +-1/sqrt(2048) (torch's Linear
// default); running means 0 and variances 1. Each tensor draws from its own generator keyed by
// (seed, tensor index), so the same seed gives the same model on every replica and backend.
inline void initial_parameters(const config& cfg, const layout& L, std::uint64_t seed, std::vector<float>& params,
                               std::vector<float>& running) {
  params.assign(L.total, 0.0f);
  running.assign(L.running, 0.0f);
  auto normal = [](sample::rng& r) {  // Box-Muller on the sample's portable generator
    const float u1 = 1.0f - r.uniform(), u2 = r.uniform();
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
  };
  auto init_conv = [&](const conv_bn& c, std::uint64_t id, bool zero_gamma) {
    sample::rng r{sample::key_of(seed, 0x5245534E4554ull, id)};
    const float sd = std::sqrt(2.0f / static_cast<float>(c.K * c.R * c.R));
    float* w = params.data() + c.w;
    for (std::size_t i = 0, n = static_cast<std::size_t>(c.K) * c.C * c.R * c.R; i < n; ++i) w[i] = sd * normal(r);
    for (int k = 0; k < c.K; ++k) {
      params[c.gamma + k] = zero_gamma ? 0.0f : 1.0f;
      running[c.run + c.K + k] = 1.0f;
    }
  };
  std::uint64_t id = 0;
  init_conv(L.stem, id++, false);
  for (const auto& b : L.blocks) {
    init_conv(b.c1, id++, false);
    init_conv(b.c2, id++, false);
    init_conv(b.c3, id++, cfg.zero_init_residual);
    if (b.has_down) init_conv(b.down, id++, false);
  }
  sample::rng r{sample::key_of(seed, 0x5245534E4554ull, id)};
  const float bound = 1.0f / std::sqrt(static_cast<float>(features));
  for (std::size_t i = 0; i < static_cast<std::size_t>(cfg.classes) * features; ++i)
    params[L.fc_w + i] = bound * (2.0f * r.uniform() - 1.0f);
  for (int c = 0; c < cfg.classes; ++c) params[L.fc_b + c] = bound * (2.0f * r.uniform() - 1.0f);
}

}  // namespace resnet
