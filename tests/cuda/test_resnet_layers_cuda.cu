// The ResNet-50 sample's cuDNN/cuBLAS backend (samples/resnet50/layers_cuda.cuh, model_cuda.cuh)
// layer by layer against the CPU backend, on small shapes, in fp32 and bf16:
//   - convolutions (7x7/2, 3x3/1, 3x3/2, 1x1/1, 1x1/2; NHWC, OIHW weights) and the classifier against
//     a float64 reference of what oneDNN computes on the CPU (this program must build where oneDNN
//     is absent, as on the lent GPU machine); fp32 within 1e-4 of the largest value, bf16 (inputs
//     rounded to bf16 first, the reference on the rounded values) within 1e-2: cuDNN's bf16 output
//     is rounded to bf16 once (2^-8 relative) and accumulation orders differ;
//   - batch norm (+ ReLU), the bottleneck's end and its backward sums, max pooling, global average
//     pooling, the NHWC input, the loss against the CPU backend's own kernels (kernels_cpu.hpp,
//     softmax_xent.hpp; the element math is shared): fp32 within 1e-5 (batch norm: per-channel sums
//     in another order) or bit for bit (pooling, input), bf16 outputs within one bf16 rounding;
//   - one bottleneck (block 3: projection, stride 2; and block 1: identity) forward and backward: input and
//     parameter gradients against central finite differences in fp32, two identical passes bit
//     identical, and bf16 against fp32 within 5e-2 (forward) and 1.5e-1 (gradients), relative L2.
// Batch norm over a group of G > 1 replicas is host code shared with the CPU backend
// (bn_merge_stats), covered by the CPU tests; here G = 1.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "../../samples/common/softmax_xent.hpp"
#include "../../samples/resnet50/kernels_cpu.hpp"
#include "../../samples/resnet50/model_cuda.cuh"
#include "../fashion_gradcheck.hpp"
#include "common.hpp"

using namespace resnet;
using fashion_test::check_gradient;
using fashion_test::dot;
using fashion_test::randn;
using sample::gpu::conv_desc;

namespace {

cudaStream_t stream() { return gpu::stream(); }

template <class T>
lockstep::device::buffer<T> up(const std::vector<T>& v) {
  return lockstep::test::to_device(v, stream());
}
template <class T>
std::vector<T> down(const T* d, std::size_t n) {
  return lockstep::test::to_host(d, n, stream());
}
template <class T>
std::vector<T> down(const lockstep::device::buffer<T>& d) {
  return down(d.data(), d.size());
}

template <class T>
std::vector<T> stored(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = store_as<T>(v[i]);
  return out;
}
template <class T>
std::vector<float> loaded(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = load(v[i]);
  return out;
}

// max |got - want| <= rel * max |want|
void check_close(const std::vector<float>& got, const std::vector<float>& want, double rel, const char* what) {
  REQUIRE(got.size() == want.size());
  double scale = 0, worst = 0;
  std::size_t where = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (e > worst) worst = e, where = i;
  }
  INFO(what << ": largest error " << worst << " at " << where << " (got " << got[where] << ", want " << want[where]
            << "), largest value " << scale << ", bound " << rel << " of it");
  CHECK(worst <= rel * std::max(scale, 1e-30));
}

// ||got - want|| <= rel ||want||
void check_l2(const std::vector<float>& got, const std::vector<float>& want, double rel, const char* what) {
  REQUIRE(got.size() == want.size());
  double d = 0, n = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    d += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    n += static_cast<double>(want[i]) * want[i];
  }
  INFO(what << ": relative L2 error " << std::sqrt(d / std::max(n, 1e-300)) << ", bound " << rel);
  CHECK(std::sqrt(d) <= rel * std::sqrt(n));
}

template <class T>
constexpr double out_tol = std::is_same_v<T, float> ? 1e-5 : 1.0 / 128;  // one bf16 rounding (2^-8) and then some

// ----------------------------------------------------------------------------------------------
// float64 references of oneDNN's convolution and inner product (NHWC activations, OIHW weights).

std::size_t nhwc(const conv_desc& s, int b, int y, int x, int c, bool out) {
  const int H = out ? s.OH() : s.H, W = out ? s.OW() : s.W, C = out ? s.K : s.C;
  return ((static_cast<std::size_t>(b) * H + y) * W + x) * C + c;
}
std::size_t oihw(const conv_desc& s, int k, int c, int y, int x) {
  return ((static_cast<std::size_t>(k) * s.C + c) * s.R + y) * s.R + x;
}

