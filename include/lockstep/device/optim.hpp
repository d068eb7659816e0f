// lockstep/device/optim.hpp: multi-tensor optimizer steps on device buffers, with per-tensor norms,
// stream ordered.
//
//   device::param_table table(params, stream);                 // once: the param_set on the device
//   device::update_async(opt, table, {.lr = lr}, w, g, v, stream, w_bf16);
//
// Three kernels, none of which waits for the host (the norms never leave the device):
//   sums          one CUDA block per param_set block (policy.block elements of one tensor): the
//                 fp64 sums of squares the optimizer asks for (o.sums), as the host's sweep takes
//                 them: Σw², Σg²·s², Σ(s·g + β·w)². Skipped when no tensor needs a norm (SGD).
//   coefficients  one thread per tensor: adds the tensor's block sums in block order and calls
//                 o.coefficients(ctx, sums, exempt), the host's own function, on the device.
//   update        one CUDA block per param_set block: optim::detail::update_element per element,
//                 the host loop's own (O::update, and the bf16 copy of w).
// A block's sum is taken over the same elements on every rank, so every rank gets the same norms
// and the same weights. Within a block the device adds in a tree, the host in eight lanes: device
// and host norms agree to fp64 rounding, not bit for bit; the update itself is the same function.
//
// The optimizer's `coefficients` must be callable on the device: constexpr (with nvcc's
// --expt-relaxed-constexpr) or marked LOCKSTEP_HD.
#pragma once

#include "config.hpp"
#include "reduce.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "../optim/concept.hpp"
#include "../optim/param_layout.hpp"
#include "../optim/param_set.hpp"
#include "../optim/update.hpp"

namespace lockstep::device {

// The param_set's tensors and blocks in device memory (optim/param_layout.hpp).  // (tensor), (block)
class param_table {
 public:
  using tensor = optim::param_layout::tensor;
  using block = optim::param_layout::block;

  param_table(const optim::param_set& ps, cudaStream_t s) : ps_(&ps) {
    const optim::param_layout l(ps);
    tensors_ = upload(l.tensors, s);
    blocks_ = upload(l.blocks, s);
    sums_ = buffer<optim::tensor_sums>(l.blocks.size(), s);
  }

  const optim::param_set& params() const noexcept { return *ps_; }
  const tensor* tensors() const noexcept { return tensors_.data(); }
  const block* blocks() const noexcept { return blocks_.data(); }
  optim::tensor_sums* sums() const noexcept { return sums_.data(); }

  // Per-tensor coefficients of optimizer O, in device memory owned by the table.
  template <class Coeffs>
  Coeffs* coeffs(cudaStream_t s) {
    const std::size_t bytes = ps_->tensor_count() * sizeof(Coeffs);
    if (coeffs_.size() < bytes) coeffs_ = buffer<std::byte>(bytes, s);
    return reinterpret_cast<Coeffs*>(coeffs_.data());
  }

 private:
  const optim::param_set* ps_;
  buffer<tensor> tensors_;
  buffer<block> blocks_;
  buffer<optim::tensor_sums> sums_;
  buffer<std::byte> coeffs_;

