// lockstep/parallel/layer_base.hpp: what the column- and row-split layers share: the group, the
// codec and topology their rows travel with, the split of a dimension over the ranks, the checks
// that name the layer, and the rules on which codecs and groups they take.
#pragma once

#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "../codec/concept.hpp"
#include "../collective/group.hpp"
#include "../core/error.hpp"
#include "../topology/concept.hpp"
#include "batch.hpp"
#include "lanes.hpp"
#include "scheme.hpp"

namespace lockstep::parallel::detail {

// A layer's activation workspace, kept from call to call: host memory on a host group; on a
// stream-ordered one the group's space (device memory on a GPU), grown in the group stream's
// order (parallel/lanes.hpp: a call grows it only after its lanes have ordered the wire behind the
// compute stream's reads of the old one).
template <class G, bool Ordered = G::ordered>
class workspace {
 public:
  void resize(G&, std::size_t n) { v_.assign(n, 0.0f); }
  float* data() noexcept { return v_.data(); }
  std::span<float> span() noexcept { return v_; }
  std::span<const float> span() const noexcept { return v_; }

 private:
  std::vector<float> v_;
};
template <class G>
class workspace<G, true> {
 public:
  void resize(G& g, std::size_t n) {  // uninitialised
    if (n * sizeof(float) > mem_.size()) mem_ = g.space().allocate(n * sizeof(float));
    n_ = n;
  }
  float* data() const noexcept { return reinterpret_cast<float*>(mem_.data()); }
  std::span<float> span() const noexcept { return {data(), n_}; }

 private:
  typename G::space_type::memory mem_;
  std::size_t n_ = 0;
};

template <scheme S, transport::transport Tr, codec::codec C, topology::topology T>
class layer_base {
  static_assert(!codec::feedback_codec<C>,
                "parallel layers: activations and their gradients differ from step to step (other samples), so an "
                "error-feedback residual has nothing to correct; pass the plain codec (docs/codecs.md)");

 public:
  using group_type = group<Tr>;
  using stream_type = typename stream_of<group_type>::type;  // the space's stream handle (ordered groups)

  group<Tr>& group_ref() noexcept { return g_; }
  const batch& rows() const noexcept { return b_; }
  // This rank's part [first, first + count) of the split dimension (columns or input rows).
  std::size_t slice_first() const noexcept { return slice_.first; }
  std::size_t slice_size() const noexcept { return slice_.second - slice_.first; }
  std::size_t in() const noexcept { return cfg_.in; }
  std::size_t out() const noexcept { return cfg_.out; }
  const std::string& label() const noexcept { return cfg_.label; }

  // Stream-ordered groups: the stream the layer's inputs are ready on, its products are enqueued
  // on (the caller's matmul enqueues there) and its outputs are complete on: the compute stream.
  // The group's own stream unless set (a null handle means that one too); another (the model's
  // stream) lets the rounds' collectives overlap the products (parallel/lanes.hpp).
  void set_compute_stream(stream_type s)
    requires group_type::ordered
  {
    compute_ = s;
  }
  stream_type compute_stream() const
    requires group_type::ordered
  {
    return compute_ ? compute_ : g_.stream();
  }

 protected:
  layer_base(group<Tr>& g, layer_kind kind, const char* name, std::size_t in, std::size_t out, std::size_t split, C codec, T topo)
      : g_(g), codec_(codec), topo_(topo) {
    // The codec as a mismatch names it: its block too (int8 with blocks of 512 and of 64 differ).
    const std::string codec_desc =
        std::string(codec_.name()) + (codec_.block() > 1 ? " (block " + std::to_string(codec_.block()) + ")" : "");
    cfg_ = {kind, S::id, codec_.id(), codec_desc, in, out,
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
      if (o.got != o.rows * o.cols) throw error(errc::invalid_argument, cfg_.label, g_.rank(), -1, misfit(o));
  }
  // The same for a check that can only come after the batch exchange (a size that depends on the
  // whole batch): the other ranks are then inside the call's collectives, waiting for this one, so
  // the group is aborted with the reason first (as batch_too_large does), and each of them fails at
  // once naming it, instead of at its timeout with no cause.
  void expect_in_call(std::initializer_list<operand> ops) {
    for (const operand& o : ops)
      if (o.got != o.rows * o.cols) fail_in_call(misfit(o));
  }
  static std::string misfit(const operand& o) {
    return std::string(o.what) + " has " + std::to_string(o.got) + " elements; expected " +
           std::to_string(o.rows * o.cols) + " (" + std::to_string(o.rows) + " x " + std::to_string(o.cols) + ")";
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
      throw error(errc::invalid_argument, cfg_.label, g_.rank(), -1,
                  "backward before any forward, or after a forward that failed: no batch to go back over");
  }
  // A batch whose workspaces cannot be allocated (a rank that claimed absurd row counts): this
  // layer's error with the sizes, told to the group, whose other ranks wait in its collectives.
  [[noreturn]] void batch_too_large(std::size_t total_rows, std::size_t my_rows) {
    const std::string why = "cannot allocate the workspaces of a batch of " + std::to_string(total_rows) +
                            " rows (" + std::to_string(my_rows) + " on this rank; " + std::to_string(cfg_.in) + " in, " +
                            std::to_string(cfg_.out) + " out), or a product ran out of memory";
    fail_in_call(why);
  }
  // This layer's error, told to the group first: its other ranks wait in the call's collectives.
  [[noreturn]] void fail_in_call(const std::string& why) {
    g_.abort(cfg_.label + " on rank " + std::to_string(g_.rank()) + ": " + why);
    throw error(errc::invalid_argument, cfg_.label, g_.rank(), -1, why);
  }

  // One call's lanes (parallel/lanes.hpp); construct after the batch exchange, before workspaces grow.
  lanes<group_type> make_lanes() {
    if constexpr (group_type::ordered) return lanes<group_type>(g_, compute_stream());
    else return lanes<group_type>(g_);
  }

  group<Tr>& g_;
  C codec_;
  T topo_;
  layer_config cfg_{};
  std::pair<std::size_t, std::size_t> slice_{};
  batch b_;
  stream_type compute_{};  // ordered groups; null: the group's stream
};

}  // namespace lockstep::parallel::detail
