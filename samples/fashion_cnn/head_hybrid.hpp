// samples/fashion_cnn/head_hybrid.hpp: the --fc head split over the replicas (Krizhevsky's hybrid
// parallelism): fc1 column-split and fc2 row-split over lockstep::parallel, the classifier
// replicated. Activations and their gradients travel through --activation-codec; the scheme
// (--parallel hybrid-a|b|c) decides their rounds.
//
//   features (B_k, F) -> fc1: column_linear, rank k's columns  -> (B, n_k) every rank's rows, ReLU
//                     -> fc2: row_linear, rank k's input rows  -> (B_k, H2) this rank's rows, + b2, ReLU
//                     -> the classifier (replicated)           -> (B_k, NC)
// Shape legend: B_k this replica's images, B all replicas' images, F features, H1, H2 hidden
// widths, n_k = this rank's share of H1 (lockstep::chunk_range(H1, R, k)), NC classes.
// Rank k's slices (w1: (F, n_k), b1: (n_k), w2: (n_k, H2)) and their gradients are the caller's
// (replica_hybrid.hpp, replica_hybrid_cuda.cuh); fc2.b and the classifier are the model's,
// data-parallel.
//
// The orchestration is one for both backends; what runs the element work is the Backend, a struct
// of static members (cpu_backend in model.hpp, gpu::backend in model_cuda.cuh):
//   model_type                     the backend's model (its h2, d_h2, d_features, logits, fc_w ... )
//   buffer, resize(buffer&, n)     a workspace of floats in the model's memory; returns n of them
//   sgemm(gemm_args)               the layers' matmul (oneDNN; cuBLAS on the model's stream)
//   bias_relu_forward / _backward, linear_forward / _backward, copy(dst, src, n)
//   compute_stream()               stream-ordered groups only: the stream the model computes on,
//                                  which the layers' products join (parallel/lanes.hpp)
// Every pointer handed in is the backend's memory (host, or device on a GPU).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>

#include <lockstep/codec.hpp>
#include <lockstep/parallel.hpp>

namespace fashion {

template <class Backend>
struct hybrid_head_base {
  using model_type = typename Backend::model_type;
  virtual ~hybrid_head_base() = default;
  // features (B_k, F) -> m.h2 and m.logits (B_k rows).
  virtual void forward(model_type& m, const float* features, const float* w1, const float* b1, const float* w2) = 0;
  // dlogits (B_k, NC) -> m.d_features (B_k, F); writes the classifier's and fc2.b's gradients into
  // m.grads and calls head_ready() once they are final (their all-reduce may start; on a GPU: once
  // they are enqueued on the compute stream), then the slices' gradients dw1, db1, dw2 (sums over
  // every rank's rows).
  virtual void backward(model_type& m, const float* dlogits, const float* w1, const float* w2, float* dw1, float* db1,
                        float* dw2, const std::function<void()>& head_ready) = 0;
};

template <class Backend, class Scheme, class Act, class Group>
class hybrid_head final : public hybrid_head_base<Backend> {
  using Tr = typename Group::transport_type;
  using model_type = typename Backend::model_type;

 public:
  hybrid_head(Group& g, std::size_t F, std::size_t H1, std::size_t H2, Act act)
      : fc1_(g, F, H1, act), fc2_(g, H1, H2, act), F_(F), H2_(H2) {
    if constexpr (Group::ordered) {
      fc1_.set_compute_stream(Backend::compute_stream());
      fc2_.set_compute_stream(Backend::compute_stream());
    }
  }

