// The layers ResNet-50 adds to the samples (samples/resnet50/layers_cpu.hpp, model.hpp): a
// bottleneck's fused last batch norm + residual add + ReLU (identity and projection shortcut),
// per-channel moments, global average pooling, 3x3/2 max pooling, NHWC batch norm (with and
// without ReLU) and a whole bottleneck (identity and projection shortcut, stride 1 and 2), each
// against central finite differences of L = sum(out * r) (tests/fashion_gradcheck.hpp: fp32
// layers, L summed in double, coordinates within h of a kink skipped); and both pooling kernels bit
// for bit against layers_math.hpp's per-cell helpers, which the GPU backend runs. Shapes are small
// and odd-sized, so the file takes seconds.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>

#include "../samples/resnet50/model.hpp"
#include "fashion_gradcheck.hpp"
#include "resnet_block.hpp"

using namespace resnet;
using fashion_test::check_gradient;
using fashion_test::dot;
using fashion_test::randn;
using resnet_test::one_block;

TEST_CASE("bn_add_relu: a bottleneck's last batch norm + residual add + ReLU, identity and projection", "[resnet][layers]") {
  for (bool projection : {false, true}) {
    INFO("projection " << projection);
    const std::size_t N = 2 * 4 * 4 + 1;  // odd: a partial statistics chunk
    const int K = 19;                     // prime: no vector-width multiple
    auto x = randn(N * K, 1, 2.0f), xd = randn(N * K, 2, 1.5f), sc = randn(N * K, 3), r = randn(N * K, 4);
    auto gamma = randn(K, 5), beta = randn(K, 6), gd = randn(K, 7), bd = randn(K, 8);
    for (auto& g : gamma) g += 1.0f;
    std::vector<float> out(N * K), mean(K), rstd(K), md(K), rd(K), rm(K, 0.0f), rv(K, 1.0f);
    float count = 0, countd = 0;
    const bn_group local;
    auto loss = [&] {
      batchnorm_stats(mean.data(), rstd.data(), &count, rm.data(), rv.data(), x.data(), N, K, local, true);
      if (projection) {
        batchnorm_stats(md.data(), rd.data(), &countd, rm.data(), rv.data(), xd.data(), N, K, local, true);
        bn_add_bn_relu_forward(out.data(), x.data(), gamma.data(), beta.data(), mean.data(), rstd.data(), xd.data(),
                               gd.data(), bd.data(), md.data(), rd.data(), N, K);
      } else {
        bn_add_relu_forward(out.data(), x.data(), gamma.data(), beta.data(), mean.data(), rstd.data(), sc.data(), N, K);
      }
      return dot(out, r);
    };
    loss();
    // The value against the unfused layers: batch norm, then the sum, then the ReLU.
    std::vector<float> y(N * K), yd(N * K), m2(K), r2(K);
    float c2 = 0;
    batchnorm_forward(y.data(), m2.data(), r2.data(), &c2, rm.data(), rv.data(), x.data(), gamma.data(), beta.data(), N,
                      K, false, local, true);
    if (projection)
      batchnorm_forward(yd.data(), m2.data(), r2.data(), &c2, rm.data(), rv.data(), xd.data(), gd.data(), bd.data(), N,
                        K, false, local, true);
    for (std::size_t i = 0; i < N * K; ++i)
      REQUIRE(out[i] == Approx(std::max(0.0f, y[i] + (projection ? yd[i] : sc[i]))).margin(1e-5));
    // Backward: the fused first pass, then each batch norm's own finish; the identity takes g.
    std::vector<float> g(N * K), dx(N * K), dxd(N * K), dg(K), db(K), dgd(K), dbd(K);
    std::vector<double> sdy(K), sdyx(K);
    bn_add_relu_backward_sums(g.data(), sdy.data(), sdyx.data(), r.data(), nullptr, out.data(), x.data(), mean.data(),
                              rstd.data(), N, K);
    {  // out's gradient in two halves (exact in fp32), the second overwritten in place: the same pass
      std::vector<float> half(N * K), g2(N * K);
      for (std::size_t i = 0; i < N * K; ++i) half[i] = 0.5f * r[i], g2[i] = half[i];
      std::vector<double> sdy2(K), sdyx2(K);
      bn_add_relu_backward_sums(g2.data(), sdy2.data(), sdyx2.data(), half.data(), g2.data(), out.data(), x.data(),
                                mean.data(), rstd.data(), N, K);
      REQUIRE(g2 == g);
      REQUIRE(sdy2 == sdy);
      REQUIRE(sdyx2 == sdyx);
    }
    batchnorm_backward_dx(dx.data(), dg.data(), db.data(), sdy.data(), sdyx.data(), g.data(), x.data(), mean.data(),
                          rstd.data(), count, gamma.data(), beta.data(), N, K, false, local);
    check_gradient(x, dx, loss, 60, 1e-3f, 9, 3e-2);
    check_gradient(gamma, dg, loss, K, 1e-3f, 10, 3e-2);
    check_gradient(beta, db, loss, K, 1e-3f, 11, 3e-2);
    if (projection) {
      batchnorm_backward(dxd.data(), dgd.data(), dbd.data(), g.data(), xd.data(), md.data(), rd.data(), countd,
                         gd.data(), bd.data(), N, K, false, local);
      check_gradient(xd, dxd, loss, 60, 1e-3f, 12, 3e-2);
      check_gradient(gd, dgd, loss, K, 1e-3f, 13, 3e-2);
      check_gradient(bd, dbd, loss, K, 1e-3f, 14, 3e-2);
    } else {
      check_gradient(sc, g, loss, 60, 1e-3f, 15, 3e-2);
    }
  }
}

