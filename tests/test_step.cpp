// Tests for lockstep/optim/step.hpp, ranks as threads (run_inproc):
//   - the fused step (update as the all-reduce's epilogue) equals all_reduce(average) followed by
//     optim::update — bitwise where 1/ranks is a power of two, to fp32 rounding otherwise;
//   - every rank ends with the same bits;
//   - the sharded step equals the unsharded one (SGD bitwise, LARS to fp32 rounding), for ring and
//     torus, with tensors cut by chunk boundaries, and writes the same bf16 copy.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <mutex>
#include <variant>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim.hpp>

namespace optim = lockstep::optim;
using lockstep::group;
using lockstep::transport::inproc;

namespace {

// Sizes chosen so that chunk boundaries fall inside tensors for 2, 3 and 4 ranks.
const std::vector<std::size_t> sizes{1000, 3, 64, 4097, 17, 250, 2001, 1};
const std::vector<bool> exempt{false, true, false, false, true, false, false, true};
constexpr int steps = 3;
constexpr float lrs[steps] = {0.5f, 0.25f, 1.0f};

float weight0(std::size_t i) { return std::sin(0.011f * float(i)) + 0.05f; }
float grad(int rank, int s, std::size_t i) {
  return 0.01f * std::cos(0.37f * float(i) + 1.3f * float(rank) + 0.7f * float(s));
}

struct outcome {
  std::vector<std::vector<float>> w, v;          // (rank, element)
  std::vector<std::vector<std::uint16_t>> bf;    // (rank, element)
};

enum class mode { fused, unfused, sharded };

template <class Topo, class Codec, class O>
outcome run(int n, const Topo& topo, const O& opt, mode m) {
  const auto ps = optim::param_set::packed(sizes, exempt, 16, {.block = 128, .task = 300, .wave = 1500});
  outcome out;
  out.w.resize(n);
  out.v.resize(n);
  out.bf.resize(n);
  std::mutex mu;
  lockstep::thread_pool pool(2);
  // Small segments: the all-reduce pipelines several per chunk.
  lockstep::run_inproc(
      n,
      [&](group<inproc>& g) {
        std::vector<float> w(ps.size()), gr(ps.size());
        std::vector<std::uint16_t> bf(ps.size(), 0);
        for (std::size_t i = 0; i < w.size(); ++i) w[i] = weight0(i);
        optim::state st(ps, opt);
        Codec codec{};
        for (int s = 0; s < steps; ++s) {
          for (std::size_t i = 0; i < gr.size(); ++i) gr[i] = grad(g.rank(), s, i);
          switch (m) {
            case mode::fused: optim::step(g, topo, codec, opt, ps, w, gr, st, lrs[s], bf, pool); break;
            case mode::sharded: optim::step_sharded(g, topo, codec, opt, ps, w, gr, st, lrs[s], bf, pool); break;
            case mode::unfused:
              lockstep::all_reduce(g, std::span<float>(gr), topo, codec, lockstep::reduce_op::average);
              optim::update(opt, ps, std::span<float>(w), std::span<const float>(gr), st, {.lr = lrs[s]}, bf, pool);
              break;
          }
        }
        std::lock_guard lk(mu);
        out.w[g.rank()] = w;
        out.v[g.rank()].assign(st.momentum().begin(), st.momentum().end());
        out.bf[g.rank()] = bf;
      },
      {.timeout = std::chrono::seconds(60), .segment_bytes = 1024});
  return out;
}

const std::vector<optim::sgd> sgds{
    {.momentum = 0.9f, .weight_decay = 1e-3f},
    {.momentum = 0.9f, .weight_decay = 1e-2f, .nesterov = true, .decay_exempt = true},
    {.momentum = 0.0f, .weight_decay = 1e-3f},
};
const std::vector<optim::lars> larses{
    {},
    {.momentum = 0.9f, .weight_decay = 1e-3f, .trust = 0.01f, .nesterov = true,
     .denom = optim::lars::denominator::decayed_norm, .lr_at = optim::lars::lr_placement::outside},
};

void require_close(const std::vector<float>& a, const std::vector<float>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(double(a[i]) - double(b[i])) <= rel * std::max(1.0, std::fabs(double(b[i])))))
      FAIL("element " << i << ": " << a[i] << " vs " << b[i]);
}

void require_ranks_agree(const outcome& o) {
  for (std::size_t r = 1; r < o.w.size(); ++r) {
    REQUIRE(o.w[r] == o.w[0]);
    REQUIRE(o.bf[r] == o.bf[0]);
  }
}

