// Gradients of every layer of the sample CNN's cuDNN backend (samples/fashion_cnn/layers_cuda.cuh)
// and of the whole GPU model (model_cuda.cuh) against central finite differences, with the same
// checks as the oneDNN backend's tests (fashion_gradcheck.hpp). Inputs live on the host and are
// copied to the device for every evaluation, so the checks read exactly as on the CPU. Also: the
// GPU model starts from the same parameters as the CPU one for a seed, and two identical steps
// give bit-identical gradients (the deterministic algorithms the resume guarantee needs). And the
// hybrid head's products: lockstep::parallel's column- and row-split layers over inproc_device with
// gpu::sgemm (cuBLAS) on each rank's model stream, against the host tests' fp64 reference; and the
// sample's hybrid head (head_hybrid.hpp on gpu::backend) against the whole GPU head, and the
// slices' LARS update (split_update_cuda.cuh) against the whole tensors' host update.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/state.hpp>
#include <lockstep/optim/update.hpp>
#include <lockstep/transport/inproc_device.hpp>

#include "../../samples/fashion_cnn/head_hybrid.hpp"
#include "../../samples/fashion_cnn/model_cuda.cuh"
#include "../../samples/fashion_cnn/split_update_cuda.cuh"
#include "../fashion_gradcheck.hpp"
#include "../parallel_reference.hpp"
#include "common.hpp"

using namespace fashion;
using namespace fashion_test;
using lockstep::test::to_device;
using lockstep::test::to_host;

namespace {

cudaStream_t stream() { return gpu::cuda_ctx().stream; }

// Host vector -> fresh device copy; device -> host after the stream's work.
template <class T>
lockstep::device::buffer<T> up(const std::vector<T>& v) {
  return to_device(v, stream());
}
std::vector<float> down(const float* d, std::size_t n) { return to_host(d, n, stream()); }

}  // namespace

TEST_CASE("cuDNN conv3x3 gradients match finite differences", "[fashion][cuda]") {
  const int B = 2, C = 3, H = 5, W = 6, K = 4;
  auto x = randn(static_cast<std::size_t>(B) * C * H * W, 1);
  auto w = randn(static_cast<std::size_t>(K) * C * 9, 2, 0.3f);
  auto r = randn(static_cast<std::size_t>(B) * K * H * W, 3);
  lockstep::device::buffer<float> out(r.size(), stream()), dx(x.size(), stream()), dw(w.size(), stream());
  auto loss = [&] {
    auto dx_ = up(x), dw_ = up(w);
    gpu::conv_forward(out.data(), dx_.data(), dw_.data(), B, C, H, W, K);
    return dot(down(out.data(), r.size()), r);
  };
  loss();
  auto x_ = up(x), w_ = up(w), r_ = up(r);
  gpu::conv_backward(dx.data(), dw.data(), r_.data(), x_.data(), w_.data(), B, C, H, W, K);
  check_gradient(x, down(dx.data(), x.size()), loss, 40, 1e-2f, 4);
  check_gradient(w, down(dw.data(), w.size()), loss, 40, 1e-2f, 5);
}

TEST_CASE("GPU maxpool2x2 gradients match finite differences, odd sizes included", "[fashion][cuda]") {
  using m = maxpool_case;
  const std::size_t in = static_cast<std::size_t>(m::B) * m::C * m::H * m::W;
  lockstep::device::buffer<float> out(static_cast<std::size_t>(m::B) * m::C * pooled(m::H) * pooled(m::W), stream()),
      dx(in, stream());
  lockstep::device::buffer<std::uint8_t> ws(maxpool_workspace_bytes(m::B, m::C, m::H, m::W), stream());
  check_maxpool([&](const std::vector<float>& x) {
                  auto x_ = up(x);
                  gpu::maxpool_forward(out.data(), ws.data(), x_.data(), m::B, m::C, m::H, m::W);
                  return down(out.data(), out.size());
                },
                [&](const std::vector<float>& r) {
                  auto r_ = up(r);
                  gpu::maxpool_backward(dx.data(), r_.data(), ws.data(), m::B, m::C, m::H, m::W);
                  return down(dx.data(), in);
                });
}