TEST_CASE("channel_moments: mean and M2 of every channel, any row count", "[resnet][layers]") {
  const int K = 7;
  for (std::size_t N : {std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{65}, std::size_t{1000}}) {
    INFO("rows " << N);
    auto x = randn(N * K, 20, 3.0f);
    for (auto& v : x) v += 100.0f;  // an offset, so a sum-of-squares shortcut would lose digits
    std::vector<float> mean(K), M2(K);
    channel_moments(mean.data(), M2.data(), x.data(), N, K);
    for (int k = 0; k < K; ++k) {
      double s = 0, q = 0;
      for (std::size_t i = 0; i < N; ++i) s += x[i * K + k];
      const double mu = s / static_cast<double>(N);
      for (std::size_t i = 0; i < N; ++i) q += (x[i * K + k] - mu) * (x[i * K + k] - mu);
      CHECK(mean[k] == Approx(mu).epsilon(1e-6));
      CHECK(M2[k] == Approx(q).epsilon(1e-4).margin(1e-3));
    }
  }
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

// The CPU kernels run channels in vector lanes, the GPU's one channel per thread through the
// per-cell helpers of layers_math.hpp (maxpool3_gather, avgpool_cell); the two must agree bit for bit.
TEST_CASE("pooling: the CPU kernels equal the per-cell helpers the GPU runs, bit for bit", "[resnet][layers]") {
  const int B = 2, C = 67;  // a partial vector, and for average pooling a partial 64-channel task
  auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (int H : {7, 8}) {
    INFO("side " << H);
    const int W = H + 1, OH = pool3_out(H), OW = pool3_out(W);
    auto x = randn(static_cast<std::size_t>(B) * H * W * C, 30 + H);
    for (auto& v : x) v = std::round(2.0f * v);  // windows with ties
    auto r = randn(static_cast<std::size_t>(B) * OH * OW * C, 40 + H);
    for (std::size_t i = 0; i < r.size(); i += 7) r[i] = -0.0f;
    std::vector<float> out(r.size()), dx(x.size());
    std::vector<std::uint8_t> which(r.size());
    maxpool3x3_forward(out.data(), which.data(), x.data(), B, H, W, C);
    maxpool3x3_backward(dx.data(), r.data(), which.data(), B, H, W, C);
    const std::size_t oimg = static_cast<std::size_t>(OH) * OW * C;
    std::size_t differ = 0;
    for (int b = 0; b < B; ++b)
      for (int iy = 0; iy < H; ++iy)
        for (int ix = 0; ix < W; ++ix)
          for (int c = 0; c < C; ++c) {
            const float g = maxpool3_gather(r.data() + b * oimg, which.data() + b * oimg, OH, OW, C, iy, ix, c);
            differ += !same(g, dx[((static_cast<std::size_t>(b) * H + iy) * W + ix) * C + c]);
          }
    CHECK(differ == 0);
  }
  const int HW = 7 * 7;
  auto x = randn(static_cast<std::size_t>(B) * HW * C, 50);
  std::vector<bf16_t> xh(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xh[i] = store_as<bf16_t>(x[i]);
  std::vector<float> out(static_cast<std::size_t>(B) * C);
  std::vector<bf16_t> outh(out.size());
  global_avgpool_forward(out.data(), x.data(), B, HW, C);
  global_avgpool_forward(outh.data(), xh.data(), B, HW, C);
  std::size_t differ = 0;
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < C; ++c) {
      const std::size_t img = static_cast<std::size_t>(b) * HW * C, o = static_cast<std::size_t>(b) * C + c;
      differ += !same(avgpool_cell(x.data() + img, HW, C, c), out[o]);
      differ += store_as<bf16_t>(avgpool_cell(xh.data() + img, HW, C, c)) != outh[o];
    }
  CHECK(differ == 0);
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