  // Pageable copies are staged by the driver before cudaMemcpyAsync returns, so the vectors
  // may go out of scope; this is set-up, done once per param_set.
  template <class T>
  static buffer<T> upload(const std::vector<T>& v, cudaStream_t s) {
    buffer<T> d(v.size(), s);
    check(cudaMemcpyAsync(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s), "param_table");
    return d;
  }
};

namespace kernels {

template <class O, int Threads>
__global__ void __launch_bounds__(Threads)
optim_sums(O o, const param_table::tensor* __restrict__ tensors, const param_table::block* __restrict__ blocks,
           std::size_t first, std::size_t nblocks, const float* __restrict__ w, const float* __restrict__ g,
           float grad_scale, optim::tensor_sums* __restrict__ out) {
  using sum = block_reduce<double, Threads>;
  __shared__ typename sum::storage red;
  for (std::size_t b = first + blockIdx.x; b < first + nblocks; b += gridDim.x) {
    const param_table::block bk = blocks[b];
    const optim::sum_request r = o.sums(tensors[bk.tensor].exempt);
    double aw = 0.0, ag = 0.0, ad = 0.0;
    if (r.any())
      for (std::size_t i = bk.lo + threadIdx.x; i < bk.hi; i += Threads)
        optim::detail::add_squares<true, true, true>(aw, ag, ad, w[i], g[i], grad_scale, r.decay);
    // Uniform per block (r depends on the tensor only), so every thread reaches the reductions.
    optim::tensor_sums t;
    if (r.weights) t.w2 = sum::all(red, aw, ::cuda::std::plus<>{});
    if (r.grads) t.g2 = sum::all(red, ag, ::cuda::std::plus<>{}) * (double(grad_scale) * double(grad_scale));
    if (r.decayed_grads) t.d2 = sum::all(red, ad, ::cuda::std::plus<>{});
    if (threadIdx.x == 0) out[b] = t;
  }
}

template <class O>
__global__ void optim_coefficients(O o, const param_table::tensor* __restrict__ tensors, std::size_t first,
                                   std::size_t ntensors, const optim::tensor_sums* __restrict__ sums, bool have_sums,
                                   optim::step_context ctx, typename O::coeffs* __restrict__ out) {
  for (std::size_t t = first + blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; t < first + ntensors;
       t += std::size_t(gridDim.x) * blockDim.x) {
    const param_table::tensor ts = tensors[t];
    const optim::tensor_sums s = have_sums ? optim::sum_blocks(sums, ts.first_block, ts.first_block + ts.blocks) : optim::tensor_sums{};
    out[t] = o.coefficients(ctx, s, ts.exempt);
  }
}

template <class O, int Threads>
__global__ void __launch_bounds__(Threads)
optim_update(const param_table::block* __restrict__ blocks, std::size_t first, std::size_t nblocks,
             std::size_t lo, std::size_t hi, const typename O::coeffs* __restrict__ coeffs, float* __restrict__ w,
             const float* __restrict__ g, float* __restrict__ v, std::uint16_t* __restrict__ bf) {
  for (std::size_t b = first + blockIdx.x; b < first + nblocks; b += gridDim.x) {
    const param_table::block bk = blocks[b];
    const typename O::coeffs k = coeffs[bk.tensor];
    // Elements of the block inside [lo, hi): a fused step updates each range as it becomes final.
    const std::size_t from = bk.lo > lo ? bk.lo : lo, to = bk.hi < hi ? bk.hi : hi;
#pragma unroll 4
    for (std::size_t i = from + threadIdx.x; i < to; i += Threads)
      optim::detail::update_element<O>(k, w, g, v, bf, i, v != nullptr, bf != nullptr);
  }
}

}  // namespace kernels

// One step's kernels over a param_table's tensors, the device twin of optim::detail::sweep: w, g,
// v (momentum; may be null when !o.uses_momentum()) and the optional bf16 copy of w are device
// buffers of params().size() elements. Every call enqueues on the stream and returns.
template <class O>
class sweep {
  using P = optim_policy;

 public:
  sweep(const O& o, param_table& table, optim::step_context ctx, float* w, const float* g, float* v,
        std::uint16_t* w_bf16, cudaStream_t s)
      : o_(o), t_(table), ctx_(ctx), w_(w), g_(g), v_(o.uses_momentum() ? v : nullptr), bf_(w_bf16), s_(s) {
    if (o.uses_momentum() && !v)
      throw error(errc::invalid_argument, (std::string(O::name()) + " update").c_str(), -1, -1,
                  "the optimizer uses momentum but no buffer was given");
  }

  // Sums (when `sums`) and coefficients of tensors [t0, t1).
  void coefficients(std::size_t t0, std::size_t t1, bool sums) {
    if (t1 <= t0) return;
    const auto [b0, b1] = optim::blocks_of(t_.params(), t0, t1);
    if (sums && b1 > b0) {
      kernels::optim_sums<O, P::block_threads><<<grid_for(b1 - b0, 8), P::block_threads, 0, s_>>>(
          o_, t_.tensors(), t_.blocks(), b0, b1 - b0, w_, g_, ctx_.grad_scale, t_.sums());
      check_launch("optimizer sums");
    }
    kernels::optim_coefficients<O><<<static_cast<unsigned>((t1 - t0 + 127) / 128), 128, 0, s_>>>(
        o_, t_.tensors(), t0, t1 - t0, t_.sums(), sums, ctx_, t_.coeffs<typename O::coeffs>(s_));
    check_launch("optimizer coefficients");
  }
  // The update of tensors [t0, t1), restricted to elements [lo, hi).
  void update(std::size_t t0, std::size_t t1, std::size_t lo, std::size_t hi) {
    const auto [b0, b1] = optim::blocks_of(t_.params(), t0, t1);
    if (b1 <= b0 || hi <= lo) return;
    kernels::optim_update<O, P::block_threads><<<grid_for(b1 - b0, 8), P::block_threads, 0, s_>>>(
        t_.blocks(), b0, b1 - b0, lo, hi, t_.coeffs<typename O::coeffs>(s_), w_, g_, v_, bf_);
    check_launch("optimizer update");
  }
  // Every tensor, with the norms the optimizer asks for.
  void all() {
    const optim::param_set& ps = t_.params();
    coefficients(0, ps.tensor_count(), optim::needs_any_sums(o_, ps));
    update(0, ps.tensor_count(), 0, ps.size());
  }

 private:
  O o_;
  param_table& t_;
  optim::step_context ctx_;
  float* w_;
  const float* g_;
  float* v_;
  std::uint16_t* bf_;
  cudaStream_t s_;
};

// One optimizer step over every tensor of the table's param_set (the buffers as sweep's), enqueued
// on `s`; returns at once.
template <optim::optimizer O>
void update_async(const O& o, param_table& table, optim::step_context ctx, float* w, const float* g, float* v,
                  cudaStream_t s, std::uint16_t* w_bf16 = nullptr) {
  sweep<O>(o, table, ctx, w, g, v, w_bf16, s).all();
}

}  // namespace lockstep::device
