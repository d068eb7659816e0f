// Tests for lockstep/optim/lars.hpp: the multi-tensor sweep against an fp64 reference written
// straight from the formulas (papers.md), for every knob; zero-norm and exempt tensors; a three-step
// example worked by hand.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/update.hpp>

namespace optim = lockstep::optim;
using denominator = optim::lars::denominator;
using lr_placement = optim::lars::lr_placement;

namespace {

// ---- the reference: one tensor at a time, fp64, no cleverness ---------------------------------
struct ref_tensor {
  std::vector<double> w, v;
  bool exempt;
};

void reference_step(const optim::lars& o, std::vector<ref_tensor>& ts, const std::vector<std::vector<float>>& grads,
                    double lr, double grad_scale) {
  const double m = o.momentum, beta = o.weight_decay, eta = o.trust, eps = o.epsilon;
  for (std::size_t t = 0; t < ts.size(); ++t) {
    auto& T = ts[t];
    std::vector<double> g(grads[t].begin(), grads[t].end());
    for (double& x : g) x *= grad_scale;
    double ww = 0, gg = 0, dd = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      ww += T.w[i] * T.w[i];
      gg += g[i] * g[i];
      dd += (g[i] + beta * T.w[i]) * (g[i] + beta * T.w[i]);
    }
    const double wn = std::sqrt(ww), gn = std::sqrt(gg), dn = std::sqrt(dd);
    double lambda = 1, b = 0;
    if (!T.exempt) {
      b = beta;
      if (o.denom == denominator::norm_sum) lambda = (wn == 0 || gn == 0) ? 1 : eta * wn / (gn + beta * wn + eps);
      else lambda = (wn == 0 || dn == 0) ? 1 : eta * wn / (dn + eps);
    }
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double d = g[i] + b * T.w[i];
      if (o.lr_at == lr_placement::inside) {
        const double s = lr * lambda * d;
        double u = s;
        if (m != 0) {
          T.v[i] = m * T.v[i] + s;
          u = o.nesterov ? m * T.v[i] + s : T.v[i];
        }
        T.w[i] -= u;
      } else {
        const double s = lambda * d;
        double u = s;
        if (m != 0) {
          T.v[i] = m * T.v[i] + s;
          u = o.nesterov ? m * T.v[i] + s : T.v[i];
        }
        T.w[i] -= lr * u;
      }
    }
  }
}

// A model with every kind of tensor LARS must handle.
struct model {
  std::vector<std::size_t> sizes{300, 7, 50, 40, 2500, 1, 129};
  std::vector<bool> exempt{false, true, false, false, false, true, false};
  static constexpr std::size_t zero_weights = 2, zero_grads = 3;
};

struct run_result {
  double w_err = 0, v_err = 0;  // worst error, relative to the tensor's largest reference value
};

run_result compare(const optim::lars& opt, const std::vector<float>& lrs, float grad_scale, optim::sweep_policy pol,
                   unsigned threads, const optim::lars* reference_opt = nullptr) {
  const model md;
  const auto ps = optim::param_set::packed(md.sizes, md.exempt, 16, pol);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(ps.size(), 0.0f), g(ps.size(), 0.0f);
  std::vector<ref_tensor> ref;
  for (std::size_t t = 0; t < ps.tensor_count(); ++t) {
    ref.push_back({{}, std::vector<double>(ps[t].size, 0.0), ps[t].exempt});
    for (std::size_t i = 0; i < ps[t].size; ++i) {
      const float x = t == model::zero_weights ? 0.0f : nd(rng);
      w[ps[t].offset + i] = x;
      ref.back().w.push_back(x);
    }
  }
  optim::state st(ps, opt);
  lockstep::thread_pool pool(threads);
  for (float lr : lrs) {
    std::vector<std::vector<float>> grads(ps.tensor_count());
    for (std::size_t t = 0; t < ps.tensor_count(); ++t)
      for (std::size_t i = 0; i < ps[t].size; ++i) {
        const float x = t == model::zero_grads ? 0.0f : 0.1f * nd(rng);
        g[ps[t].offset + i] = x;
        grads[t].push_back(x);
      }
    optim::update(opt, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = lr, .grad_scale = grad_scale},
                  {}, pool);
    reference_step(reference_opt ? *reference_opt : opt, ref, grads, lr, grad_scale);
  }
  run_result r;
  for (std::size_t t = 0; t < ps.tensor_count(); ++t) {
    double wmax = 1e-30, vmax = 1e-30;
    for (std::size_t i = 0; i < ps[t].size; ++i) {
      wmax = std::max(wmax, std::fabs(ref[t].w[i]));
      vmax = std::max(vmax, std::fabs(ref[t].v[i]));
    }
    for (std::size_t i = 0; i < ps[t].size; ++i) {
      r.w_err = std::max(r.w_err, std::fabs(w[ps[t].offset + i] - ref[t].w[i]) / wmax);
      if (opt.uses_momentum())
        r.v_err = std::max(r.v_err, std::fabs(st.momentum()[ps[t].offset + i] - ref[t].v[i]) / vmax);
    }
  }
  return r;
}