template <class Topo, class Codec, class O>
void fused_equals_unfused(const Topo& topo, const O& opt) {
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    const outcome f = run<Topo, Codec>(n, topo, opt, mode::fused);
    const outcome u = run<Topo, Codec>(n, topo, opt, mode::unfused);
    require_ranks_agree(f);
    if ((n & (n - 1)) == 0) {
      // x/n and x·(1/n) are the same number when n is a power of two.
      REQUIRE(f.w[0] == u.w[0]);
      REQUIRE(f.v[0] == u.v[0]);
      REQUIRE(f.bf[0] == u.bf[0]);
    } else if constexpr (std::is_same_v<Codec, lockstep::codec::fp32>) {
      require_close(f.w[0], u.w[0], 1e-6);
    } else {
      // The fused step rounds the sum to bf16, the other the average: 2^-9 of each gradient
      // apart, so the weights differ by a few parts in 2^9 of how far they moved.
      double moved = 0;
      for (std::size_t i = 0; i < u.w[0].size(); ++i) moved = std::max(moved, std::fabs(double(u.w[0][i]) - weight0(i)));
      for (std::size_t i = 0; i < u.w[0].size(); ++i)
        REQUIRE(std::fabs(double(f.w[0][i]) - double(u.w[0][i])) <= moved / 128);
    }
  }
}

}  // namespace

TEST_CASE("fused SGD step equals all_reduce(average) then update", "[step]") {
  for (const auto& opt : sgds) {
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::fp32>(lockstep::topology::ring{}, opt);
    fused_equals_unfused<lockstep::topology::torus2d, lockstep::codec::fp32>(lockstep::topology::torus2d{}, opt);
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::bf16>(lockstep::topology::ring{}, opt);
  }
}

TEST_CASE("fused LARS step equals all_reduce(average) then update", "[step]") {
  for (const auto& opt : larses) {
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::fp32>(lockstep::topology::ring{}, opt);
    fused_equals_unfused<lockstep::topology::torus2d, lockstep::codec::fp32>(lockstep::topology::torus2d{}, opt);
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::bf16>(lockstep::topology::ring{}, opt);
  }
}

TEST_CASE("sharded step equals the unsharded step", "[step]") {
  auto check = [](const auto& topo, const auto& opt, bool bitwise) {
    using Topo = std::decay_t<decltype(topo)>;
    for (int n = 1; n <= 4; ++n) {
      INFO(n << " ranks, " << topo.name() << ", " << std::decay_t<decltype(opt)>::name());
      const outcome s = run<Topo, lockstep::codec::fp32>(n, topo, opt, mode::sharded);
      const outcome f = run<Topo, lockstep::codec::fp32>(n, topo, opt, mode::fused);
      require_ranks_agree(s);
      if (bitwise) {
        REQUIRE(s.w[0] == f.w[0]);
        REQUIRE(s.bf[0] == f.bf[0]);
      } else {
        require_close(s.w[0], f.w[0], 1e-6);
      }
      // Each rank's momentum is right on its own chunk and untouched elsewhere.
      if (!f.v[0].empty())
        for (int r = 0; r < n; ++r) {
          const auto [lo, hi] = lockstep::chunk_range(f.v[0].size(), n, r);
          for (std::size_t i = 0; i < f.v[0].size(); ++i) {
            if (i >= lo && i < hi) {
              if (bitwise) REQUIRE(s.v[r][i] == f.v[0][i]);
              else REQUIRE(std::fabs(s.v[r][i] - f.v[0][i]) <= 1e-6 * std::max(1.0f, std::fabs(f.v[0][i])));
            } else {
              REQUIRE(s.v[r][i] == 0.0f);
            }
          }
        }
    }
  };
  for (const auto& opt : sgds) {
    check(lockstep::topology::ring{}, opt, true);
    check(lockstep::topology::torus2d{}, opt, true);
  }
  for (const auto& opt : larses) {
    check(lockstep::topology::ring{}, opt, false);
    check(lockstep::topology::torus2d{}, opt, false);
  }
}

TEST_CASE("sharded step with a lossy gradient codec keeps fp32 weights equal on every rank", "[step]") {
  for (int n = 2; n <= 4; ++n) {
    const outcome s = run<lockstep::topology::ring, lockstep::codec::bf16>(n, lockstep::topology::ring{}, larses[0], mode::sharded);
    const outcome f = run<lockstep::topology::ring, lockstep::codec::fp32>(n, lockstep::topology::ring{}, larses[0], mode::fused);
    require_ranks_agree(s);
    // bf16 gradients move each update by at most 2^-8 of itself; the updates are below 1e-2.
    require_close(s.w[0], f.w[0], 1e-4);
    bool any_differs = false;
    for (std::size_t i = 0; i < s.w[0].size(); ++i) any_differs = any_differs || s.w[0][i] != f.w[0][i];
    CHECK(any_differs);  // the codec did act
  }
}
