// Tests for lockstep/optim/split_update.hpp: an update of tensors split over a group. LARS over
// K ranks' slices gives the single-rank update of the whole tensors (norms equal up to fp64
// summation order), every rank gets the same whole-tensor sums bit for bit, SGD needs no
// communication and is bitwise optim::update, and ranks that list their slices differently fail
// with errc::mismatch on every rank instead of hanging.
#include "thread_safe_catch.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <mutex>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/split_update.hpp>
#include <lockstep/optim/update.hpp>
#include <lockstep/transport/counting.hpp>

namespace optim = lockstep::optim;

namespace {

// Whole tensors: sizes (prime, tiny, over a block, over several waves) and exempt flags.
const std::vector<std::size_t> sizes{1000, 13, 4097, 17, 250, 7};
const std::vector<bool> exempt{false, true, false, false, true, false};

float w_at(std::size_t t, std::size_t i) { return std::sin(0.013f * float(i) + float(t)) + 0.1f * float(t + 1); }
float g_at(std::size_t t, std::size_t i) { return std::cos(0.29f * float(i) - float(t)) * 0.01f * float(t + 1); }

// Rank k's slice of tensor t: chunk_range, as the parallel layers cut a dimension.
std::pair<std::size_t, std::size_t> slice(std::size_t t, int K, int k) {
  return lockstep::chunk_range(sizes[t], static_cast<std::size_t>(K), static_cast<std::size_t>(k));
}

// The reference: the whole tensors on one rank, `steps` updates with fixed gradients.
template <class O>
std::vector<std::vector<float>> whole_run(const O& opt, int steps, float grad_scale) {
  const auto ps = optim::param_set::packed(sizes, exempt, 16);
  std::vector<float> w(ps.size()), g(ps.size());
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i) w[ps[t].offset + i] = w_at(t, i), g[ps[t].offset + i] = g_at(t, i);
  optim::state st(ps, opt);
  for (int s = 0; s < steps; ++s)
    optim::update(opt, ps, std::span<float>(w), std::span<const float>(g), st, {.lr = 0.5f, .grad_scale = grad_scale});
  std::vector<std::vector<float>> out(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t)
    out[t].assign(w.begin() + static_cast<std::ptrdiff_t>(ps[t].offset),
                  w.begin() + static_cast<std::ptrdiff_t>(ps[t].offset + sizes[t]));
  return out;
}

// This rank's slices packed into one param_set, in tensor order.
struct slices {
  optim::param_set ps;
  std::vector<float> w, g;
  slices(int K, int k, const std::vector<bool>& ex = exempt) : ps(make(K, k, ex)), w(ps.size()), g(ps.size()) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto [lo, hi] = slice(t, K, k);
      for (std::size_t i = lo; i < hi; ++i) w[ps[t].offset + i - lo] = w_at(t, i), g[ps[t].offset + i - lo] = g_at(t, i);
    }
  }
  static optim::param_set make(int K, int k, const std::vector<bool>& ex) {
    std::vector<std::size_t> n;
    for (std::size_t t = 0; t < sizes.size(); ++t) n.push_back(slice(t, K, k).second - slice(t, K, k).first);
    return optim::param_set::packed(n, ex, 16);
  }
};

// `steps` split updates on K ranks; the whole tensors put back together from every rank's slices.
template <class O>
std::vector<std::vector<float>> split_run(const O& opt, int K, int steps, float grad_scale) {
  std::vector<std::vector<float>> out(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) out[t].assign(sizes[t], NAN);
  std::mutex mu;
  lockstep::run_inproc(K, [&](auto& g) {
    slices s(K, g.rank());
    optim::state st(s.ps, opt);
    for (int i = 0; i < steps; ++i)
      optim::split_update(g, opt, s.ps, std::span<float>(s.w), std::span<const float>(s.g), st,
                          {.lr = 0.5f, .grad_scale = grad_scale});
    std::lock_guard lk(mu);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto [lo, hi] = slice(t, K, g.rank());
      for (std::size_t i = lo; i < hi; ++i) out[t][i] = s.w[s.ps[t].offset + i - lo];
    }
  });
  return out;
}

}  // namespace

TEST_CASE("LARS over K ranks' slices equals LARS over the whole tensors", "[split_update]") {
  for (const optim::lars& opt : {optim::lars{.trust = 0.02f},
                                 optim::lars{.trust = 0.02f, .nesterov = true,
                                             .denom = optim::lars::denominator::decayed_norm}}) {
    const auto ref = whole_run(opt, 4, 0.25f);
    for (int K : {1, 2, 3, 4, 7}) {
      INFO(K << " ranks, denominator " << (opt.denom == optim::lars::denominator::norm_sum ? "norm_sum" : "decayed_norm"));
      const auto got = split_run(opt, K, 4, 0.25f);
      double worst = 0;
      for (std::size_t t = 0; t < sizes.size(); ++t)
        for (std::size_t i = 0; i < sizes[t]; ++i)
          worst = std::max(worst, std::fabs(double(got[t][i]) - double(ref[t][i])) / std::max(1e-3, std::fabs(double(ref[t][i]))));
      CHECK(worst < 1e-6);  // λ equal up to fp64 summation order, then rounded to fp32 like the reference's
    }
  }
}