// Small blocks, tasks and waves: tensors are cut into several blocks, pieces and waves.
constexpr optim::sweep_policy tiny{.block = 64, .task = 100, .wave = 300};

}  // namespace

TEST_CASE("LARS matches the fp64 reference for every knob", "[lars]") {
  const std::vector<float> lrs{5.0f, 2.0f, 8.0f};  // the learning rate changes between steps
  for (auto denom : {denominator::norm_sum, denominator::decayed_norm})
    for (auto at : {lr_placement::inside, lr_placement::outside})
      for (bool nesterov : {false, true})
        for (float momentum : {0.9f, 0.0f})
          for (float grad_scale : {1.0f, 0.25f}) {
            const optim::lars opt{.momentum = momentum, .weight_decay = 1e-3f, .trust = 0.01f, .epsilon = 0.0f,
                                  .nesterov = nesterov, .denom = denom, .lr_at = at};
            INFO("denominator " << int(denom) << ", lr " << (at == lr_placement::inside ? "inside" : "outside")
                                << ", nesterov " << nesterov << ", momentum " << momentum << ", grad_scale "
                                << grad_scale);
            const run_result r = compare(opt, lrs, grad_scale, tiny, 3);
            CHECK(r.w_err < 1e-6);
            CHECK(r.v_err < 1e-6);
          }
  // ε is part of the denominator.
  const optim::lars with_eps{.trust = 0.01f, .epsilon = 0.5f};
  const run_result r = compare(with_eps, lrs, 1.0f, tiny, 2);
  CHECK(r.w_err < 1e-6);
  CHECK(r.v_err < 1e-6);
}

TEST_CASE("each LARS knob changes the result", "[lars]") {
  // The comparison above can fail: against the reference of another knob setting it does.
  const std::vector<float> lrs{5.0f, 2.0f, 8.0f};
  const optim::lars base{.weight_decay = 1e-2f, .trust = 0.01f};
  optim::lars other = base;
  other.denom = denominator::decayed_norm;
  CHECK(compare(base, lrs, 1.0f, tiny, 1, &other).w_err > 1e-4);
  other = base;
  other.lr_at = lr_placement::outside;
  CHECK(compare(base, lrs, 1.0f, tiny, 1, &other).w_err > 1e-4);
  other = base;
  other.nesterov = true;
  CHECK(compare(base, lrs, 1.0f, tiny, 1, &other).w_err > 1e-4);
  // With a constant learning rate the two placements agree.
  other = base;
  other.lr_at = lr_placement::outside;
  CHECK(compare(base, {3.0f, 3.0f, 3.0f}, 1.0f, tiny, 1, &other).w_err < 1e-6);
}