// Calls f(out index, in index, weight index) for every multiply of the convolution.
template <class F>
void conv_walk(const conv_desc& s, F&& f) {
  const int P = s.R / 2;
  for (int b = 0; b < s.B; ++b)
    for (int oy = 0; oy < s.OH(); ++oy)
      for (int ox = 0; ox < s.OW(); ++ox)
        for (int k = 0; k < s.K; ++k)
          for (int ky = 0; ky < s.R; ++ky)
            for (int kx = 0; kx < s.R; ++kx) {
              const int iy = oy * s.S - P + ky, ix = ox * s.S - P + kx;
              if (iy < 0 || iy >= s.H || ix < 0 || ix >= s.W) continue;
              for (int c = 0; c < s.C; ++c)
                f(nhwc(s, b, oy, ox, k, true), nhwc(s, b, iy, ix, c, false), oihw(s, k, c, ky, kx));
            }
}

template <class T>
void check_conv(const conv_desc& s, std::uint32_t seed) {
  INFO("conv B " << s.B << " C " << s.C << " H " << s.H << " K " << s.K << " R " << s.R << " S " << s.S);
  const std::size_t nx = static_cast<std::size_t>(s.B) * s.H * s.W * s.C,
                    ny = static_cast<std::size_t>(s.B) * s.OH() * s.OW() * s.K,
                    nw = static_cast<std::size_t>(s.K) * s.C * s.R * s.R;
  // Values the type holds exactly, so the reference sees what the GPU reads.
  const auto x = loaded(stored<T>(randn(nx, seed))), w = loaded(stored<T>(randn(nw, seed + 1, 0.3f))),
             dy = loaded(stored<T>(randn(ny, seed + 2)));
  std::vector<double> y(ny, 0.0), dx(nx, 0.0), dw(nw, 0.0);
  conv_walk(s, [&](std::size_t o, std::size_t i, std::size_t j) {
    y[o] += static_cast<double>(x[i]) * w[j];
    dx[i] += static_cast<double>(dy[o]) * w[j];
    dw[j] += static_cast<double>(dy[o]) * x[i];
  });
  auto x_ = up(stored<T>(x)), w_ = up(stored<T>(w)), dy_ = up(stored<T>(dy));
  lockstep::device::buffer<float> y_(ny, stream()), dx_(nx, stream()), dw_(nw, stream());
  gpu::conv_forward(y_.data(), x_.data(), w_.data(), s);
  gpu::conv_backward(dx_.data(), dw_.data(), dy_.data(), x_.data(), w_.data(), s);
  const double tol = std::is_same_v<T, float> ? 1e-4 : 1e-2;
  check_close(down(y_), std::vector<float>(y.begin(), y.end()), tol, "forward");
  check_close(down(dx_), std::vector<float>(dx.begin(), dx.end()), tol, "backward data");
  check_close(down(dw_), std::vector<float>(dw.begin(), dw.end()), tol, "backward filter");
  // The input gradient is optional (the stem's is not needed).
  gpu::conv_backward<T>(nullptr, dw_.data(), dy_.data(), x_.data(), w_.data(), s);
  check_close(down(dw_), std::vector<float>(dw.begin(), dw.end()), tol, "backward filter alone");
}

}  // namespace

TEMPLATE_TEST_CASE("cuDNN NHWC convolutions match a float64 reference", "[resnet][cuda]", float, bf16_t) {
  const conv_desc shapes[] = {{2, 3, 11, 11, 8, 7, 2}, {2, 8, 7, 7, 6, 3, 1}, {2, 8, 7, 7, 6, 3, 2},
                              {2, 8, 5, 5, 16, 1, 1}, {2, 16, 6, 6, 8, 1, 2}};
  std::uint32_t seed = 1;
  for (const conv_desc& s : shapes) check_conv<TestType>(s, seed += 10);
}