TEST_CASE("cuBLAS linear gradients match finite differences", "[fashion][cuda]") {
  using m = linear_case;
  lockstep::device::buffer<float> out(static_cast<std::size_t>(m::B) * m::NC, stream());
  check_linear(
      [&](const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b) {
        auto x_ = up(x), w_ = up(w), b_ = up(b);
        gpu::linear_forward(out.data(), x_.data(), w_.data(), b_.data(), m::B, m::F, m::NC);
        return down(out.data(), out.size());
      },
      [&](const std::vector<float>& r, const std::vector<float>& x, const std::vector<float>& w) {
        auto x_ = up(x), w_ = up(w), r_ = up(r);
        lockstep::device::buffer<float> dx(x.size(), stream()), dw(w.size(), stream()), db(m::NC, stream());
        gpu::linear_backward(dx.data(), dw.data(), db.data(), r_.data(), x_.data(), w_.data(), m::B, m::F, m::NC);
        return linear_grads{down(dx.data(), x.size()), down(dw.data(), w.size()), down(db.data(), m::NC)};
      });
}

TEST_CASE("GPU batchnorm+relu gradients match finite differences (local group)", "[fashion][cuda]") {
  const int B = 4, K = 3, HW = 10;
  auto x = randn(static_cast<std::size_t>(B) * K * HW, 16, 2.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += static_cast<float>(i % K);
  auto gamma = randn(K, 17, 0.5f), beta = randn(K, 18, 0.5f);
  for (auto& g : gamma) g += 1.0f;
  auto r = randn(x.size(), 19);
  std::vector<float> rm(K, 0.0f), rv(K, 1.0f);
  float count = 0;
  const bn_group local;
  lockstep::device::buffer<float> out(x.size(), stream()), dx(x.size(), stream()), dg(K, stream()), db(K, stream()),
      mean_rstd(2 * K, stream()), scratch(2 * K, stream());
  auto loss = [&] {
    auto x_ = up(x), g_ = up(gamma), b_ = up(beta);
    gpu::batchnorm_relu_forward(out.data(), mean_rstd.data(), &count, rm.data(), rv.data(), x_.data(), g_.data(),
                                b_.data(), B, K, HW, local, true, scratch.data());
    return dot(down(out.data(), x.size()), r);
  };
  loss();
  auto x_ = up(x), g_ = up(gamma), b_ = up(beta), r_ = up(r);
  gpu::batchnorm_relu_backward(dx.data(), dg.data(), db.data(), r_.data(), x_.data(), mean_rstd.data(), count,
                               g_.data(), b_.data(), B, K, HW, local, scratch.data());
  check_gradient(x, down(dx.data(), x.size()), loss, 60, 1e-2f, 20);
  check_gradient(gamma, down(dg.data(), K), loss, K, 1e-2f, 21);
  check_gradient(beta, down(db.data(), K), loss, K, 1e-2f, 22);
}

TEST_CASE("GPU softmax cross-entropy with label smoothing: gradient and value", "[fashion][cuda]") {
  const int B = 4, NC = 10;
  auto z = randn(static_cast<std::size_t>(B) * NC, 23, 2.0f);
  std::vector<int> y{0, 3, 9, 3};
  auto y_ = up(y);
  lockstep::device::buffer<float> p(z.size(), stream()), dz(z.size(), stream());
  lockstep::device::buffer<double> scratch(2 * B, stream());
  for (float smoothing : {0.0f, 0.1f}) {
    auto loss = [&] {
      auto z_ = up(z);
      return static_cast<double>(
          gpu::softmax_xent_forward(p.data(), nullptr, z_.data(), y_.data(), y.data(), B, NC, smoothing, scratch.data()));
    };
    loss();
    gpu::softmax_xent_backward(dz.data(), p.data(), y_.data(), B, NC, smoothing);
    check_gradient(z, down(dz.data(), z.size()), loss, 30, 1e-2f, 24, 1e-2);
  }
  std::vector<float> zero(z.size(), 0.0f);
  auto zero_ = up(zero);
  CHECK(gpu::softmax_xent_forward(p.data(), nullptr, zero_.data(), y_.data(), y.data(), B, NC, 0.1f, scratch.data()) ==
        Approx(std::log(10.0)).epsilon(1e-6));
}

TEST_CASE("the whole GPU model's parameter gradients match finite differences", "[fashion][cuda]") {
  config cfg;
  cfg.channels = {4, 6, 8};
  cfg.label_smoothing = 0.1f;
  gpu::model m = gpu::model_create(cfg, 7);
  const int B = 3;
  auto images = randn(static_cast<std::size_t>(B) * 28 * 28, 25);
  std::vector<int> labels{1, 4, 7};
  const bn_group local;
  std::vector<float> params = down(m.params.data(), m.L.total);
  // The same seed gives the CPU backend's parameters (initial_parameters is shared).
  std::vector<float> host_params, host_running;
  initial_parameters(cfg, m.L, 7, host_params, host_running);
  CHECK(params == host_params);
  auto loss = [&] {
    gpu::model_set_params(m, params);
    return static_cast<double>(gpu::model_forward(m, images.data(), labels.data(), B, local, true));
  };
  loss();
  std::vector<int> order;
  gpu::model_backward(m, local, [&](int b) { order.push_back(b); });
  CHECK(order == std::vector<int>{3, 2, 1, 0});
  const std::vector<float> grads = down(m.grads.data(), m.L.total);
  // Deterministic: a second identical step gives the same gradients bit for bit.
  loss();
  gpu::model_backward(m, local);
  const std::vector<float> again = down(m.grads.data(), m.L.total);
  CHECK(std::memcmp(grads.data(), again.data(), grads.size() * sizeof(float)) == 0);
  for (const auto& t : m.L.tensors) {
    INFO("tensor " << t.name);
    std::vector<float> p(params.begin() + static_cast<std::ptrdiff_t>(t.offset),
                         params.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    std::vector<float> g(grads.begin() + static_cast<std::ptrdiff_t>(t.offset),
                         grads.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    const std::vector<float> saved = params;
    auto f = [&] {
      std::copy(p.begin(), p.end(), params.begin() + static_cast<std::ptrdiff_t>(t.offset));
      return loss();
    };
    check_gradient(p, g, f, 8, 1e-3f, 26, 3e-2);
    params = saved;
  }
}

namespace {

// tests/test_parallel.cpp's stack (parallel_reference.hpp) on the GPU: ranks as threads on this
// GPU (inproc_device), each layer's collectives on the group's stream and its products cuBLAS on the
// rank's model stream (cuda_ctx()), ordered by events; inputs uploaded, results downloaded once
// the whole stack is enqueued. The same bounds as on the CPU.
template <class S, class C>
void parallel_stack(const lockstep_test::parallel_reference::problem& p) {
  using namespace lockstep_test::parallel_reference;
  using Tr = lockstep::transport::inproc_device;
  std::vector<rank_out> outs(p.rows.size());
  lockstep::group_options opt;
  opt.timeout = std::chrono::seconds(60);
  lockstep::run_inproc_device(static_cast<int>(p.rows.size()), [&](lockstep::group<Tr>& g) {
    const auto k = static_cast<std::size_t>(g.rank());
    lockstep::parallel::column_linear<S, Tr, C> fc1(g, p.in, p.hid);
    lockstep::parallel::row_linear<S, Tr, C> fc2(g, p.hid, p.out);
    fc1.set_compute_stream(stream());
    fc2.set_compute_stream(stream());
    const std::size_t nc = fc1.cols(), nr = p.rows[k];
    const rank_in in = rank_inputs(p, k, fc1.first_col(), nc);
    auto x = up(in.x), w1 = up(in.w1), w2 = up(in.w2), dy2 = up(in.dy2);
    auto dspan = [](auto& b) { return std::span<float>(b.data(), b.size()); };
    const auto y1 = fc1.forward(dspan(x), dspan(w1), gpu::sgemm);
    const auto y2 = fc2.forward(y1, nr, dspan(w2), gpu::sgemm);
    const std::size_t B = fc1.rows().total();
    lockstep::device::buffer<float> dh(B * nc, stream()), dw2(nc * p.out, stream()), dw1(p.in * nc, stream()),
        dx(nr * p.in, stream());
    fc2.backward(y1, dspan(dy2), dspan(w2), dspan(dw2), dspan(dh), gpu::sgemm);
    fc1.backward(dspan(dh), dspan(w1), dspan(dw1), dspan(dx), gpu::sgemm);
    rank_out& o = outs[k];
    o.first_col = fc1.first_col(), o.cols = nc;
    o.x_used = down(fc1.inputs().data(), fc1.inputs().size());
    o.y1 = down(y1.data(), y1.size());
    o.y2 = down(y2.data(), y2.size());
    o.dy_used = down(fc2.output_gradients().data(), fc2.output_gradients().size());
    o.dh = down(dh.data(), dh.size());
    o.dw2 = down(dw2.data(), dw2.size());
    o.dw1 = down(dw1.data(), dw1.size());
    o.dx = down(dx.data(), dx.size());
  }, opt);
  check_stack<C>(p, outs);
}

template <class S, class C>
void parallel_sizes() {
  for (std::size_t K = 1; K <= 4; ++K)
    for (const auto& rows : lockstep_test::parallel_reference::row_patterns(K)) {
      INFO("K = " << K << ", scheme " << S::name() << ", rows " << lockstep::detail::chunk_layout::from_counts(rows).str());
      parallel_stack<S, C>({13, 10, 7, rows});
    }
}

}  // namespace

TEMPLATE_TEST_CASE("hybrid head on cuBLAS: column- then row-split FC over inproc_device, every scheme, 1..4 ranks, "
                   "against one rank", "[fashion][cuda][parallel]", lockstep::codec::fp32, lockstep::codec::bf16,
                   lockstep::codec::int8, lockstep::codec::dyntree8) {
  parallel_sizes<lockstep::parallel::gather_all, TestType>();
  parallel_sizes<lockstep::parallel::by_rank, TestType>();
  parallel_sizes<lockstep::parallel::by_slice, TestType>();
  parallel_stack<lockstep::parallel::by_slice, lockstep::codec::int8>({5, 3, 2, {2, 0, 1, 4}});  // empty products
  parallel_stack<lockstep::parallel::by_rank, lockstep::codec::bf16>({300, 97, 11, {40, 7, 33}});
}

TEST_CASE("GPU fc_relu (the --fc head's layer) against the CPU head's arithmetic on the host", "[fashion][cuda]") {
  // head_cpu.hpp's fc_relu_forward / _backward, written out in fp64 with the shared element math
  // (bias_relu, relu_back): the GPU may differ in summation order only.
  const std::size_t B = 5, in = 9, out = 7;
  const auto x = randn(B * in, 50), w = randn(in * out, 51, 0.4f), b = randn(out, 52, 0.3f), dy = randn(B * out, 53);
  std::vector<float> y(B * out), d(B * out), dx(B * in, 0.0f), dw(in * out, 0.0f), db(out, 0.0f);
  for (std::size_t i = 0; i < B; ++i)
    for (std::size_t j = 0; j < out; ++j) {
      double v = 0;
      for (std::size_t k = 0; k < in; ++k) v += double(x[i * in + k]) * w[k * out + j];
      y[i * out + j] = bias_relu(static_cast<float>(v), b[j]);
      d[i * out + j] = relu_back(dy[i * out + j], y[i * out + j]);
      db[j] += d[i * out + j];
    }
  for (std::size_t i = 0; i < B; ++i)
    for (std::size_t j = 0; j < out; ++j)
      for (std::size_t k = 0; k < in; ++k) {
        dw[k * out + j] += x[i * in + k] * d[i * out + j];
        dx[i * in + k] += d[i * out + j] * w[k * out + j];
      }
  auto x_ = up(x), w_ = up(w), b_ = up(b), dy_ = up(dy);
  lockstep::device::buffer<float> y_(B * out, stream()), dx_(B * in, stream()), dw_(in * out, stream()), db_(out, stream());
  gpu::fc_relu_forward(y_.data(), x_.data(), w_.data(), b_.data(), B, in, out);
  gpu::fc_relu_backward(dx_.data(), dw_.data(), db_.data(), dy_.data(), x_.data(), y_.data(), w_.data(), B, in, out);
  auto near = [](const std::vector<float>& got, const std::vector<float>& want) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < want.size(); ++i) bad += !(std::fabs(got[i] - want[i]) <= 1e-5f * (1.0f + std::fabs(want[i])));
    return bad;
  };
  CHECK(near(down(y_.data(), y.size()), y) == 0);
  CHECK(near(down(dy_.data(), d.size()), d) == 0);  // the pre-ReLU gradient, in place
  CHECK(near(down(dx_.data(), dx.size()), dx) == 0);
  CHECK(near(down(dw_.data(), dw.size()), dw) == 0);
  CHECK(near(down(db_.data(), db.size()), db) == 0);
}

TEST_CASE("the whole GPU model with the --fc head: gradients match finite differences, bucket order as on the CPU",
          "[fashion][cuda]") {
  config cfg;
  cfg.channels = {4, 6, 8};
  cfg.fc = {6, 5};
  cfg.label_smoothing = 0.1f;
  gpu::model m = gpu::model_create(cfg, 11);
  const int B = 3;
  auto images = randn(static_cast<std::size_t>(B) * 28 * 28, 27);
  std::vector<int> labels{2, 5, 8};
  const bn_group local;
  std::vector<float> params = down(m.params.data(), m.L.total);
  std::vector<float> host_params, host_running;
  initial_parameters(cfg, m.L, 11, host_params, host_running);
  CHECK(params == host_params);
  auto loss = [&] {
    gpu::model_set_params(m, params);
    return static_cast<double>(gpu::model_forward(m, images.data(), labels.data(), B, local, true));
  };
  loss();
  std::vector<int> order;
  gpu::model_backward(m, local, [&](int b) { order.push_back(b); });
  CHECK(order == std::vector<int>{3, 5, 4, 2, 1, 0});  // head bucket, fc2.w, fc1, blocks (model.hpp)
  const std::vector<float> grads = down(m.grads.data(), m.L.total);
  for (const auto& t : m.L.tensors) {
    INFO("tensor " << t.name);
    std::vector<float> p(params.begin() + static_cast<std::ptrdiff_t>(t.offset),
                         params.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    std::vector<float> g(grads.begin() + static_cast<std::ptrdiff_t>(t.offset),
                         grads.begin() + static_cast<std::ptrdiff_t>(t.offset + t.size));
    const std::vector<float> saved = params;
    auto f = [&] {
      std::copy(p.begin(), p.end(), params.begin() + static_cast<std::ptrdiff_t>(t.offset));
      return loss();
    };
    check_gradient(p, g, f, 8, 1e-3f, 28, 3e-2);
    params = saved;
  }
}

namespace {

// The hybrid head (head_hybrid.hpp with gpu::backend) over R ranks of inproc_device against the
// whole head on one GPU model: the same features and logit gradients, rank k's rows of each. With
// fp32 activations every output equals the whole head's up to summation order: logits and the
// features' gradient (rank k's rows), fc2.b's and the classifier's gradients (rank k's rows' share:
// compared summed over ranks), and the slices' gradients (rank k's columns of the whole).
void hybrid_head_against_whole(const char* parallel, const std::vector<std::size_t>& rows) {
  config cfg;
  cfg.channels = {2, 2, 2};  // F = 32
  cfg.fc = {7, 5};
  const auto R = rows.size();
  std::size_t all = 0;
  for (auto r : rows) all += r;
  gpu::model whole = gpu::model_create(cfg, 3);
  const layout& L = whole.L;
  const std::size_t F = L.features, H1 = 7, H2 = 5, NC = cfg.classes;
  const auto x = randn(all * F, 31), dlogits = randn(all * NC, 32, 0.1f);
  const std::vector<float> params = down(whole.params.data(), L.total);
  // The whole head on every row.
  gpu::model_resize(whole, static_cast<int>(all));
  {
    auto x_ = up(x), dl_ = up(dlogits);
    gpu::fc_relu_forward(whole.h1.data(), x_.data(), whole.fc1_w, whole.fc1_b, all, F, H1);
    gpu::fc_relu_forward(whole.h2.data(), whole.h1.data(), whole.fc2_w, whole.fc2_b, all, H1, H2);
    gpu::linear_forward(whole.logits.data(), whole.h2.data(), whole.fc_w, whole.fc_b, static_cast<int>(all), int(H2), int(NC));
    gpu::linear_backward(whole.d_h2.data(), whole.d_fc_w, whole.d_fc_b, dl_.data(), whole.h2.data(), whole.fc_w,
                         static_cast<int>(all), int(H2), int(NC));
    gpu::bias_relu_backward(whole.d_h2.data(), whole.d_fc2_b, whole.h2.data(), all, H2);
    gpu::sgemm({true, false, H1, H2, all, whole.h1.data(), H1, whole.d_h2.data(), H2, 0.0f, whole.d_fc2_w, H2});
    gpu::sgemm({false, true, all, H1, H2, whole.d_h2.data(), H2, whole.fc2_w, H2, 0.0f, whole.d_h1.data(), H1});
    gpu::fc_relu_backward(whole.d_features.data(), whole.d_fc1_w, whole.d_fc1_b, whole.d_h1.data(), x_.data(),
                          whole.h1.data(), whole.fc1_w, all, F, H1);
  }
  const auto logits = down(whole.logits.data(), all * NC), dfeat = down(whole.d_features.data(), all * F);
  const auto grads = down(whole.grads.data(), L.total);
  struct rank_out {
    std::vector<float> logits, dfeat, grads, dw1, db1, dw2;
    std::size_t c0 = 0, n = 0;
  };
  std::vector<rank_out> outs(R);
  lockstep::group_options opt;
  opt.timeout = std::chrono::seconds(60);
  lockstep::run_inproc_device(static_cast<int>(R), [&](lockstep::group<lockstep::transport::inproc_device>& g) {
    const auto k = static_cast<std::size_t>(g.rank());
    std::size_t r0 = 0;
    for (std::size_t j = 0; j < k; ++j) r0 += rows[j];
    const auto [c0, c1] = lockstep::chunk_range(H1, R, k);
    const std::size_t n = c1 - c0, B = rows[k];
    gpu::model m = gpu::model_create(cfg, 3);
    gpu::model_resize(m, static_cast<int>(B));
    std::vector<float> w1(F * n), b1(n), w2(n * H2);  // rank k's slices, as replica_hybrid_cuda.cuh extracts them
    const float* W1 = params.data() + tensor_named(L, "fc1.w").offset;
    for (std::size_t f = 0; f < F; ++f)
      for (std::size_t j = 0; j < n; ++j) w1[f * n + j] = W1[f * H1 + c0 + j];
    std::copy_n(params.data() + tensor_named(L, "fc1.b").offset + c0, n, b1.begin());
    std::copy_n(params.data() + tensor_named(L, "fc2.w").offset + c0 * H2, n * H2, w2.begin());
    auto head = make_hybrid_head<gpu::backend>(g, parallel, "fp32", 256, F, H1, H2);
    auto x_ = up(std::vector<float>(x.begin() + static_cast<std::ptrdiff_t>(r0 * F),
                                    x.begin() + static_cast<std::ptrdiff_t>((r0 + B) * F)));
    auto dl_ = up(std::vector<float>(dlogits.begin() + static_cast<std::ptrdiff_t>(r0 * NC),
                                     dlogits.begin() + static_cast<std::ptrdiff_t>((r0 + B) * NC)));
    auto w1_ = up(w1), b1_ = up(b1), w2_ = up(w2);
    lockstep::device::buffer<float> dw1(F * n, stream()), db1(n, stream()), dw2(n * H2, stream());
    head->forward(m, x_.data(), w1_.data(), b1_.data(), w2_.data());
    int ready = 0;
    head->backward(m, dl_.data(), w1_.data(), w2_.data(), dw1.data(), db1.data(), dw2.data(), [&] { ++ready; });
    rank_out& o = outs[k];
    o.c0 = c0, o.n = n;
    o.logits = down(m.logits.data(), B * NC);
    o.dfeat = down(m.d_features.data(), B * F);
    o.grads = down(m.grads.data(), L.total);
    o.dw1 = down(dw1.data(), dw1.size()), o.db1 = down(db1.data(), n), o.dw2 = down(dw2.data(), dw2.size());
    CHECK(ready == 1);
  }, opt);
  auto near = [](float a, float b) { return std::fabs(a - b) <= 1e-4f * (1.0f + std::fabs(b)); };
  std::size_t r0 = 0, bad = 0;
  for (std::size_t k = 0; k < R; ++k) {
    const rank_out& o = outs[k];
    for (std::size_t i = 0; i < rows[k] * NC; ++i) bad += !near(o.logits[i], logits[r0 * NC + i]);
    for (std::size_t i = 0; i < rows[k] * F; ++i) bad += !near(o.dfeat[i], dfeat[r0 * F + i]);
    const float* W1 = grads.data() + tensor_named(L, "fc1.w").offset;
    for (std::size_t f = 0; f < F; ++f)
      for (std::size_t j = 0; j < o.n; ++j) bad += !near(o.dw1[f * o.n + j], W1[f * H1 + o.c0 + j]);
    for (std::size_t j = 0; j < o.n; ++j) bad += !near(o.db1[j], grads[tensor_named(L, "fc1.b").offset + o.c0 + j]);
    for (std::size_t i = 0; i < o.n * H2; ++i)
      bad += !near(o.dw2[i], grads[tensor_named(L, "fc2.w").offset + o.c0 * H2 + i]);
    r0 += rows[k];
  }
  for (const char* name : {"fc2.b", "fc.w", "fc.b"}) {  // data-parallel: each rank's rows' share, summed
    const tensor_info& t = tensor_named(L, name);
    for (std::size_t i = 0; i < t.size; ++i) {
      float s = 0.0f;
      for (const rank_out& o : outs) s += o.grads[t.offset + i];
      bad += !near(s, grads[t.offset + i]);
    }
  }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("hybrid head on the GPU backend (head_hybrid.hpp, gpu::backend) equals the whole GPU head, fp32, 1..3 ranks",
          "[fashion][cuda][parallel]") {
  for (const auto& rows : std::vector<std::vector<std::size_t>>{{4}, {3, 2}, {2, 3, 1}, {1, 3, 2}}) {
    for (const char* parallel : {"hybrid-a", "hybrid-b", "hybrid-c"}) {
      INFO(parallel << ", " << rows.size() << " ranks, rows " << rows[0] << "...");
      hybrid_head_against_whole(parallel, rows);
    }
  }
}

TEST_CASE("gpu::split_update: LARS on slices over inproc_device, 1..3 ranks, equals the whole tensors' host update",
          "[fashion][cuda][optim]") {
  // Three tensors as the hybrid replica's (w1 (F, n_k), b1 (n_k) exempt, w2 (n_k, H2)). The update is
  // per element given each tensor's coefficients, so the whole tensors are laid out here rank by
  // rank (rank k's slice of each tensor contiguous): only the norms need every rank's slices.
  const std::size_t F = 6, H1 = 7, H2 = 5;
  lockstep::optim::lars opt;
  opt.weight_decay = 1e-3f;
  for (std::size_t R = 1; R <= 3; ++R) {
    INFO(R << " ranks");
    std::vector<std::size_t> first(R), cols(R);
    for (std::size_t k = 0; k < R; ++k) {
      const auto [lo, hi] = lockstep::chunk_range(H1, R, k);
      first[k] = lo, cols[k] = hi - lo;
    }
    const std::size_t t0 = 0, t1 = F * H1, t2 = t1 + H1, total = t2 + H1 * H2;
    const lockstep::optim::param_set whole({{t0, F * H1, false}, {t1, H1, true}, {t2, H1 * H2, false}});
    const auto w0 = randn(total, 40, 0.5f), g = randn(total, 41, 0.1f);
    // The reference: two steps of the whole tensors on the host, gradients summed over R ranks (scale 1/R).
    std::vector<float> ref = w0;
    lockstep::optim::state st(whole, opt);
    for (int step = 0; step < 2; ++step)
      lockstep::optim::update(opt, whole, std::span<float>(ref), std::span<const float>(g), st,
                              {0.1f, 1.0f / static_cast<float>(R)});
    std::vector<float> got(total, 0.0f), got_v(total, 0.0f);
    lockstep::group_options gopt;
    gopt.timeout = std::chrono::seconds(60);
    lockstep::run_inproc_device(static_cast<int>(R), [&](lockstep::group<lockstep::transport::inproc_device>& grp) {
      const auto k = static_cast<std::size_t>(grp.rank());
      const std::size_t n = cols[k];
      // Where rank k's piece of each tensor lies in `whole`: offset, length.
      const std::size_t at[3] = {t0 + F * first[k], t1 + first[k], t2 + first[k] * H2}, len[3] = {F * n, n, n * H2};
      const lockstep::optim::param_set mine({{0, len[0], false}, {len[0], len[1], true}, {len[0] + len[1], len[2], false}});
      std::vector<float> w, gr;
      for (int t = 0; t < 3; ++t) {
        w.insert(w.end(), w0.begin() + static_cast<std::ptrdiff_t>(at[t]), w0.begin() + static_cast<std::ptrdiff_t>(at[t] + len[t]));
        gr.insert(gr.end(), g.begin() + static_cast<std::ptrdiff_t>(at[t]), g.begin() + static_cast<std::ptrdiff_t>(at[t] + len[t]));
      }
      auto w_ = up(w), g_ = up(gr), v_ = up(std::vector<float>(w.size(), 0.0f));
      gpu::split_update<lockstep::group<lockstep::transport::inproc_device>, lockstep::optim::lars> upd(grp, opt, mine);
      for (int step = 0; step < 2; ++step)
        upd(0.1f, 1.0f / static_cast<float>(R), w_.data(), g_.data(), v_.data(), stream()).wait();
      const auto wd = down(w_.data(), w.size()), vd = down(v_.data(), w.size());
      std::size_t from = 0;
      for (int t = 0; t < 3; ++t) {  // disjoint pieces per rank: no two threads write one element
        std::copy_n(wd.begin() + static_cast<std::ptrdiff_t>(from), len[t], got.begin() + static_cast<std::ptrdiff_t>(at[t]));
        std::copy_n(vd.begin() + static_cast<std::ptrdiff_t>(from), len[t], got_v.begin() + static_cast<std::ptrdiff_t>(at[t]));
        from += len[t];
      }
    }, gopt);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < total; ++i) bad += !(std::fabs(got[i] - ref[i]) <= 1e-6f * (1.0f + std::fabs(ref[i])));
    const std::span<const float> ref_v = st.momentum();
    for (std::size_t i = 0; i < total; ++i) bad += !(std::fabs(got_v[i] - ref_v[i]) <= 1e-6f * (1.0f + std::fabs(ref_v[i])));
    CHECK(bad == 0);
  }
}