TEST_CASE("LARS results do not depend on threads, tasks or waves", "[lars]") {
  // Norms are summed per block in a fixed order; only the block size decides the rounding.
  const model md;
  const optim::lars opt{.nesterov = true};
  auto run = [&](optim::sweep_policy pol, unsigned threads) {
    const auto ps = optim::param_set::packed(md.sizes, md.exempt, 16, pol);
    std::vector<float> w(ps.size()), g(ps.size());
    for (std::size_t i = 0; i < w.size(); ++i) {
      w[i] = std::sin(0.01f * float(i));
      g[i] = std::cos(0.37f * float(i));
    }
    optim::state st(ps, opt);
    lockstep::thread_pool pool(threads);
    for (int s = 0; s < 3; ++s)
      optim::update(opt, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = 2.0f}, {}, pool);
    return w;
  };
  const auto a = run({.block = 64, .task = 64, .wave = 64}, 1);
  CHECK(a == run({.block = 64, .task = 1000, .wave = 1 << 20}, 4));
  CHECK(a == run({.block = 64, .task = 7, .wave = 500}, 3));
}

TEST_CASE("LARS trust ratio is 1 when a norm is 0, the formula otherwise", "[lars]") {
  const optim::lars o{.weight_decay = 0.5f, .trust = 0.1f, .epsilon = 0.0f};
  CHECK(o.trust_ratio({.w2 = 0.0, .g2 = 4.0, .d2 = 4.0}) == 1.0);
  CHECK(o.trust_ratio({.w2 = 9.0, .g2 = 0.0, .d2 = 1.0}) == 1.0);
  // 0.1·3 / (2 + 0.5·3) = 0.3 / 3.5
  CHECK(o.trust_ratio({.w2 = 9.0, .g2 = 4.0, .d2 = 1.0}) == Approx(0.3 / 3.5));
  optim::lars optax = o;
  optax.denom = denominator::decayed_norm;
  CHECK(optax.trust_ratio({.w2 = 9.0, .g2 = 0.0, .d2 = 0.0}) == 1.0);
  CHECK(optax.trust_ratio({.w2 = 9.0, .g2 = 0.0, .d2 = 1.0}) == Approx(0.3));  // ‖g‖ = 0 alone is not enough
  // Exempt tensors: λ = 1 and no decay, whatever the norms.
  const auto k = o.coefficients({.lr = 2.0f}, {.w2 = 9.0, .g2 = 4.0, .d2 = 1.0}, true);
  CHECK(k.scale == 2.0f);
  CHECK(k.decay == 0.0f);
  CHECK(o.sums(true).any() == false);
}

