// Multi-tensor optimizer steps on the device against the host sweep (optim/update.hpp): SGD in
// every variant bit for bit (same element function, no norms), the bf16 copy of the weights bit
// for bit, and the per-tensor sums of squares (the LARS norms) against fp64 sums taken here,
// through a probe optimizer whose coefficients are the sums themselves.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include <lockstep/device/optim.hpp>
#include <lockstep/codec/bf16.hpp>
#include <lockstep/codec/dyntree8.hpp>
#include <lockstep/codec/fp32.hpp>
#include <lockstep/device/step.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/sgd.hpp>
#include <lockstep/optim/step.hpp>
#include <lockstep/optim/update.hpp>
#include <lockstep/topology/ring.hpp>
#include <lockstep/topology/torus2d.hpp>
#include <lockstep/transport/inproc_device.hpp>
#include <lockstep/transport/run_inproc.hpp>

#include "common.hpp"

using namespace lockstep;

namespace {

// Tensor sizes around the block edges, a few exempt (bias-like) ones among them.
optim::param_set shapes() {
  const std::vector<std::size_t> sizes = {64, 4096, 4097, 9408, 1, 147456, 256, 2359296 / 8, 1000, 12345};
  const std::vector<bool> exempt = {true, false, false, false, true, false, true, false, true, false};
  return optim::param_set::packed(sizes, exempt);
}

// Its coefficients are the tensor's sums; its update writes them into w and v. Pick = 0: (w2, g2),
// Pick = 1: (d2, d2).
template <int Pick>
struct probe {
  float decay = 0.25f;
  struct coeffs {
    double a, b;
  };
  static constexpr std::string_view name() noexcept { return "probe"; }
  constexpr bool uses_momentum() const noexcept { return true; }
  constexpr optim::sum_request sums(bool exempt) const noexcept {
    return exempt ? optim::sum_request{} : optim::sum_request{true, true, true, decay};
  }
  LOCKSTEP_HD constexpr coeffs coefficients(const optim::step_context&, const optim::tensor_sums& s, bool) const noexcept {
    return Pick == 0 ? coeffs{s.w2, s.g2} : coeffs{s.d2, s.d2};
  }
  LOCKSTEP_HD static constexpr void update(const coeffs& k, float& w, float, float& v) noexcept {
    w = static_cast<float>(k.a);
    v = static_cast<float>(k.b);
  }
};

template <class O>
void compare_sgd(const O& opt, optim::step_context ctx) {
  CAPTURE(opt.momentum, opt.weight_decay, opt.nesterov, opt.decay_exempt);
  const optim::param_set ps = shapes();
  const std::size_t n = ps.size();
  auto w = test::inputs(n, 1, false), g = test::inputs(n, 2, false);
  device::stream s;
  device::param_table table(ps, s.get());
  auto dw = test::to_device(w, s.get());
  auto dg = test::to_device(g, s.get());
  device::buffer<float> dv(n, s.get());
  device::buffer<std::uint16_t> dbf(n, s.get());
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dv.data(), 0, n * sizeof(float), s.get()));
  LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dbf.data(), 0, n * sizeof(std::uint16_t), s.get()));

  optim::state st(ps, opt);
  std::vector<std::uint16_t> bf(n, 0);
  for (int step = 0; step < 3; ++step) {  // three steps: the momentum buffer matters
    optim::update(opt, ps, std::span<float>(w), std::span<const float>(g), st, ctx, std::span<std::uint16_t>(bf));
    device::update_async(opt, table, ctx, dw.data(), dg.data(), dv.data(), s.get(), dbf.data());
  }
  CHECK(test::same_bits(test::to_host(dw.data(), n, s.get()), w));
  CHECK(test::to_host(dbf.data(), n, s.get()) == bf);
  if (opt.uses_momentum()) {
    const auto v = st.momentum();
    CHECK(test::same_bits(test::to_host(dv.data(), n, s.get()), std::vector<float>(v.begin(), v.end())));
  }
}

}  // namespace

TEST_CASE("device SGD equals the host sweep bit for bit in every variant", "[device][optim]") {
  const optim::step_context ctx{0.1f, 0.25f};
  compare_sgd(optim::sgd{}, ctx);
  compare_sgd(optim::sgd{0.9f}, ctx);
  compare_sgd(optim::sgd{0.9f, 1e-4f}, ctx);
  compare_sgd(optim::sgd{0.9f, 1e-4f, true}, ctx);
  compare_sgd(optim::sgd{0.9f, 5e-4f, false, true}, ctx);
}

TEST_CASE("device per-tensor sums of squares match fp64 sums to rounding", "[device][optim]") {
  const optim::param_set ps = shapes();
  const std::size_t n = ps.size();
  const auto w = test::inputs(n, 3, false), g = test::inputs(n, 4, false);
  const float gs = 0.5f, decay = 0.25f;
  device::stream s;
  device::param_table table(ps, s.get());
  auto dg = test::to_device(g, s.get());
  for (int pick = 0; pick < 2; ++pick) {
    auto dw = test::to_device(w, s.get());
    device::buffer<float> dv(n, s.get());
    if (pick == 0) device::update_async(probe<0>{decay}, table, {1.0f, gs}, dw.data(), dg.data(), dv.data(), s.get());
    else device::update_async(probe<1>{decay}, table, {1.0f, gs}, dw.data(), dg.data(), dv.data(), s.get());
    const auto hw = test::to_host(dw.data(), n, s.get()), hv = test::to_host(dv.data(), n, s.get());
    for (std::size_t t = 0; t < ps.tensor_count(); ++t) {
      const auto& d = ps[t];
      if (d.exempt) continue;
      double w2 = 0, g2 = 0, d2 = 0;
      for (std::size_t i = d.offset; i < d.offset + d.size; ++i) {
        w2 += double(w[i]) * w[i];
        g2 += double(gs) * g[i] * double(gs) * g[i];
        const double x = double(gs) * g[i] + double(decay) * w[i];
        d2 += x * x;
      }
      CAPTURE(t, pick);
      const double a = pick == 0 ? w2 : d2, b = pick == 0 ? g2 : d2;
      CHECK(hw[d.offset] == Approx(a).epsilon(1e-6));
      CHECK(hv[d.offset + d.size - 1] == Approx(b).epsilon(1e-6));
    }
  }
}