TEMPLATE_TEST_CASE("cuBLAS classifier matches a float64 reference", "[resnet][cuda]", float, bf16_t) {
  using T = TestType;
  const int B = 3, F = 16, NC = 5;
  const auto x = loaded(stored<T>(randn(static_cast<std::size_t>(B) * F, 31)));
  const auto w = loaded(stored<T>(randn(static_cast<std::size_t>(NC) * F, 32, 0.3f)));
  const auto bias = randn(NC, 33), dy = randn(static_cast<std::size_t>(B) * NC, 34);
  const auto dyr = loaded(stored<T>(dy));  // the products see the output gradient as T
  std::vector<float> y(static_cast<std::size_t>(B) * NC), dx(x.size()), dw(w.size()), db(NC);
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < NC; ++c) {
      double s = bias[c];
      for (int f = 0; f < F; ++f) s += static_cast<double>(x[b * F + f]) * w[c * F + f];
      y[b * NC + c] = static_cast<float>(s);
    }
  for (int f = 0; f < F; ++f) {
    for (int b = 0; b < B; ++b) {
      double s = 0;
      for (int c = 0; c < NC; ++c) s += static_cast<double>(dyr[b * NC + c]) * w[c * F + f];
      dx[b * F + f] = static_cast<float>(s);
    }
    for (int c = 0; c < NC; ++c) {
      double s = 0;
      for (int b = 0; b < B; ++b) s += static_cast<double>(dyr[b * NC + c]) * x[b * F + f];
      dw[c * F + f] = static_cast<float>(s);
    }
  }
  for (int c = 0; c < NC; ++c) {
    double s = 0;
    for (int b = 0; b < B; ++b) s += dy[b * NC + c];
    db[c] = static_cast<float>(s);
  }
  auto x_ = up(stored<T>(x)), w_ = up(stored<T>(w));
  auto bias_ = up(bias), dy_ = up(dy);
  lockstep::device::buffer<float> y_(y.size(), stream()), dx_(dx.size(), stream()), dw_(dw.size(), stream()),
      db_(NC, stream());
  gpu::linear_forward(y_.data(), x_.data(), w_.data(), bias_.data(), B, F, NC);
  gpu::linear_backward(dx_.data(), dw_.data(), db_.data(), dy_.data(), x_.data(), w_.data(), B, F, NC);
  check_close(down(y_), y, 1e-5, "forward");
  check_close(down(dx_), dx, 1e-5, "input gradient");
  check_close(down(dw_), dw, 1e-5, "weight gradient");
  check_close(down(db_), db, 1e-5, "bias gradient");
}