TEST_CASE("LARS three steps worked by hand", "[lars]") {
  // One tensor w = (3, 4) and one exempt scalar b = 1; η = 0.2, β = 0.2, m = 0.5, lr = 1, 1, 0.5.
  // Gradients are chosen so that every norm comes out round.
  //
  // step 1: ‖w‖ = 5, g = (0.6, 0.8), ‖g‖ = 1, λ = 0.2·5 / (1 + 0.2·5) = 0.5
  //         d = g + 0.2w = (1.2, 1.6); v = 1·0.5·d = (0.6, 0.8); w = (2.4, 3.2)
  //         b: g = 0.5, v = 0.5, b = 0.5
  // step 2: ‖w‖ = 4, g = (0.72, 0.96), ‖g‖ = 1.2, λ = 0.2·4 / (1.2 + 0.8) = 0.4
  //         d = (0.72 + 0.48, 0.96 + 0.64) = (1.2, 1.6); v = 0.5·(0.6, 0.8) + 0.4·(1.2, 1.6) = (0.78, 1.04)
  //         w = (1.62, 2.16);  b: v = 0.25 + 0.5 = 0.75, b = −0.25
  // step 3: lr = 0.5, ‖w‖ = 2.7, g = (0.486, 0.648), ‖g‖ = 0.81, λ = 0.2·2.7 / (0.81 + 0.54) = 0.4
  //         d = (0.486 + 0.324, 0.648 + 0.432) = (0.81, 1.08)
  //   lr inside:  v = 0.5·(0.78, 1.04) + 0.5·0.4·d = (0.552, 0.736);  w = (1.068, 1.424)
  //               b: v = 0.375 + 0.5·0.5 = 0.625, b = −0.875
  //   lr outside: v = 0.5·(0.78, 1.04) + 0.4·d = (0.714, 0.952);      w = w − 0.5·v = (1.263, 1.684)
  //               b: v = 0.375 + 0.5 = 0.875, b = −0.25 − 0.5·0.875 = −0.6875
  const auto ps = optim::param_set::packed(std::vector<std::size_t>{2, 1}, {false, true}, 1);
  const float grads[3][3] = {{0.6f, 0.8f, 0.5f}, {0.72f, 0.96f, 0.5f}, {0.486f, 0.648f, 0.5f}};
  const float lrs[3] = {1.0f, 1.0f, 0.5f};
  for (auto at : {lr_placement::inside, lr_placement::outside}) {
    const optim::lars opt{.momentum = 0.5f, .weight_decay = 0.2f, .trust = 0.2f, .lr_at = at};
    optim::state st(ps, opt);
    std::vector<float> w{3.0f, 4.0f, 1.0f};
    const float after[2][3] = {{2.4f, 3.2f, 0.5f}, {1.62f, 2.16f, -0.25f}};
    for (int s = 0; s < 3; ++s) {
      optim::update(opt, ps, std::span<float>(w), std::span<const float>(grads[s], 3), st, {.lr = lrs[s]});
      if (s < 2)
        for (int i = 0; i < 3; ++i) CHECK(w[i] == Approx(after[s][i]).epsilon(1e-6));
    }
    if (at == lr_placement::inside) {
      CHECK(w[0] == Approx(1.068f).epsilon(1e-6));
      CHECK(w[1] == Approx(1.424f).epsilon(1e-6));
      CHECK(w[2] == Approx(-0.875f).epsilon(1e-6));
      CHECK(st.momentum()[0] == Approx(0.552f).epsilon(1e-6));
      CHECK(st.momentum()[2] == Approx(0.625f).epsilon(1e-6));
    } else {
      CHECK(w[0] == Approx(1.263f).epsilon(1e-6));
      CHECK(w[1] == Approx(1.684f).epsilon(1e-6));
      CHECK(w[2] == Approx(-0.6875f).epsilon(1e-6));
      CHECK(st.momentum()[0] == Approx(0.714f).epsilon(1e-6));
      CHECK(st.momentum()[2] == Approx(0.875f).epsilon(1e-6));
    }
  }
}

TEST_CASE("LARS norms hold for values whose fp32 squares under- or overflow", "[lars]") {
  // An fp32 square is 0 below about 1e-19 and Inf above about 1.8e19; the norms are taken from
  // fp64 squares, so λ does not depend on whether a tensor is long enough for the vector lanes.
  // One tensor of n equal weights w and gradients g, momentum 0, lr 1:
  //   λ = η·‖w‖ / (‖g‖ + β·‖w‖ + ε),  w' = w − λ·(g + β·w).
  for (std::size_t n : {std::size_t{1}, std::size_t{127}, std::size_t{128}, std::size_t{4096}, std::size_t{4099}}) {
    for (auto [wv, gv] : {std::pair{0.5f, 1e-23f}, {1e-23f, 0.01f}, {1e20f, 1.0f}, {0.5f, 1e20f}, {3e-30f, 2e-25f}}) {
      INFO(n << " elements, w " << wv << ", g " << gv);
      const optim::lars o{.momentum = 0.0f};
      auto ps = optim::param_set::packed(std::vector<std::size_t>{n});
      std::vector<float> w(ps.size(), wv), g(ps.size(), gv);
      optim::state st(ps, o);
      optim::update(o, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = 1.0f});
      const double wn = std::sqrt(double(n)) * double(wv), gn = std::sqrt(double(n)) * double(gv);
      const double lambda = double(o.trust) * wn / (gn + double(o.weight_decay) * wn + double(o.epsilon));
      const double want = double(wv) - lambda * (double(gv) + double(o.weight_decay) * double(wv));
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(std::isfinite(w[i]));
        REQUIRE(std::fabs(double(w[i]) - want) <= 1e-5 * std::fabs(want) + 1e-6 * std::fabs(double(wv)));
      }
    }
  }
}
