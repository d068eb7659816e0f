// The layers ResNet-50 adds to the samples (samples/resnet50/layers_cpu.hpp, model.hpp): residual
// add + ReLU, global average pooling, 3x3/2 max pooling, NHWC batch norm (with and without ReLU)
// and a whole bottleneck (identity and projection shortcut, stride 1 and 2), each against central
// finite differences of L = sum(out * r) (tests/fashion_gradcheck.hpp: fp32 layers, L summed in
// double, coordinates within h of a kink skipped). Shapes are small and odd-sized, so the file
// takes seconds.
#include <catch2/catch.hpp>

#include "../samples/resnet50/model.hpp"
#include "fashion_gradcheck.hpp"
#include "resnet_block.hpp"

using namespace resnet;
using fashion_test::check_gradient;
using fashion_test::dot;
using fashion_test::randn;
using resnet_test::one_block;

TEST_CASE("residual add + ReLU: value and gradients of both summands", "[resnet][layers]") {
  const std::size_t n = 257;  // prime: no vector-width multiple
  auto a = randn(n, 1), b = randn(n, 2), r = randn(n, 3);
  std::vector<float> out(n), d(n);
  auto loss = [&] {
    residual_add_relu_forward(out.data(), a.data(), b.data(), n);
    return dot(out, r);
  };
  loss();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(out[i] == std::max(0.0f, a[i] + b[i]));
  residual_add_relu_backward(d.data(), r.data(), out.data(), n);
  check_gradient(a, d, loss, 60, 1e-3f, 4);
  check_gradient(b, d, loss, 60, 1e-3f, 5);
}

TEST_CASE("global average pooling: value and gradient", "[resnet][layers]") {
  const int B = 3, HW = 7 * 7, C = 19;
  auto x = randn(static_cast<std::size_t>(B) * HW * C, 6), r = randn(static_cast<std::size_t>(B) * C, 7);
  std::vector<float> out(static_cast<std::size_t>(B) * C), dx(x.size());
  auto loss = [&] {
    global_avgpool_forward(out.data(), x.data(), B, HW, C);
    return dot(out, r);
  };
  loss();
  double s = 0;
  for (int i = 0; i < HW; ++i) s += x[static_cast<std::size_t>(i) * C + 5];
  CHECK(out[5] == Approx(s / HW).epsilon(1e-5));
  global_avgpool_backward(dx.data(), r.data(), B, HW, C);
  check_gradient(x, dx, loss, 60, 1e-2f, 8, 1e-2);
}

TEST_CASE("max pooling 3x3 stride 2 padding 1: gradients, odd and even sides", "[resnet][layers]") {
  for (int H : {7, 8}) {
    INFO("side " << H);
    const int B = 2, W = H, C = 5, O = pool3_out(H);
    auto x = randn(static_cast<std::size_t>(B) * H * W * C, 9 + H), r = randn(static_cast<std::size_t>(B) * O * O * C, 10);
    std::vector<float> out(r.size()), dx(x.size());
    std::vector<std::uint8_t> which(r.size());
    auto loss = [&] {
      maxpool3x3_forward(out.data(), which.data(), x.data(), B, H, W, C);
      return dot(out, r);
    };
    loss();
    maxpool3x3_backward(dx.data(), r.data(), which.data(), B, H, W, C);
    check_gradient(x, dx, loss, 80, 1e-3f, 11);
  }
}

TEST_CASE("NHWC batch norm with and without ReLU: gradients (local group)", "[resnet][layers]") {
  for (bool relu : {true, false}) {
    INFO("relu " << relu);
    const std::size_t N = 2 * 5 * 5;
    const int K = 21;  // two channel blocks, the second partial
    auto x = randn(N * K, 12, 2.0f), r = randn(N * K, 13), gamma = randn(K, 14), beta = randn(K, 15);
    for (auto& g : gamma) g += 1.5f;
    std::vector<float> out(N * K), dx(N * K), mean(K), rstd(K), rm(K, 0.0f), rv(K, 1.0f), dg(K), db(K);
    float count = 0;
    const bn_group local;
    auto loss = [&] {
      batchnorm_forward(out.data(), mean.data(), rstd.data(), &count, rm.data(), rv.data(), x.data(), gamma.data(),
                        beta.data(), N, K, relu, local, true);
      return dot(out, r);
    };
    loss();
    CHECK(count == static_cast<float>(N));
    batchnorm_backward(dx.data(), dg.data(), db.data(), r.data(), x.data(), mean.data(), rstd.data(), count,
                       gamma.data(), beta.data(), N, K, relu, local);
    check_gradient(x, dx, loss, 60, 1e-2f, 16);
    check_gradient(gamma, dg, loss, K, 1e-2f, 17);
    check_gradient(beta, db, loss, K, 1e-2f, 18);
  }
}


