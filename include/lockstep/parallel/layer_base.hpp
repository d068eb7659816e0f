// lockstep/parallel/layer_base.hpp: what the column- and row-split layers share: the group, the
// codec and topology their rows travel with, the split of a dimension over the ranks, the checks
// that name the layer, and the rules on which codecs and groups they take.
#pragma once

#include <initializer_list>
#include <span>
#include <string>

#include "../codec/concept.hpp"
#include "../collective/group.hpp"
#include "../core/error.hpp"
#include "../topology/concept.hpp"
#include "batch.hpp"
#include "scheme.hpp"

namespace lockstep::parallel::detail {

template <scheme S, transport::transport Tr, codec::codec C, topology::topology T>
class layer_base {
  static_assert(!codec::feedback_codec<C>,
                "parallel layers: activations and their gradients differ from step to step (other samples), so an "
                "error-feedback residual has nothing to correct; pass the plain codec (docs/codecs.md)");
  static_assert(!group<Tr>::ordered,
                "parallel layers run on host groups (inproc, mpi); a stream-ordered group (CUDA, inproc_deferred) is "
                "not supported by parallel/ yet");

 public:
  group<Tr>& group_ref() noexcept { return g_; }
  const batch& rows() const noexcept { return b_; }
  // This rank's part [first, first + count) of the split dimension (columns or input rows).
  std::size_t slice_first() const noexcept { return slice_.first; }
  std::size_t slice_size() const noexcept { return slice_.second - slice_.first; }
  std::size_t in() const noexcept { return cfg_.in; }
  std::size_t out() const noexcept { return cfg_.out; }
  const std::string& label() const noexcept { return cfg_.label; }

 protected:
  layer_base(group<Tr>& g, layer_kind kind, const char* name, std::size_t in, std::size_t out, std::size_t split, C codec, T topo)
      : g_(g), codec_(codec), topo_(topo) {
    cfg_ = {kind, S::id, codec_.id(), std::string(codec_.name()), in, out,
            std::string(name) + "(" + S::name() + ", " + std::string(codec_.name()) + ")"};
    if (in == 0 || out == 0)
      throw error(errc::invalid_argument, cfg_.label, g.rank(), -1,
                  "shape " + std::to_string(in) + " x " + std::to_string(out) + ": both dimensions must be positive");
    if (in > lockstep::detail::max_count || out > lockstep::detail::max_count || in * out / out != in || in * out > lockstep::detail::max_count)
      throw error(errc::invalid_argument, cfg_.label, g.rank(), -1, "shape overflows the wire format");
    const auto [lo, hi] = chunk_range(split, static_cast<std::size_t>(g.size()), static_cast<std::size_t>(g.rank()));
    slice_ = {lo, hi};
  }

  // An argument's size against its shape (rows x cols).
  struct operand {
    std::size_t got, rows, cols;
    const char* what;
  };
  // Each operand in turn; the first that does not fit throws, naming it and both sizes.
  void expect(std::initializer_list<operand> ops) const {
    for (const operand& o : ops)
      if (o.got != o.rows * o.cols)
        throw error(errc::invalid_argument, cfg_.label, g_.rank(), -1,
                    std::string(o.what) + " has " + std::to_string(o.got) + " elements; expected " +
                        std::to_string(o.rows * o.cols) + " (" + std::to_string(o.rows) + " x " + std::to_string(o.cols) + ")");
  }
  // W_k's shape: in x this rank's columns (column split), this rank's input rows x out (row split).
  std::size_t w_rows() const noexcept { return cfg_.kind == layer_kind::column_split ? cfg_.in : slice_size(); }
  std::size_t w_cols() const noexcept { return cfg_.kind == layer_kind::column_split ? slice_size() : cfg_.out; }
  const char* w_name() const noexcept {
    return cfg_.kind == layer_kind::column_split ? "weights W_k (in x cols)" : "weights W_k (in_rows x out)";
  }
  const char* dw_name() const noexcept {
    return cfg_.kind == layer_kind::column_split ? "weight gradient dW_k (in x cols)" : "weight gradient dW_k (in_rows x out)";
  }
  // What every backward checks first: a forward gave it a batch, and W_k and dW_k have W_k's shape.
  // Returns this rank's rows in that batch.
  std::size_t begin_backward(std::size_t w, std::size_t dw) const {
    need_forward();
    expect({{w, w_rows(), w_cols(), w_name()}, {dw, w_rows(), w_cols(), dw_name()}});
    return b_.rows[static_cast<std::size_t>(g_.rank())];
  }
  std::size_t rows_of(std::size_t elems, std::size_t width, const char* what) const {
    if (elems % width)
      throw error(errc::invalid_argument, cfg_.label, g_.rank(), -1,
                  std::string(what) + " has " + std::to_string(elems) + " elements, not a whole number of rows of " +
                      std::to_string(width));
    return elems / width;
  }
  void need_forward() const {
    if (b_.first.empty())
      throw error(errc::invalid_argument, cfg_.label, g_.rank(), -1, "backward before any forward: no batch to go back over");
  }

  group<Tr>& g_;
  C codec_;
  T topo_;
  layer_config cfg_{};
  std::pair<std::size_t, std::size_t> slice_{};
  batch b_;
};

}  // namespace lockstep::parallel::detail