TEMPLATE_TEST_CASE("GPU batch norm (+ReLU) matches the CPU backend's", "[resnet][cuda]", float, bf16_t) {
  using T = TestType;
  const std::size_t N = 50;
  const int K = 6;
  auto x = randn(N * K, 41, 2.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += static_cast<float>(i % K);
  auto gamma = randn(K, 42, 0.5f), beta = randn(K, 43, 0.5f), dout = randn(N * K, 44);
  for (auto& g : gamma) g += 1.0f;
  const bn_group local;
  auto x_ = up(x), g_ = up(gamma), b_ = up(beta), dout_ = up(dout);
  for (bool relu : {false, true}) {
    INFO("relu " << relu);
    // CPU
    std::vector<T> out(N * K), dx(N * K);
    std::vector<float> mean(K), rstd(K), rm(K, 0.0f), rv(K, 1.0f), dg(K), db(K);
    float count = 0;
    batchnorm_forward(out.data(), mean.data(), rstd.data(), &count, rm.data(), rv.data(), x.data(), gamma.data(),
                      beta.data(), N, K, relu, local, true);
    batchnorm_backward(dx.data(), dg.data(), db.data(), dout.data(), x.data(), mean.data(), rstd.data(), count,
                       gamma.data(), beta.data(), N, K, relu, local);
    // GPU
    lockstep::device::buffer<T> out_(N * K, stream()), dx_(N * K, stream());
    lockstep::device::buffer<float> mr_(2 * K, stream()), scratch_(2 * K, stream()), dg_(K, stream()), db_(K, stream());
    std::vector<float> grm(K, 0.0f), grv(K, 1.0f);
    float gcount = 0;
    gpu::batchnorm_forward(out_.data(), mr_.data(), &gcount, grm.data(), grv.data(), x_.data(), g_.data(), b_.data(),
                           N, K, relu, local, true, scratch_.data());
    gpu::batchnorm_backward(dx_.data(), dg_.data(), db_.data(), dout_.data(), x_.data(), mr_.data(), gcount, g_.data(),
                            b_.data(), N, K, relu, local, scratch_.data());
    CHECK(gcount == count);
    std::vector<float> mr = mean;
    mr.insert(mr.end(), rstd.begin(), rstd.end());
    check_close(down(mr_), mr, 1e-5, "mean and rstd");
    check_close(grm, rm, 1e-5, "running mean");
    check_close(grv, rv, 1e-5, "running variance");
    check_close(loaded(down(out_)), loaded(out), out_tol<T>, "output");
    check_close(down(dg_), dg, 1e-5, "dgamma");
    check_close(down(db_), db, 1e-5, "dbeta");
    check_close(loaded(down(dx_)), loaded(dx), 1e-4 + out_tol<T>, "input gradient");
    // Evaluation: the running statistics.
    gpu::batchnorm_forward(out_.data(), mr_.data(), &gcount, grm.data(), grv.data(), x_.data(), g_.data(), b_.data(),
                           N, K, relu, local, false, scratch_.data());
    batchnorm_forward(out.data(), mean.data(), rstd.data(), &count, rm.data(), rv.data(), x.data(), gamma.data(),
                      beta.data(), N, K, relu, local, false);
    check_close(loaded(down(out_)), loaded(out), out_tol<T>, "evaluation output");
  }
}

TEMPLATE_TEST_CASE("GPU bottleneck end (BN + add + ReLU) and its backward sums match the CPU's", "[resnet][cuda]",
                   float, bf16_t) {
  using T = TestType;
  const std::size_t N = 40;
  const int K = 8;
  const auto x = randn(N * K, 51), xd = randn(N * K, 52), gamma = randn(K, 53), beta = randn(K, 54),
             gd = randn(K, 55), bd = randn(K, 56), dout = randn(N * K, 57), dout2 = randn(N * K, 58);
  const auto shortcut = stored<T>(randn(N * K, 59));
  std::vector<float> mean = randn(K, 60, 0.2f), rstd(K), md = randn(K, 61, 0.2f), rd(K);
  for (int k = 0; k < K; ++k) rstd[k] = 0.5f + 0.1f * k, rd[k] = 1.5f - 0.1f * k;
  std::vector<float> mr = mean, mrd = md;
  mr.insert(mr.end(), rstd.begin(), rstd.end());
  mrd.insert(mrd.end(), rd.begin(), rd.end());
  auto x_ = up(x), xd_ = up(xd), g_ = up(gamma), b_ = up(beta), gd_ = up(gd), bd_ = up(bd), mr_ = up(mr),
       mrd_ = up(mrd), dout_ = up(dout), dout2_ = up(dout2);
  auto sc_ = up(shortcut);
  std::vector<T> out(N * K);
  lockstep::device::buffer<T> out_(N * K, stream());

  bn_add_bn_relu_forward(out.data(), x.data(), gamma.data(), beta.data(), mean.data(), rstd.data(), xd.data(),
                         gd.data(), bd.data(), md.data(), rd.data(), N, K);
  gpu::bn_add_bn_relu_forward(out_.data(), x_.data(), g_.data(), b_.data(), mr_.data(), xd_.data(), gd_.data(),
                              bd_.data(), mrd_.data(), N, K);
  check_close(loaded(down(out_)), loaded(out), out_tol<T>, "projection shortcut");

  bn_add_relu_forward(out.data(), x.data(), gamma.data(), beta.data(), mean.data(), rstd.data(), shortcut.data(), N, K);
  gpu::bn_add_relu_forward(out_.data(), x_.data(), g_.data(), b_.data(), mr_.data(), sc_.data(), N, K);
  const std::vector<T> out_gpu = down(out_);
  check_close(loaded(out_gpu), loaded(out), out_tol<T>, "identity shortcut");

  // Backward's first pass from the same forward output (the CPU's), with and without dout2.
  out_ = up(out);
  for (bool two : {false, true}) {
    INFO("dout2 " << two);
    std::vector<float> g(N * K);
    std::vector<double> sdy(K), sdyx(K);
    bn_add_relu_backward_sums(g.data(), sdy.data(), sdyx.data(), dout.data(), two ? dout2.data() : nullptr, out.data(),
                              x.data(), mean.data(), rstd.data(), N, K);
    lockstep::device::buffer<float> g_dev(N * K, stream()), sums_(2 * K, stream());
    gpu::bn_add_relu_backward_sums(g_dev.data(), sums_.data(), dout_.data(), two ? dout2_.data() : nullptr,
                                   out_.data(), x_.data(), mr_.data(), N, K);
    check_close(down(g_dev), g, 0.0, "masked gradient");
    std::vector<float> sums(sdy.begin(), sdy.end());
    sums.insert(sums.end(), sdyx.begin(), sdyx.end());
    check_close(down(sums_), sums, 1e-5, "sums");
  }
}

TEMPLATE_TEST_CASE("GPU max pooling, average pooling and the NHWC input equal the CPU's bit for bit", "[resnet][cuda]",
                   float, bf16_t) {
  using T = TestType;
  for (int H : {9, 8}) {
    INFO("side " << H);
    const int B = 2, W = H, C = 5, O = pool3_out(H);
    const auto x = stored<T>(randn(static_cast<std::size_t>(B) * H * W * C, 71));
    const auto dy = randn(static_cast<std::size_t>(B) * O * O * C, 72);
    std::vector<T> out(dy.size());
    std::vector<std::uint8_t> which(dy.size());
    std::vector<float> dx(x.size());
    maxpool3x3_forward(out.data(), which.data(), x.data(), B, H, W, C);
    maxpool3x3_backward(dx.data(), dy.data(), which.data(), B, H, W, C);
    auto x_ = up(x);
    auto dy_ = up(dy);
    lockstep::device::buffer<T> out_(out.size(), stream());
    lockstep::device::buffer<std::uint8_t> which_(which.size(), stream());
    lockstep::device::buffer<float> dx_(dx.size(), stream());
    gpu::maxpool3x3_forward(out_.data(), which_.data(), x_.data(), B, H, W, C);
    gpu::maxpool3x3_backward(dx_.data(), dy_.data(), which_.data(), B, H, W, C);
    CHECK(down(out_) == out);
    CHECK(down(which_) == which);
    CHECK(down(dx_) == dx);
  }
  {
    const int B = 2, HW = 9, C = 7;
    const auto x = stored<T>(randn(static_cast<std::size_t>(B) * HW * C, 73));
    const auto dy = randn(static_cast<std::size_t>(B) * C, 74);
    std::vector<T> out(dy.size());
    std::vector<float> dx(x.size());
    global_avgpool_forward(out.data(), x.data(), B, HW, C);
    global_avgpool_backward(dx.data(), dy.data(), B, HW, C);
    auto x_ = up(x);
    auto dy_ = up(dy);
    lockstep::device::buffer<T> out_(out.size(), stream());
    lockstep::device::buffer<float> dx_(dx.size(), stream());
    gpu::global_avgpool_forward(out_.data(), x_.data(), B, HW, C);
    gpu::global_avgpool_backward(dx_.data(), dy_.data(), B, HW, C);
    CHECK(down(out_) == out);
    CHECK(down(dx_) == dx);
  }
  {
    const int B = 2, C = 3, H = 5, W = 4;
    const auto x = randn(static_cast<std::size_t>(B) * C * H * W, 75);
    std::vector<T> out(x.size());
    nchw_to_nhwc(out.data(), x.data(), B, C, H, W);
    auto x_ = up(x);
    lockstep::device::buffer<T> out_(out.size(), stream());
    gpu::nchw_to_nhwc(out_.data(), x_.data(), B, C, H, W);
    CHECK(down(out_) == out);
  }
}

TEST_CASE("GPU softmax cross-entropy with label smoothing matches the CPU's", "[resnet][cuda]") {
  const int B = 4, NC = 10;
  const auto z = randn(static_cast<std::size_t>(B) * NC, 81, 2.0f);
  const std::vector<int> y{0, 3, 9, 3};
  std::vector<float> p(z.size()), dz(z.size());
  int hits = 0, ghits = 0;
  const float loss = sample::softmax_xent_forward(p.data(), &hits, z.data(), y.data(), B, NC, 0.1f);
  sample::softmax_xent_backward(dz.data(), p.data(), y.data(), B, NC, 0.1f);
  auto z_ = up(z);
  auto y_ = up(y);
  lockstep::device::buffer<float> p_(z.size(), stream()), dz_(z.size(), stream());
  lockstep::device::buffer<double> scratch(2 * B, stream());
  const float gloss =
      gpu::softmax_xent_forward(p_.data(), &ghits, z_.data(), y_.data(), y.data(), B, NC, 0.1f, scratch.data());
  gpu::softmax_xent_backward(dz_.data(), p_.data(), y_.data(), B, NC, 0.1f);
  CHECK(gloss == Approx(loss).epsilon(1e-6));
  CHECK(ghits == hits);
  check_close(down(dz_), dz, 1e-6, "logit gradient");
}

namespace {

// One bottleneck of a small model (32x32 input: block 3, the first of stage 2, takes 8x8x256 to
// 4x4x512 with the stride-2 projection; block 1 is an identity block of 8x8x256), batch 2: its output for input x, and the
// gradients of loss = sum(out * r) with respect to x and the model's parameters.
template <class T>
struct bottleneck_case {
  gpu::model<T> m;
  int b;
  const block_info& bi;
  std::vector<float> x, r;
  lockstep::device::buffer<float> dx;
  sample::bn_group local;

  bottleneck_case(int block)
      : m(make()), b(block), bi(m.L.blocks[block]), x(randn(in_elems(), 91)), r(randn(out_elems(bi.c3, 2), 92)),
        dx(in_elems(), stream()) {
    gpu::model_resize(m, 2);
  }
  static gpu::model<T> make() {
    config cfg;
    cfg.classes = 10;
    cfg.size = 32;
    return gpu::model_create<T>(cfg, 3);
  }
  std::size_t in_elems() const { return static_cast<std::size_t>(2) * bi.c1.H * bi.c1.W * bi.c1.C; }
  std::vector<float> forward() {
    auto x_ = up(stored<T>(x));
    gpu::bottleneck_forward(m.blocks[b], x_.data(), bi, m, local, true);
    return loaded(down(m.blocks[b].out));
  }
  double loss() { return dot(forward(), r); }
  // Forward, then the gradients into dx and m.grads.
  void backward() {
    auto x_ = up(stored<T>(x));
    gpu::bottleneck_forward(m.blocks[b], x_.data(), bi, m, local, true);
    auto r_ = up(r);
    gpu::bottleneck_backward(dx.data(), r_.data(), m.blocks[b], x_.data(), bi, m, local);
  }
};

}  // namespace

TEST_CASE("one GPU bottleneck, forward and backward, against finite differences and bf16", "[resnet][cuda]") {
  for (int block : {3, 1}) {
    INFO("block " << block);
    bottleneck_case<float> f(block);
    // The blocks this test means: the stride-2 projection and an identity block.
    REQUIRE(f.bi.has_down == (block == 3));
    REQUIRE(f.bi.c2.S == (block == 3 ? 2 : 1));
    f.backward();
    const std::vector<float> dx = down(f.dx), grads = down(f.m.grads);
    // Deterministic: a second pass gives the same gradients bit for bit.
    f.backward();
    CHECK(down(f.dx) == dx);
    CHECK(down(f.m.grads) == grads);
    check_gradient(f.x, dx, [&] { return f.loss(); }, 16, 1e-2f, 93, 3e-2);
    // Parameters: conv1's weights and the scales of bn1 and bn3, set on the host for each evaluation.
    std::vector<float> params = down(f.m.params);
    for (std::size_t off : {f.bi.c1.w, f.bi.c1.gamma, f.bi.c3.gamma}) {
      INFO("parameter offset " << off);
      const std::size_t n = off == f.bi.c1.w ? static_cast<std::size_t>(f.bi.c1.K) * f.bi.c1.C : f.bi.c1.K;
      std::vector<float> p(params.begin() + static_cast<std::ptrdiff_t>(off),
                           params.begin() + static_cast<std::ptrdiff_t>(off + std::min(n, std::size_t(64))));
      std::vector<float> g(grads.begin() + static_cast<std::ptrdiff_t>(off),
                           grads.begin() + static_cast<std::ptrdiff_t>(off + p.size()));
      check_gradient(p, g,
                     [&] {
                       std::vector<float> all = params;
                       std::copy(p.begin(), p.end(), all.begin() + static_cast<std::ptrdiff_t>(off));
                       gpu::model_set_params(f.m, all);
                       return f.loss();
                     },
                     12, 1e-2f, 94, 3e-2);
      gpu::model_set_params(f.m, params);
    }
    // bf16 follows fp32: the same model and input, convolutions in bf16.
    bottleneck_case<bf16_t> h(block);
    h.x = f.x;
    check_l2(h.forward(), f.forward(), 5e-2, "bf16 output");
    h.backward();
    f.backward();
    check_l2(down(h.dx), down(f.dx), 1.5e-1, "bf16 input gradient");
    check_l2(down(h.m.grads.data() + h.bi.c1.w, static_cast<std::size_t>(h.bi.c1.K) * h.bi.c1.C),
             down(f.m.grads.data() + f.bi.c1.w, static_cast<std::size_t>(f.bi.c1.K) * f.bi.c1.C), 1.5e-1,
             "bf16 conv1 weight gradient");
  }
}
