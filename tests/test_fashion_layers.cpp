// Gradients of every layer of the sample CNN (samples/fashion_cnn/layers_cpu.hpp) against central
// finite differences (fashion_gradcheck.hpp), and of the whole model's parameters.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "../samples/fashion_cnn/model.hpp"
#include "fashion_gradcheck.hpp"

using namespace fashion;
using namespace fashion_test;

TEST_CASE("conv3x3 gradients match finite differences", "[fashion][layers]") {
  const int B = 2, C = 3, H = 5, W = 6, K = 4;
  auto x = randn(static_cast<std::size_t>(B) * C * H * W, 1);
  auto w = randn(static_cast<std::size_t>(K) * C * 9, 2, 0.3f);
  auto r = randn(static_cast<std::size_t>(B) * K * H * W, 3);
  std::vector<float> out(r.size()), dx(x.size()), dw(w.size());
  auto loss = [&] {
    conv_forward(out.data(), x.data(), w.data(), B, C, H, W, K);
    return dot(out, r);
  };
  loss();
  conv_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), B, C, H, W, K);
  check_gradient(x, dx, loss, 40, 1e-2f, 4);
  check_gradient(w, dw, loss, 40, 1e-2f, 5);
}

TEST_CASE("maxpool2x2 gradients match finite differences, odd sizes included", "[fashion][layers]") {
  using m = maxpool_case;
  std::vector<std::uint8_t> ws(maxpool_workspace_bytes(m::B, m::C, m::H, m::W));
  std::vector<float> out(static_cast<std::size_t>(m::B) * m::C * pooled(m::H) * pooled(m::W));
  std::vector<float> dx(static_cast<std::size_t>(m::B) * m::C * m::H * m::W);
  check_maxpool([&](const std::vector<float>& x) {
                  maxpool_forward(out.data(), ws.data(), x.data(), m::B, m::C, m::H, m::W);
                  return out;
                },
                [&](const std::vector<float>& r) {
                  maxpool_backward(dx.data(), r.data(), ws.data(), m::B, m::C, m::H, m::W);
                  return dx;
                });
}

TEST_CASE("linear gradients match finite differences", "[fashion][layers]") {
  using m = linear_case;
  std::vector<float> out(static_cast<std::size_t>(m::B) * m::NC);
  check_linear(
      [&](const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b) {
        linear_forward(out.data(), x.data(), w.data(), b.data(), m::B, m::F, m::NC);
        return out;
      },
      [&](const std::vector<float>& r, const std::vector<float>& x, const std::vector<float>& w) {
        linear_grads g{std::vector<float>(x.size()), std::vector<float>(w.size()), std::vector<float>(m::NC)};
        linear_backward(g.dx.data(), g.dw.data(), g.db.data(), r.data(), x.data(), w.data(), m::B, m::F, m::NC);
        return g;
      });
}

TEST_CASE("batchnorm+relu gradients match finite differences (local group)", "[fashion][layers]") {
  const int B = 4, K = 3, HW = 10;
  auto x = randn(static_cast<std::size_t>(B) * K * HW, 16, 2.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += static_cast<float>(i % K);  // channels differ in mean
  auto gamma = randn(K, 17, 0.5f), beta = randn(K, 18, 0.5f);
  for (auto& g : gamma) g += 1.0f;
  auto r = randn(x.size(), 19);
  std::vector<float> out(x.size()), dx(x.size()), dg(K), db(K), mean(K), rstd(K), rm(K, 0.0f), rv(K, 1.0f);
  float count = 0;
  const bn_group local;
  auto loss = [&] {
    batchnorm_relu_forward(out.data(), mean.data(), rstd.data(), &count, rm.data(), rv.data(), x.data(),
                           gamma.data(), beta.data(), B, K, HW, local, true);
    return dot(out, r);
  };
  loss();
  batchnorm_relu_backward(dx.data(), dg.data(), db.data(), r.data(), x.data(), mean.data(), rstd.data(), count,
                          gamma.data(), beta.data(), B, K, HW, local);
  check_gradient(x, dx, loss, 60, 1e-2f, 20);
  check_gradient(gamma, dg, loss, K, 1e-2f, 21);
  check_gradient(beta, db, loss, K, 1e-2f, 22);
}

TEST_CASE("softmax cross-entropy with label smoothing: gradient and value", "[fashion][layers]") {
  const int B = 4, NC = 10;
  auto z = randn(static_cast<std::size_t>(B) * NC, 23, 2.0f);
  std::vector<int> y{0, 3, 9, 3};
  std::vector<float> p(z.size()), dz(z.size());
  for (float smoothing : {0.0f, 0.1f}) {
    auto loss = [&] { return static_cast<double>(softmax_xent_forward(p.data(), nullptr, z.data(), y.data(), B, NC, smoothing)); };
    loss();
    softmax_xent_backward(dz.data(), p.data(), y.data(), B, NC, smoothing);
    check_gradient(z, dz, loss, 30, 1e-2f, 24, 1e-2);
  }
  // Uniform logits: the loss is log(NC) whatever the smoothing.
  std::vector<float> zero(z.size(), 0.0f);
  CHECK(softmax_xent_forward(p.data(), nullptr, zero.data(), y.data(), B, NC, 0.1f) == Approx(std::log(10.0)).epsilon(1e-6));
}

TEST_CASE("the whole model's parameter gradients match finite differences", "[fashion][model]") {
  config cfg;
  cfg.channels = {4, 6, 8};
  cfg.label_smoothing = 0.1f;
  model m = model_create(cfg, 7);
  const int B = 3;
  auto images = randn(static_cast<std::size_t>(B) * 28 * 28, 25);
  std::vector<int> labels{1, 4, 7};
  const bn_group local;
  auto loss = [&] { return static_cast<double>(model_forward(m, images.data(), labels.data(), B, local, true)); };
  loss();
  std::vector<int> order;
  model_backward(m, local, [&](int b) { order.push_back(b); });
  CHECK(order == std::vector<int>{3, 2, 1, 0});
  const std::vector<float> grads = m.grads;
  // Per tensor, so that small tensors (the biases, the first convolution) are sampled too.
  for (const auto& t : m.L.tensors) {
    INFO("tensor " << t.name);
    std::vector<float> p(m.params.begin() + static_cast<std::ptrdiff_t>(t.offset),
                         m.params.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    std::vector<float> g(grads.begin() + static_cast<std::ptrdiff_t>(t.offset),
                         grads.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    auto f = [&] {
      std::copy(p.begin(), p.end(), m.params.begin() + static_cast<std::ptrdiff_t>(t.offset));
      return loss();
    };
    check_gradient(p, g, f, 8, 1e-3f, 26, 3e-2);
    std::copy(p.begin(), p.end(), m.params.begin() + static_cast<std::ptrdiff_t>(t.offset));
  }
}
