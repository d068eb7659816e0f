// samples/fashion_cnn/model_layout.hpp: the configuration, parameter layout and initial
// parameters of the Fashion-MNIST CNN, shared by both backends (model.hpp on oneDNN,
// model_cuda.cuh on cuDNN), so that a seed gives the same model on either.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../common/pipeline.hpp"
#include "layers_math.hpp"

namespace fashion {

constexpr int nblocks = 3;

struct config {
  std::array<int, nblocks> channels{32, 64, 128};
  int side = 28;      // input images are side x side, one channel
  int classes = 10;
  float label_smoothing = 0.0f;
  float bn_momentum = 0.1f;
  std::array<int, 2> fc{0, 0};  // hidden FC widths (--fc H1,H2), 0,0: the linear classifier alone
  bool has_head() const { return fc[0] > 0; }
};

// One named tensor of the flat parameter block. `plain` marks batch-norm scales/shifts and biases:
// optimizers exempt them from weight decay and from LARS' trust ratio.
struct tensor_info {
  std::string name;
  std::size_t offset, size;
  bool plain;
};

// The parameter layout: block i holds conv_w[i] (Ci, Ci-1, 3, 3), bn_gamma[i] (Ci), bn_beta[i]
// (Ci); the classifier holds fc_w (NC, F), fc_b (NC). Buckets are [first, last) element ranges,
// one per block plus one for the classifier, in layout order.
// With the AlexNet-like head (--fc H1,H2: F -> H1 -> H2 -> NC, ReLU after each hidden layer) the
// classifier reads H2 features and the layout goes on, after the blocks:
//   fc2_b (H2), fc_w (NC, H2), fc_b (NC)        | the head bucket (data-parallel in every mode)
//   fc1_w (F, H1), fc1_b (H1)                   | the fc1 bucket   (model-parallel in hybrid runs:
//   fc2_w (H1, H2)                              | the fc2 bucket    rank k owns a slice of each)
// fc1_w and fc2_w are stored in x out (X · W), so rank k's rows of fc2_w are contiguous; the
// tensors hybrid runs split come last, after everything every rank updates alike (dp_end).
struct layout {
  std::vector<tensor_info> tensors;
  std::vector<std::pair<std::size_t, std::size_t>> buckets;
  std::size_t total = 0;
  int side_in[nblocks + 1];  // side of block i's input; side_in[nblocks] is the classifier's
  int features;              // F
  int classifier_in;         // F, or H2 with the head
  std::size_t dp_end = 0;    // elements [0, dp_end) are never split (the whole block without a head)
};

inline layout make_layout(const config& cfg) {
  layout L;
  auto add = [&](std::string name, std::size_t n, bool plain) {
    L.tensors.push_back({std::move(name), L.total, n, plain});
    L.total += n;
  };
  int C = 1, S = cfg.side;
  for (int i = 0; i < nblocks; ++i) {
    const int K = cfg.channels[i];
    const std::size_t first = L.total;
    L.side_in[i] = S;
    add("conv" + std::to_string(i) + ".w", static_cast<std::size_t>(K) * C * 9, false);
    add("bn" + std::to_string(i) + ".gamma", static_cast<std::size_t>(K), true);
    add("bn" + std::to_string(i) + ".beta", static_cast<std::size_t>(K), true);
    L.buckets.push_back({first, L.total});
    C = K;
    S = pooled(S);
  }
  L.side_in[nblocks] = S;
  L.features = C * S * S;
  L.classifier_in = cfg.has_head() ? cfg.fc[1] : L.features;
  const std::size_t first = L.total;
  if (cfg.has_head()) add("fc2.b", static_cast<std::size_t>(cfg.fc[1]), true);
  add("fc.w", static_cast<std::size_t>(cfg.classes) * L.classifier_in, false);
  add("fc.b", static_cast<std::size_t>(cfg.classes), true);
  L.buckets.push_back({first, L.total});
  L.dp_end = L.total;
  if (cfg.has_head()) {
    const auto F = static_cast<std::size_t>(L.features), H1 = static_cast<std::size_t>(cfg.fc[0]),
               H2 = static_cast<std::size_t>(cfg.fc[1]);
    std::size_t at = L.total;
    add("fc1.w", F * H1, false);
    add("fc1.b", H1, true);
    L.buckets.push_back({at, L.total});
    at = L.total;
    add("fc2.w", H1 * H2, false);
    L.buckets.push_back({at, L.total});
  }
  return L;
}

// What a batch of B images needs in block i: both backends' model_resize allocate these.
struct block_buffers {
  std::size_t out;       // conv and batch-norm outputs (B, K, S, S)
  std::size_t pooled;    // (B, K, S/2, S/2), rounded up
  std::size_t pool_ws;   // the maxpool's argmax bytes
  std::size_t channels;  // K: batch-norm mean and rstd
};
inline block_buffers block_sizes(const config& cfg, const layout& L, int B, int i) {
  const int K = cfg.channels[i], S = L.side_in[i], P = pooled(S);
  const auto b = static_cast<std::size_t>(B);
  return {b * K * S * S, b * K * P * P, maxpool_workspace_bytes(B, K, S, S), static_cast<std::size_t>(K)};
}
// The largest activation (or its gradient) the backward pass holds: dact_a and dact_b's size.
inline std::size_t biggest_activation(const config& cfg, const layout& L, int B) {
  std::size_t biggest = 0;
  for (int i = 0; i < nblocks; ++i) {
    const std::size_t in = static_cast<std::size_t>(B) * (i ? cfg.channels[i - 1] : 1) * L.side_in[i] * L.side_in[i];
    biggest = std::max({biggest, block_sizes(cfg, L, B, i).out, in});
  }
  return biggest;
}

// The head's tensors, by name (tensor_info indices after the blocks).
inline const tensor_info& tensor_named(const layout& L, const std::string& name) {
  for (const auto& t : L.tensors)
    if (t.name == name) return t;
  throw std::invalid_argument("no tensor " + name + " in this model");
}

// Points the --fc head's pointers (fc1_w ... d_fc2_b, either backend's model) into p and g.
template <class M>
void bind_head(M& m, float* p, float* g) {
  auto at = [&](const char* name, float* base) { return base + tensor_named(m.L, name).offset; };
  m.fc1_w = at("fc1.w", p), m.d_fc1_w = at("fc1.w", g);
  m.fc1_b = at("fc1.b", p), m.d_fc1_b = at("fc1.b", g);
  m.fc2_w = at("fc2.w", p), m.d_fc2_w = at("fc2.w", g);
  m.fc2_b = at("fc2.b", p), m.d_fc2_b = at("fc2.b", g);
}

// Points a model's per-tensor pointers (either backend's model) into its flat parameter block p,
// gradient block g and running statistics r.
template <class M>
void bind_tensors(M& m, float* p, float* g, float* r) {
  std::size_t t = 0;
  for (int i = 0; i < nblocks; ++i) {
    m.conv_w[i] = p + m.L.tensors[t].offset, m.d_conv_w[i] = g + m.L.tensors[t].offset, ++t;
    m.bn_gamma[i] = p + m.L.tensors[t].offset, m.d_bn_gamma[i] = g + m.L.tensors[t].offset, ++t;
    m.bn_beta[i] = p + m.L.tensors[t].offset, m.d_bn_beta[i] = g + m.L.tensors[t].offset, ++t;
  }
  if (m.cfg.has_head()) ++t;  // fc2.b: bound by bind_head
  m.fc_w = p + m.L.tensors[t].offset, m.d_fc_w = g + m.L.tensors[t].offset, ++t;
  m.fc_b = p + m.L.tensors[t].offset, m.d_fc_b = g + m.L.tensors[t].offset;
  for (int i = 0; i < nblocks; ++i) {
    m.run_mean[i] = r;
    m.run_var[i] = r + m.cfg.channels[i];
    r += 2 * m.cfg.channels[i];
  }
  if (m.cfg.has_head()) bind_head(m, p, g);
}

// Fresh parameters: He-normal convolutions (fan-in), gamma 1, beta 0, classifier uniform in
// +-1/sqrt(F) (torch's default); running means 0 and variances 1. The same seed gives the same
// model on every replica, so no initial broadcast is needed.
inline void initial_parameters(const config& cfg, const layout& L, std::uint64_t seed, std::vector<float>& params,
                               std::vector<float>& running) {
  params.assign(L.total, 0.0f);
  std::size_t nrun = 0;
  for (int c : cfg.channels) nrun += 2 * static_cast<std::size_t>(c);
  running.assign(nrun, 0.0f);
  sample::rng r{sample::key_of(seed, 0x4D4F44454Cull)};
  auto normal = [&] {  // Box-Muller on the sample's portable generator
    const float u1 = 1.0f - r.uniform(), u2 = r.uniform();
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
  };
  int C = 1;
  std::size_t t = 0, run = 0;
  for (int i = 0; i < nblocks; ++i) {
    const int K = cfg.channels[i];
    const float sd = std::sqrt(2.0f / (C * 9));
    float* w = params.data() + L.tensors[t].offset;
    for (int j = 0; j < K * C * 9; ++j) w[j] = sd * normal();
    float* gamma = params.data() + L.tensors[t + 1].offset;
    for (int k = 0; k < K; ++k) gamma[k] = 1.0f, running[run + K + k] = 1.0f;
    t += 3, run += 2 * static_cast<std::size_t>(K);
    C = K;
  }
  if (cfg.has_head()) ++t;  // fc2.b: drawn with fc2.w below
  const float bound = 1.0f / std::sqrt(static_cast<float>(L.classifier_in));
  float* fc_w = params.data() + L.tensors[t].offset;
  float* fc_b = params.data() + L.tensors[t + 1].offset;
  for (int j = 0; j < cfg.classes * L.classifier_in; ++j) fc_w[j] = bound * (2.0f * r.uniform() - 1.0f);
  for (int c = 0; c < cfg.classes; ++c) fc_b[c] = bound * (2.0f * r.uniform() - 1.0f);
  if (cfg.has_head()) {  // uniform in +-1/sqrt(fan-in), torch's default, as the classifier
    auto fill = [&](const std::string& name, int fan_in) {
      const tensor_info& ti = tensor_named(L, name);
      const float b = 1.0f / std::sqrt(static_cast<float>(fan_in));
      for (std::size_t j = 0; j < ti.size; ++j) params[ti.offset + j] = b * (2.0f * r.uniform() - 1.0f);
    };
    fill("fc1.w", L.features);
    fill("fc1.b", L.features);
    fill("fc2.w", cfg.fc[0]);
    fill("fc2.b", cfg.fc[0]);
  }
}

}  // namespace fashion
