// One ResNet-50 bottleneck with its own small parameter block, for the layer tests
// (test_resnet_layers.cpp: finite differences; test_resnet_torch.cpp: against torchvision's
// Bottleneck). Its tensors are laid out as the full model and torchvision lay them out: conv1,
// bn1, conv2, bn2, conv3, bn3, then downsample.0 and downsample.1 when it has a projection.
#pragma once

#include "../samples/resnet50/model.hpp"
#include "fashion_gradcheck.hpp"

namespace resnet_test {

using namespace resnet;
using fashion_test::randn;

// One bottleneck inside a model object (the layer functions take their weights, gradients and
// scratch from it): the block's tensors laid out as the full model lays them out.
struct one_block {
  model<float> m;
  block_info bi{};
  block_acts<float> a;
  std::vector<float> x;  // (B, H, H, Cin)

  one_block(int B, int Cin, int M, int S, int H, bool down) {
    m.B = B;
    std::size_t off = 0, run = 0;
    auto conv = [&](int C, int K, int R, int s, int h) {
      const std::size_t w = static_cast<std::size_t>(K) * C * R * R;
      conv_bn c{C, K, R, s, h, h, off, off + w, off + w + K, run};
      off += w + 2 * static_cast<std::size_t>(K);
      run += 2 * static_cast<std::size_t>(K);
      return c;
    };
    bi.c1 = conv(Cin, M, 1, 1, H);
    bi.c2 = conv(M, M, 3, S, H);
    bi.c3 = conv(M, 4 * M, 1, 1, bi.c2.OH());
    bi.has_down = down;
    if (down) bi.down = conv(Cin, 4 * M, 1, S, H);
    m.params = randn(off, 30, 0.3f);
    for (const conv_bn* c : {&bi.c1, &bi.c2, &bi.c3, &bi.down}) {
      if (c == &bi.down && !down) continue;
      for (int k = 0; k < c->K; ++k) m.params[c->gamma + k] += 1.0f;
    }
    m.grads.assign(off, 0.0f);
    m.running.assign(run, 1.0f);
    acts_resize(a.c1, bi.c1, B, true);
    acts_resize(a.c2, bi.c2, B, true);
    acts_resize(a.c3, bi.c3, B, false);
    if (down) acts_resize(a.down, bi.down, B, false);
    a.out.assign(out_elems(bi.c3, B), 0.0f);
    const std::size_t big = std::max({out_elems(bi.c1, B), out_elems(bi.c3, B), static_cast<std::size_t>(B) * H * H * Cin});
    for (auto* g : {&m.g_a, &m.g_b, &m.g_sum, &m.g_act, &m.g_tmp}) g->assign(big, 0.0f);
    m.g_conv.assign(big, 0.0f);
    x = randn(static_cast<std::size_t>(B) * H * H * Cin, 31);
  }
};

}  // namespace resnet_test