TEST_CASE("every rank gets the whole tensors' sums, bit for bit the same", "[split_update]") {
  for (const optim::lars& opt : {optim::lars{}, optim::lars{.denom = optim::lars::denominator::decayed_norm}}) {
    for (int K : {2, 3, 5}) {
      std::vector<std::vector<optim::tensor_sums>> got(static_cast<std::size_t>(K));
      lockstep::run_inproc(K, [&](auto& g) {
        slices s(K, g.rank());
        optim::state st(s.ps, opt);
        optim::detail::sweep<optim::lars> sw(opt, s.ps, s.w.data(), s.g.data(), st, {.lr = 1, .grad_scale = 0.5f}, nullptr,
                                             lockstep::thread_pool::shared());
        got[static_cast<std::size_t>(g.rank())] = optim::split_sums(g, opt, s.ps, sw);
      });
      // The exact sums, in long double.
      const auto d = opt.sums(false);
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        INFO(K << " ranks, tensor " << t);
        long double w2 = 0, g2 = 0, d2 = 0;
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          const long double w = w_at(t, i), gr = 0.5L * g_at(t, i), dd = gr + static_cast<long double>(d.decay) * w;
          w2 += w * w, g2 += gr * gr, d2 += dd * dd;
        }
        for (int k = 0; k < K; ++k) {
          const auto& a = got[static_cast<std::size_t>(k)][t];
          const auto& b = got[0][t];
          CHECK(std::bit_cast<std::uint64_t>(a.w2) == std::bit_cast<std::uint64_t>(b.w2));
          CHECK(std::bit_cast<std::uint64_t>(a.g2) == std::bit_cast<std::uint64_t>(b.g2));
          CHECK(std::bit_cast<std::uint64_t>(a.d2) == std::bit_cast<std::uint64_t>(b.d2));
        }
        const auto& s = got[0][t];
        if (exempt[t]) {
          CHECK(s.w2 == 0);  // exempt tensors ask for no sums
          continue;
        }
        CHECK(std::fabs(s.w2 - double(w2)) <= 1e-6 * double(w2));  // fp32 partials of 8 squares
        if (d.grads) CHECK(std::fabs(s.g2 - double(g2)) <= 1e-6 * double(g2));
        if (d.decayed_grads) CHECK(std::fabs(s.d2 - double(d2)) <= 1e-6 * double(d2));
      }
    }
  }
}

TEST_CASE("SGD over slices is optim::update on each slice, with nothing sent", "[split_update]") {
  const optim::sgd opt{.momentum = 0.9f, .weight_decay = 1e-3f};
  const auto ref = whole_run(opt, 3, 0.5f);
  const auto got = split_run(opt, 3, 3, 0.5f);
  for (std::size_t t = 0; t < sizes.size(); ++t) CHECK(got[t] == ref[t]);
  // The same update on a counted group: not a byte, not a header. LARS, for contrast, sends.
  using counted = lockstep::transport::counting<lockstep::transport::inproc>;
  for (int lars = 0; lars < 2; ++lars) {
    auto world = lockstep::transport::inproc::make_world(3);
    std::vector<lockstep::transport::traffic> sent(3);
    lockstep::transport::detail::run_ranks(3, *world, [&](int r) {
      lockstep::group<counted> g(counted(lockstep::transport::inproc(world, r)));
      slices s(3, r);
      auto step = [&](const auto& o) {
        optim::state st(s.ps, o);
        optim::split_update(g, o, s.ps, std::span<float>(s.w), std::span<const float>(s.g), st, {.lr = 0.5f});
      };
      if (lars) step(optim::lars{});
      else step(opt);
      sent[static_cast<std::size_t>(r)] = g.transport().sent();
    });
    for (const auto& t : sent) {
      INFO((lars ? "lars" : "sgd"));
      CHECK((t.bytes + t.header_bytes == 0) == !lars);
    }
  }
}

TEST_CASE("ranks that list their slices differently fail on every rank, naming the disagreement", "[split_update]") {
  const optim::lars opt{};
  for (int which = 0; which < 2; ++which) {
    INFO((which == 0 ? "an exempt flag differs" : "a tensor count differs"));
    std::vector<std::string> errors(3);
    std::vector<int> codes(3, -1);
    try {
      lockstep::run_inproc(3, [&](auto& g) {
        std::vector<bool> ex = exempt;
        if (g.rank() == 1) ex[2] = true;
        std::vector<std::size_t> n{100, 50, 30};
        if (which == 1 && g.rank() == 2) n.push_back(5);
        const auto ps = which == 0 ? slices::make(3, g.rank(), ex) : optim::param_set::packed(n, {}, 16);
        std::vector<float> w(ps.size(), 1.0f), gr(ps.size(), 0.1f);
        optim::state st(ps, opt);
        try {
          optim::split_update(g, opt, ps, std::span<float>(w), std::span<const float>(gr), st, {.lr = 0.1f});
        } catch (const lockstep::error& e) {
          errors[static_cast<std::size_t>(g.rank())] = e.what();
          codes[static_cast<std::size_t>(g.rank())] = static_cast<int>(e.code());
          throw;
        }
      });
    } catch (const lockstep::error&) {
    }
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
      CHECK(!errors[static_cast<std::size_t>(r)].empty());
    }
    // Some rank sees the disagreement as a mismatch; the others may leave on the abort it causes.
    int mismatches = 0;
    for (int r = 0; r < 3; ++r) {
      if (codes[static_cast<std::size_t>(r)] != static_cast<int>(lockstep::errc::mismatch)) continue;
      ++mismatches;
      if (which == 0) {
        CHECK_THAT(errors[static_cast<std::size_t>(r)], Catch::Contains("tensor 2 is"));
        CHECK_THAT(errors[static_cast<std::size_t>(r)], Catch::Contains("exempt on rank"));
      }
    }
    CHECK(mismatches >= 1);
  }
}