TEST_CASE("a bottleneck's input and parameter gradients match finite differences", "[resnet][layers]") {
  struct variant {
    int Cin, M, S, H;
    bool down;
  };
  for (const variant v : {variant{16, 4, 1, 5, false}, variant{8, 4, 2, 7, true}, variant{8, 3, 1, 6, true}}) {
    INFO("Cin " << v.Cin << " width " << v.M << " stride " << v.S << " side " << v.H << " projection " << v.down);
    one_block t(2, v.Cin, v.M, v.S, v.H, v.down);
    const bn_group local;
    const auto r = randn(t.a.out.size(), 32);
    auto loss = [&] {
      bottleneck_forward(t.a, t.x.data(), t.bi, t.m, local, true);
      return dot(t.a.out, r);
    };
    loss();
    std::vector<float> dx(t.x.size());
    bottleneck_backward(dx.data(), r.data(), t.a, t.x.data(), t.bi, t.m, local);
    check_gradient(t.x, dx, loss, 40, 1e-3f, 33, 3e-2);
    const std::vector<float> g = t.m.grads;
    std::vector<float> p = t.m.params;
    auto f = [&] {
      t.m.params = p;
      return loss();
    };
    check_gradient(p, g, f, 60, 1e-3f, 34, 3e-2);
  }
}

TEST_CASE("ResNet-50's layout: 25,557,032 parameters, 161 tensors, 53 batch norms, 18 buckets", "[resnet][model]") {
  config cfg;
  const layout L = make_layout(cfg);
  CHECK(L.total == 25557032);
  CHECK(L.tensors.size() == 161);
  CHECK(L.nbn == 53);
  REQUIRE(L.buckets.size() == nblocks + 2);
  CHECK(L.buckets.front().first == 0);
  CHECK(L.buckets.back().second == L.total);
  for (std::size_t b = 1; b < L.buckets.size(); ++b) CHECK(L.buckets[b].first == L.buckets[b - 1].second);
  CHECK(L.tensors[0].name == "conv1.weight");
  CHECK(L.tensors[160].name == "fc.bias");
  // v1.5: the stride is on the 3x3 of the first bottleneck of stages 2-4, not on its first 1x1.
  CHECK(L.blocks[3].c1.S == 1);
  CHECK(L.blocks[3].c2.S == 2);
  CHECK(L.blocks[3].down.S == 2);
  CHECK(L.final_side == 7);
  int plain = 0;
  for (const auto& t : L.tensors) plain += t.plain;
  CHECK(plain == 53 * 2 + 1);
  cfg.zero_init_residual = true;
  std::vector<float> p, run;
  initial_parameters(cfg, make_layout(cfg), 1, p, run);
  CHECK(p[L.blocks[0].c3.gamma] == 0.0f);
  CHECK(p[L.blocks[0].c2.gamma] == 1.0f);
  CHECK(p[L.blocks[0].down.gamma] == 1.0f);
}

TEST_CASE("the whole network's backward reports its buckets classifier first, stem last", "[resnet][model]") {
  config cfg;
  cfg.size = 32;
  cfg.classes = 10;
  auto m = model_create<float>(cfg, 3);
  const int B = 2;
  const auto images = randn(static_cast<std::size_t>(B) * 3 * 32 * 32, 40);
  const std::vector<int> labels{3, 7};
  const bn_group local;
  int top1 = -1, top5 = -1;
  const float loss = model_forward(m, images.data(), labels.data(), B, local, true, &top1, &top5);
  CHECK(std::isfinite(loss));
  CHECK(top1 >= 0);
  CHECK(top5 >= top1);
  std::vector<int> order;
  model_backward(m, local, [&](int b) { order.push_back(b); });
  std::vector<int> want;
  for (int b = nblocks + 1; b >= 0; --b) want.push_back(b);
  CHECK(order == want);
  for (const auto& t : m.L.tensors) {
    double s = 0;
    for (std::size_t i = 0; i < t.size; ++i) s += std::fabs(m.grads[t.offset + i]);
    INFO(t.name);
    CHECK(std::isfinite(s));
    if (t.name.find("bn3.weight") == std::string::npos) CHECK(s > 0);
  }
}
