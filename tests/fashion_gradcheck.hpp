// Finite-difference gradient checks of the sample CNN's layers, shared by the oneDNN backend's
// tests (test_fashion_layers.cpp) and the cuDNN backend's (cuda/test_fashion_layers_cuda.cu).
//
// Each check takes a scalar L = sum(out * r) with a fixed random r, so dL/dout = r, and compares
// the analytic gradient with (L(x + h e_i) - L(x - h e_i)) / 2h at random coordinates, summing L in
// double. Kinks (ReLU, max) make a few coordinates unreliable at any h; inputs are drawn so that
// ties and zero crossings are unlikely, and a coordinate within h of a kink is skipped.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace fashion_test {

inline std::vector<float> randn(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Compares grad[i] with the central difference of f around x[i] at `samples` coordinates.
inline void check_gradient(std::vector<float>& x, const std::vector<float>& grad, const std::function<double()>& f,
                    int samples, float h, std::uint32_t seed, double tol = 2e-2) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<std::size_t> pick(0, x.size() - 1);
  int checked = 0;
  double scale = 0;
  for (float v : grad) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (int s = 0; s < samples; ++s) {
    const std::size_t i = pick(g);
    const float x0 = x[i];
    x[i] = x0 + h;
    const double lp = f();
    x[i] = x0 - h;
    const double lm = f();
    x[i] = x0;
    const double l0 = f();
    // A kink inside [x-h, x+h] shows as curvature far above the smooth part's.
    if (std::fabs(lp - 2 * l0 + lm) > 1e-3 * std::max(1.0, std::fabs(l0))) continue;
    const double fd = (lp - lm) / (2.0 * h);
    INFO("coordinate " << i << ": analytic " << grad[i] << " finite difference " << fd);
    CHECK(std::fabs(fd - grad[i]) <= tol * std::max(scale, 1e-3) + tol * std::fabs(fd));
    ++checked;
  }
  REQUIRE(checked >= samples / 2);
}

// The maxpool case both backends check: 2 x 3 planes of 7 x 6, so the last row pools alone.
// forward(x) returns the pooled values and backward(r) the input gradient, both as host vectors
// (the backend keeps its argmax workspace between the two).
struct maxpool_case {
  static constexpr int B = 2, C = 3, H = 7, W = 6;
};
template <class Forward, class Backward>
void check_maxpool(Forward&& forward, Backward&& backward) {
  using m = maxpool_case;
  auto x = randn(static_cast<std::size_t>(m::B) * m::C * m::H * m::W, 6);
  auto r = randn(static_cast<std::size_t>(m::B) * m::C * ((m::H + 1) / 2) * ((m::W + 1) / 2), 7);
  auto loss = [&] { return dot(forward(x), r); };
  loss();
  const std::vector<float> dx = backward(r);
  check_gradient(x, dx, loss, 60, 1e-3f, 8);
  double last_row = 0;  // the lone last row's maxima must reach the output
  for (int p = 0; p < m::B * m::C; ++p)
    for (int j = 0; j < m::W; ++j) last_row += std::fabs(dx[(static_cast<std::size_t>(p) * m::H + m::H - 1) * m::W + j]);
  CHECK(last_row > 0);
}

// The linear case both backends check: 3 rows of 20 features onto 5 classes. forward(x, w, b)
// returns out (B, NC); backward(r, x, w) returns {dx, dw, db}; all host vectors.
struct linear_case {
  static constexpr int B = 3, F = 20, NC = 5;
};
struct linear_grads {
  std::vector<float> dx, dw, db;
};
template <class Forward, class Backward>
void check_linear(Forward&& forward, Backward&& backward) {
  using m = linear_case;
  auto x = randn(static_cast<std::size_t>(m::B) * m::F, 9);
  auto w = randn(static_cast<std::size_t>(m::NC) * m::F, 10, 0.3f);
  auto b = randn(static_cast<std::size_t>(m::NC), 11);
  auto r = randn(static_cast<std::size_t>(m::B) * m::NC, 12);
  auto loss = [&] { return dot(forward(x, w, b), r); };
  loss();
  const linear_grads g = backward(r, x, w);
  check_gradient(x, g.dx, loss, 30, 1e-2f, 13);
  check_gradient(w, g.dw, loss, 30, 1e-2f, 14);
  check_gradient(b, g.db, loss, 5, 1e-2f, 15);
}

}  // namespace fashion_test