namespace {

// device::step (all-reduce with the update as epilogue) against optim::step on the host, for the
// same per-rank gradients: three steps, so momentum and the changed weights matter.
template <class O, class Topo, class Codec>
void compare_fused_step(int ranks, const O& opt, const Topo& topo, const Codec& proto, bool exact) {
  CAPTURE(ranks, std::string(O::name()), topo.name(), std::string(proto.name()));
  const optim::param_set ps = shapes();
  const std::size_t n = ps.size();
  const auto w0 = test::inputs(n, 5, false);
  std::vector<std::vector<float>> grads;
  for (int r = 0; r < ranks; ++r) grads.push_back(test::inputs(n, 100 + r, false));
  const float lr = 0.05f;
  std::vector<std::vector<float>> host(ranks), dev(ranks);
  std::vector<std::vector<std::uint16_t>> host_bf(ranks), dev_bf(ranks);

  run_inproc(ranks, [&](group<transport::inproc>& g) {
    Codec c = proto;
    std::vector<float> w = w0, gr;
    std::vector<std::uint16_t> bf(n);
    optim::state st(ps, opt);
    for (int k = 0; k < 3; ++k) {
      gr = grads[g.rank()];
      optim::step(g, topo, c, optim::plan<O>{.opt = opt, .params = ps, .st = st, .weights = w, .grads = gr, .weights_bf16 = bf},
                  lr);
    }
    host[g.rank()] = w;
    host_bf[g.rank()] = bf;
  });
  // The device step twice: one bucket, and one bucket per tensor made ready last to first (as
  // backward writes them); both must give the host's weights.
  for (int bucketed = 0; bucketed < 2; ++bucketed)
  run_inproc_device(ranks, [&](group<transport::inproc_device>& g) {
    CAPTURE(bucketed);
    Codec c = proto;
    device::param_table table(ps, g.stream());
    auto dw = test::to_device(w0, g.stream());
    device::buffer<float> dg(n, g.stream()), dv(n, g.stream());
    device::buffer<std::uint16_t> dbf(n, g.stream());
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(dv.data(), 0, n * sizeof(float), g.stream()));
    for (int k = 0; k < 3; ++k) {
      LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dg.data(), grads[g.rank()].data(), n * sizeof(float), cudaMemcpyHostToDevice, g.stream()));
      const device::plan<O> p{.opt = opt, .table = table, .weights = {dw.data(), n}, .grads = {dg.data(), n},
                              .momentum = dv.data(), .weights_bf16 = dbf.data()};
      if (!bucketed) {
        optim::step(g, topo, c, p, lr);
      } else {
        std::vector<optim::bucket> buckets;
        for (std::size_t t = 0; t < ps.tensor_count(); ++t) buckets.push_back({ps[t].offset, ps[t].offset + ps[t].size});
        auto s = optim::begin_step(g, topo, c, p, buckets, lr);
        for (std::size_t k = buckets.size(); k-- > 0;) s.bucket_ready(k);
        s.wait();
      }
    }
    const auto w_now = test::to_host(dw.data(), n, g.stream());
    const auto bf_now = test::to_host(dbf.data(), n, g.stream());
    if (bucketed) {  // the bucketed run equals the one-bucket run on this rank, bit for bit
      CHECK(test::same_bits(w_now, dev[g.rank()]));
      CHECK(bf_now == dev_bf[g.rank()]);
    }
    dev[g.rank()] = w_now;
    dev_bf[g.rank()] = bf_now;
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    if (exact) {
      CHECK(test::same_bits(host[r], dev[r]));
      CHECK(host_bf[r] == dev_bf[r]);
    } else {
      double worst = 0;
      for (std::size_t i = 0; i < n; ++i)
        worst = std::max(worst, std::abs(double(host[r][i]) - dev[r][i]) / std::max(1e-3, std::abs(double(host[r][i]))));
      CHECK(worst < 1e-5);
    }
    CHECK(test::same_bits(dev[r], dev[0]));  // every rank holds the same weights
  }
}

}  // namespace

TEST_CASE("device::step (update as the all-reduce's epilogue) equals optim::step on the host", "[device][optim][step]") {
  for (int ranks : {1, 2, 4}) {
    compare_fused_step(ranks, optim::sgd{0.9f, 1e-4f}, topology::ring{}, codec::fp32{}, true);
    compare_fused_step(ranks, optim::sgd{0.9f, 1e-4f, true}, topology::torus2d{}, codec::dyntree8{}, true);
    // LARS: norms are summed in another order on the device (fp64, then rounded): equal to rounding.
    compare_fused_step(ranks, optim::lars{}, topology::ring{}, codec::fp32{}, false);
    compare_fused_step(ranks, optim::lars{}, topology::torus2d{}, codec::bf16{}, false);
  }
}
