// lockstep/parallel/column_linear.hpp: a fully connected layer split by output columns over a
// group whose ranks hold data-parallel batches (Krizhevsky 2014, "one weird trick").
//
// Shapes (row-major): K ranks, rank k holds B_k rows of the batch, B = sum B_k; in, out features;
// rank k owns columns [c_k, c_k + n_k) of W (in x out), n_k = out/K rounded as chunk_range does.
//   forward:  x (B_k x in, this rank's rows) -> X (B x in, every rank's rows, moved by the scheme)
//             Y_k = X · W_k                        (B x n_k: this rank's columns for all rows)
//   backward: dY_k (B x n_k) -> dX = sum_j dY_j · W_jᵀ, this rank's rows (B_k x in), reduced over
//             ranks round by round;  dW_k = Xᵀ · dY_k (in x n_k), local, computed while the last
//             rounds of dX move
// No bias and no nonlinearity: the caller adds b_k to its columns and applies the activation (both
// are local to the columns). The scheme (gather_all, by_rank, by_slice) decides the rounds; the
// codec what X and dX look like on the wire (fp32, bf16, int8, dyntree8; sums stay fp32). Every
// rank holds the same X, bit for bit, including its own rows (a lossy codec's decoded image): the
// layer computes with the values that travelled, and backward uses the same ones.
//
//   parallel::column_linear<parallel::by_rank, transport::inproc, codec::int8> fc1(g, 9216, 4096);
//   auto y = fc1.forward(x, w1_k, sgemm);          // y: B x fc1.cols()
//   fc1.backward(dy, w1_k, dw1_k, dx, sgemm);
//
// On a stream-ordered group (nccl, inproc_device, inproc_deferred) the same calls enqueue and
// return: every buffer is in the group's space (device memory), `sgemm` enqueues on the layer's
// compute stream (fc1.set_compute_stream(model_stream); the group's by default), and y, dx and dw
// are complete in that stream's order (parallel/lanes.hpp).
#pragma once

#include <new>
#include <span>
#include <vector>

#include "../codec/fp32.hpp"
#include "../topology/ring.hpp"
#include "exchange.hpp"
#include "gemm.hpp"
#include "layer_base.hpp"

namespace lockstep::parallel {

template <scheme S, transport::transport Tr, codec::codec C = codec::fp32, topology::topology T = topology::ring>
class column_linear : public detail::layer_base<S, Tr, C, T> {
  using base = detail::layer_base<S, Tr, C, T>;

 public:
  column_linear(group<Tr>& g, std::size_t in, std::size_t out, C codec = {}, T topo = {})
      : base(g, layer_kind::column_split, "column_linear", in, out, out, codec, topo) {}

  std::size_t cols() const noexcept { return this->slice_size(); }
  std::size_t first_col() const noexcept { return this->slice_first(); }
  // X as every rank used it: B x in, rank-major (valid until the next forward).
  std::span<const float> inputs() const noexcept { return x_all_.span(); }

  // x: this rank's rows (B_k x in); w: this rank's columns W_k (in x cols). Returns Y_k (B x cols),
  // owned by the layer until the next forward; the caller may change it in place (bias, ReLU).
  template <matmul M>
  std::span<float> forward(std::span<const float> x, std::span<const float> w, M&& mm) {
    // The batch is the layer's only once the forward is through: a backward after a forward that
    // failed (every rank alike, so nothing aborted; its own argument checks included) must not go
    // back over half-gathered rows, nor over the previous step's.
    this->b_ = {};
    const std::size_t in = this->in(), n = cols();
    const std::size_t rows = this->rows_of(x.size(), in, "input x");
    this->expect({{w.size(), in, n, this->w_name()}});
    batch b = detail::exchange_batch(this->g_, this->topo_, this->cfg_, rows);
    const std::size_t B = b.total();
    auto lanes = this->make_lanes();
    try {  // the workspaces: X and Y here, the rounds' staging in gather_rows
      x_all_.resize(this->g_, B * in);
      y_.resize(this->g_, B * n);
      detail::gather_rows(this->g_, lanes, this->topo_, this->codec_, b, S::rounds(b.rows), in, x, x_all_.span(), n,
                          y_.span(), [&](const float* xr, std::size_t m, float* yr) {
                            lanes.gemm(mm, {false, false, m, n, in, xr, in, w.data(), n, 0.0f, yr, n});
                          });
    } catch (const std::bad_alloc&) {
      this->batch_too_large(B, rows);
    }
    lanes.leave();
    this->b_ = std::move(b);
    return y_.span();
  }

  // dy: dY_k (B x cols); w: W_k; dw: dW_k (in x cols), overwritten; dx: this rank's rows of dX
  // (B_k x in), overwritten.
  template <matmul M>
  void backward(std::span<const float> dy, std::span<const float> w, std::span<float> dw, std::span<float> dx, M&& mm) {
    const std::size_t rows = this->begin_backward(w.size(), dw.size());
    const std::size_t in = this->in(), n = cols(), B = this->b_.total();
    this->expect({{dy.size(), B, n, "output gradient dY_k (B x cols)"},
                  {dx.size(), rows, in, "input gradient dx (this rank's rows x in)"}});
    auto lanes = this->make_lanes();
    try {  // the rounds' staging: the peers are in the call's collectives
      detail::reduce_rows(
          this->g_, lanes, this->topo_, this->codec_, this->b_, S::rounds(this->b_.rows), n, dy, in, dx,
          [&](const float* dyr, std::size_t m, float* p) {  // dX rows = dY_k rows · W_kᵀ
            lanes.gemm(mm, {false, true, m, in, n, dyr, n, w.data(), n, 0.0f, p, in});
          },
          [&] {  // dW_k = Xᵀ · dY_k while the last rounds of dX move
            lanes.gemm(mm, {true, false, in, n, B, x_all_.data(), in, dy.data(), n, 0.0f, dw.data(), n});
          });
    } catch (const std::bad_alloc&) {
      this->batch_too_large(B, rows);
    }
    lanes.leave();
  }

 private:
  detail::workspace<group<Tr>> x_all_;  // (B, in)
  detail::workspace<group<Tr>> y_;      // (B, cols)
};

}  // namespace lockstep::parallel
