// lockstep/parallel/row_linear.hpp: a fully connected layer split by input rows (Megatron's
// row-parallel linear), the layer after a column_linear: its input is already split by features,
// so nothing is gathered going forward, and a stack column -> row -> ... all-reduces no FC weights.
//
// Shapes (row-major): K ranks, rank k holds B_k rows of the batch, B = sum B_k; rank k owns input
// features [f_k, f_k + m_k) of W (in x out), split as column_linear splits its columns, so
// column_linear(in0, in) -> row_linear(in, out) chain slice for slice.
//   forward:  H_k (B x m_k: the previous layer's columns for all rows)
//             Y = sum_j H_j · W_j, this rank's rows (B_k x out), reduced over ranks round by round
//   backward: dy (B_k x out, this rank's rows) -> dY (B x out, every rank's rows, moved by the
//             scheme);  dH_k = dY · W_kᵀ (B x m_k), computed round by round as dY arrives;
//             dW_k = H_kᵀ · dY (in-slice x out), local
// No bias: Y is complete only after the reduction, so the caller adds a bias replicated on every
// rank (and all-reduces its gradient data-parallel, like a convolution's). On a stream-ordered
// group the calls enqueue, as column_linear's do.
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
class row_linear : public detail::layer_base<S, Tr, C, T> {
  using base = detail::layer_base<S, Tr, C, T>;

 public:
  row_linear(group<Tr>& g, std::size_t in, std::size_t out, C codec = {}, T topo = {})
      : base(g, layer_kind::row_split, "row_linear", in, out, in, codec, topo) {}

  std::size_t in_rows() const noexcept { return this->slice_size(); }
  std::size_t first_in_row() const noexcept { return this->slice_first(); }

  // h: H_k (B x in_rows) for all ranks' rows; rows: how many of them are this rank's (B_k);
  // w: W_k (in_rows x out). Returns this rank's rows of Y (B_k x out), owned by the layer until the
  // next forward. h's size depends on B, known only once the row counts are exchanged, when the
  // peers are already in this call's collectives: a wrong size aborts the group with the reason
  // (every rank fails at once naming it, instead of at its timeout), so unlike the checks before
  // the exchange it leaves the group unusable, even where every rank passed the same wrong size.
  // `rows` is taken as given: counts that are wrong but sum to the same B are not detected.
  template <matmul M>
  std::span<float> forward(std::span<const float> h, std::size_t rows, std::span<const float> w, M&& mm) {
    this->b_ = {};  // the layer's once the forward is through (column_linear::forward)
    const std::size_t m_k = in_rows(), out = this->out();
    this->expect({{w.size(), m_k, out, this->w_name()}});
    batch b = detail::exchange_batch(this->g_, this->topo_, this->cfg_, rows);
    const std::size_t B = b.total();
    this->expect_in_call({{h.size(), B, m_k, "input H_k (all ranks' rows x in_rows)"}});
    auto lanes = this->make_lanes();
    try {  // the workspaces: Y here, the rounds' staging in reduce_rows
      y_.resize(this->g_, rows * out);
      detail::reduce_rows(
          this->g_, lanes, this->topo_, this->codec_, b, S::rounds(b.rows), m_k, h, out, y_.span(),
          [&](const float* hr, std::size_t m, float* p) {  // partial Y rows = H_k rows · W_k
            lanes.gemm(mm, {false, false, m, out, m_k, hr, m_k, w.data(), out, 0.0f, p, out});
          },
          [] {});
    } catch (const std::bad_alloc&) {
      this->batch_too_large(B, rows);
    }
    lanes.leave();
    this->b_ = std::move(b);
    return y_.span();
  }

  // h: the forward's H_k; dy: this rank's rows of dY (B_k x out); w: W_k; dw: dW_k (in_rows x out),
  // overwritten; dh: dH_k (B x in_rows), overwritten.
  template <matmul M>
  void backward(std::span<const float> h, std::span<const float> dy, std::span<const float> w, std::span<float> dw,
                std::span<float> dh, M&& mm) {
    const std::size_t rows = this->begin_backward(w.size(), dw.size());
    const std::size_t m_k = in_rows(), out = this->out(), B = this->b_.total();
    this->expect({{h.size(), B, m_k, "input H_k (all ranks' rows x in_rows)"},
                  {dy.size(), rows, out, "output gradient dy (this rank's rows x out)"},
                  {dh.size(), B, m_k, "input gradient dH_k (all ranks' rows x in_rows)"}});
    auto lanes = this->make_lanes();
    try {  // dY's workspace and the rounds' staging: the peers are in the call's collectives
      dy_all_.resize(this->g_, B * out);
      detail::gather_rows(this->g_, lanes, this->topo_, this->codec_, this->b_, S::rounds(this->b_.rows), out, dy,
                          dy_all_.span(), m_k, dh, [&](const float* dyr, std::size_t m, float* dhr) {
                            lanes.gemm(mm, {false, true, m, m_k, out, dyr, out, w.data(), out, 0.0f, dhr, m_k});
                          });
      lanes.gemm(mm, {true, false, m_k, out, B, h.data(), m_k, dy_all_.data(), out, 0.0f, dw.data(), out});
    } catch (const std::bad_alloc&) {
      this->batch_too_large(B, rows);
    }
    lanes.leave();
  }

  // dY as every rank used it in the last backward: B x out, rank-major.
  std::span<const float> output_gradients() const noexcept { return dy_all_.span(); }

 private:
  detail::workspace<group<Tr>> y_;       // (B_k, out)
  detail::workspace<group<Tr>> dy_all_;  // (B, out)
};

}  // namespace lockstep::parallel