  void forward(model_type& m, const float* features, const float* w1, const float* b1, const float* w2) override {
    const auto B = static_cast<std::size_t>(m.B), n = fc1_.cols();
    y1_ = fc1_.forward(std::span<const float>(features, B * F_), std::span<const float>(w1, F_ * n), Backend::sgemm);
    Backend::bias_relu_forward(y1_.data(), b1, fc1_.rows().total(), n);
    const auto y2 = fc2_.forward(y1_, B, std::span<const float>(w2, n * H2_), Backend::sgemm);
    Backend::copy(m.h2.data(), y2.data(), B * H2_);
    Backend::bias_relu_forward(m.h2.data(), m.fc2_b, B, H2_);
    Backend::linear_forward(m.logits.data(), m.h2.data(), m.fc_w, m.fc_b, m.B, static_cast<int>(H2_), m.cfg.classes);
  }

  void backward(model_type& m, const float* dlogits, const float* w1, const float* w2, float* dw1, float* db1, float* dw2,
                const std::function<void()>& head_ready) override {
    const auto B = static_cast<std::size_t>(m.B), n = fc1_.cols(), all = fc1_.rows().total();
    Backend::linear_backward(m.d_h2.data(), m.d_fc_w, m.d_fc_b, dlogits, m.h2.data(), m.fc_w, m.B, static_cast<int>(H2_),
                             m.cfg.classes);
    Backend::bias_relu_backward(m.d_h2.data(), m.d_fc2_b, m.h2.data(), B, H2_);
    head_ready();
    const std::span<float> dh1(Backend::resize(dh1_, all * n), all * n);
    fc2_.backward(y1_, std::span<const float>(m.d_h2.data(), B * H2_), std::span<const float>(w2, n * H2_),
                  std::span<float>(dw2, n * H2_), dh1, Backend::sgemm);
    Backend::bias_relu_backward(dh1.data(), db1, y1_.data(), all, n);
    fc1_.backward(std::span<const float>(dh1), std::span<const float>(w1, F_ * n), std::span<float>(dw1, F_ * n),
                  std::span<float>(m.d_features.data(), B * F_), Backend::sgemm);
  }

 private:
  lockstep::parallel::column_linear<Scheme, Tr, Act> fc1_;
  lockstep::parallel::row_linear<Scheme, Tr, Act> fc2_;
  std::size_t F_, H2_;
  std::span<float> y1_;              // (B, n_k) after ReLU: fc1's output buffer, valid until its next forward
  typename Backend::buffer dh1_;     // (B, n_k)
};

// The head named by --parallel hybrid-a|b|c and --activation-codec, on Backend.
template <class Backend, class Group>
std::unique_ptr<hybrid_head_base<Backend>> make_hybrid_head(Group& g, const std::string& parallel, const std::string& act,
                                                            std::size_t block, std::size_t F, std::size_t H1, std::size_t H2) {
  namespace lp = lockstep::parallel;
  namespace lc = lockstep::codec;
  auto with_scheme = [&](auto scheme) -> std::unique_ptr<hybrid_head_base<Backend>> {
    using S = decltype(scheme);
    if (act == "fp32") return std::make_unique<hybrid_head<Backend, S, lc::fp32, Group>>(g, F, H1, H2, lc::fp32{});
    if (act == "bf16") return std::make_unique<hybrid_head<Backend, S, lc::bf16, Group>>(g, F, H1, H2, lc::bf16{});
    if (act == "int8") return std::make_unique<hybrid_head<Backend, S, lc::int8, Group>>(g, F, H1, H2, lc::int8{block});
    if (act == "dyntree8")
      return std::make_unique<hybrid_head<Backend, S, lc::dyntree8, Group>>(g, F, H1, H2, lc::dyntree8{block});
    throw std::invalid_argument("--activation-codec must be fp32, bf16, int8 or dyntree8");
  };
  if (parallel == "hybrid-a") return with_scheme(lp::gather_all{});
  if (parallel == "hybrid-b") return with_scheme(lp::by_rank{});
  if (parallel == "hybrid-c") return with_scheme(lp::by_slice{});
  throw std::invalid_argument("--parallel must be data, hybrid-a, hybrid-b or hybrid-c");
}

}  // namespace fashion
