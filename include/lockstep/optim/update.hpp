// lockstep/optim/update.hpp: one optimizer step over every tensor of a param_set, host path.
//
//   optim::update(opt, params, weights, grads, st, {.lr = lr}, weights_bf16);
//
// Passes over memory, per element of every tensor (fp32 unless noted):
//   optimizer without norms (SGD):  one sweep: read w, g, v; write w, v (and the bf16 copy of w).
//                                   20 B (+2 B bf16) per parameter, the minimum.
//   optimizer with norms (LARS):    the tensors are taken in waves of about policy.wave elements;
//                                   per wave, a norm sweep reads w and g into per-block sums of
//                                   squares, then the update sweep reads w, g, v and writes w, v.
//                                   The second read of w and g comes from the last-level cache as
//                                   long as a wave's w and g fit there (4 MiB by default), so memory
//                                   sees 20 B per parameter as for SGD; a tensor bigger than a wave
//                                   is read twice from memory (28 B).
// Both sweeps cut their work into tasks of policy.task elements and run them on a thread_pool;
// tensors, not threads, decide which elements a sum of squares covers (param_set's blocks), so the
// result does not depend on the number of threads.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../codec/bf16.hpp"
#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../core/thread_pool.hpp"
#include "concept.hpp"
#include "param_set.hpp"
#include "state.hpp"

namespace lockstep::optim {

namespace detail {

// Sums of squares over n elements. Eight fp64 lanes: the loop vectorises without -ffast-math,
// fp64 keeps a 2-million-element tensor's norm accurate to fp32 rounding, and the lanes are
// combined in a fixed order, so a block's sum depends on its elements alone.
template <bool W, bool G, bool D>
tensor_sums sum_squares(const float* LOCKSTEP_RESTRICT w, const float* LOCKSTEP_RESTRICT g, std::size_t n,
                        float grad_scale, float decay) noexcept {
  constexpr std::size_t lanes = 8;
  double aw[lanes] = {}, ag[lanes] = {}, ad[lanes] = {};
  const double s = grad_scale, b = decay;
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) {
      if constexpr (W) aw[j] += double(w[i + j]) * double(w[i + j]);
      if constexpr (G) ag[j] += double(g[i + j]) * double(g[i + j]);
      if constexpr (D) {
        const double d = s * double(g[i + j]) + b * double(w[i + j]);
        ad[j] += d * d;
      }
    }
  }
  for (std::size_t j = 0; i < n; ++i, ++j) {
    if constexpr (W) aw[j] += double(w[i]) * double(w[i]);
    if constexpr (G) ag[j] += double(g[i]) * double(g[i]);
    if constexpr (D) {
      const double d = s * double(g[i]) + b * double(w[i]);
      ad[j] += d * d;
    }
  }
  auto total = [](const double* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); };
  tensor_sums out;
  if constexpr (W) out.w2 = total(aw);
  if constexpr (G) out.g2 = total(ag) * s * s;
  if constexpr (D) out.d2 = total(ad);
  return out;
}

inline tensor_sums sum_squares(const sum_request& r, const float* w, const float* g, std::size_t n,
                               float grad_scale) noexcept {
  const bool gr = r.grads, dg = r.decayed_grads;
  if (r.weights) {
    if (gr && dg) return sum_squares<true, true, true>(w, g, n, grad_scale, r.decay);
    if (gr) return sum_squares<true, true, false>(w, g, n, grad_scale, r.decay);
    if (dg) return sum_squares<true, false, true>(w, g, n, grad_scale, r.decay);
    return sum_squares<true, false, false>(w, g, n, grad_scale, r.decay);
  }
  if (gr && dg) return sum_squares<false, true, true>(w, g, n, grad_scale, r.decay);
  if (gr) return sum_squares<false, true, false>(w, g, n, grad_scale, r.decay);
  if (dg) return sum_squares<false, false, true>(w, g, n, grad_scale, r.decay);
  return {};
}

inline void add_to(tensor_sums& a, const tensor_sums& b) noexcept {
  a.w2 += b.w2;
  a.g2 += b.g2;
  a.d2 += b.d2;
}

// The update loop around O's element math: one variant per (momentum buffer, bf16 copy) so that
// neither test sits inside the loop.
template <optimizer O, bool Momentum, bool Bf16>
void apply_loop(const typename O::coeffs k, float* LOCKSTEP_RESTRICT w, const float* LOCKSTEP_RESTRICT g,
                float* LOCKSTEP_RESTRICT v, std::uint16_t* LOCKSTEP_RESTRICT bf, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    float wi = w[i], vi = 0.0f;
    if constexpr (Momentum) vi = v[i];
    O::update(k, wi, g[i], vi);
    w[i] = wi;
    if constexpr (Momentum) v[i] = vi;
    if constexpr (Bf16) bf[i] = codec::bf16_from_bits(std::bit_cast<std::uint32_t>(wi));
  }
}

// One step's sweeps over a param_set on one rank. The collective steps (step.hpp) drive the same
// object from their epilogues, so the fused and unfused paths run the same loops.
template <optimizer O>
class sweep {
 public:
  static constexpr std::size_t all = std::numeric_limits<std::size_t>::max();

  sweep(const O& opt, const param_set& ps, float* w, const float* g, state& st, step_context ctx,
        std::uint16_t* bf, thread_pool& pool)
      : opt_(opt), ps_(ps), w_(w), g_(g), v_(opt.uses_momentum() ? st.momentum().data() : nullptr),
        bf_(bf), st_(st), ctx_(ctx), pool_(pool), sums_(ps.tensor_count()), coeffs_(ps.tensor_count()),
        ready_(ps.tensor_count(), 0) {}

  bool needs_sums(std::size_t t) const noexcept { return opt_.sums(ps_[t].exempt).any(); }

  // Coefficients of every tensor that needs no norms; the others wait for their sums.
  void prepare_normless() {
    for (std::size_t t = 0; t < ps_.tensor_count(); ++t)
      if (!needs_sums(t)) set_coeffs(t, tensor_sums{});
  }

  // Block sums over the elements of `tensors` inside [lo, hi), in parallel. With accumulate, each
  // block's sum is added to what the state already holds (a rank's chunk arriving in several
  // ranges); otherwise it replaces it.
  void block_sums(std::span<const std::size_t> tensors, std::size_t lo, std::size_t hi, bool accumulate) {
    tasks_.clear();
    const std::size_t per_task = std::max<std::size_t>(1, ps_.policy().task / ps_.policy().block);
    for (std::size_t t : tensors) {
      if (!needs_sums(t)) continue;
      const tensor_desc& d = ps_[t];
      const std::size_t a = std::max(d.offset, lo), e = std::min(d.offset + d.size, hi);
      if (a >= e) continue;
      const std::size_t b0 = (a - d.offset) / ps_.policy().block, b1 = (e - d.offset - 1) / ps_.policy().block + 1;
      for (std::size_t b = b0; b < b1; b += per_task) tasks_.push_back({t, b, std::min(b1, b + per_task)});
    }
    std::span<tensor_sums> bs = st_.block_sums();
    pool_.parallel_for(tasks_.size(), [&](std::size_t i) {
      const block_task& k = tasks_[i];
      const sum_request r = opt_.sums(ps_[k.t].exempt);
      for (std::size_t b = k.b0; b < k.b1; ++b) {
        auto [x, y] = ps_.block_range(k.t, b);
        x = std::max(x, lo);
        y = std::min(y, hi);
        const tensor_sums s = sum_squares(r, w_ + x, g_ + x, y - x, ctx_.grad_scale);
        tensor_sums& slot = bs[ps_.first_block(k.t) + b];
        if (accumulate) add_to(slot, s);
        else slot = s;
      }
    });
  }
  // Zeroes the block sums of `tensors` inside [lo, hi) before an accumulating pass.
  void clear_block_sums(std::span<const std::size_t> tensors, std::size_t lo, std::size_t hi) {
    for_blocks(tensors, lo, hi, [&](std::size_t, std::size_t gb) { st_.block_sums()[gb] = {}; });
  }
  // A tensor's sums over its blocks inside [lo, hi), added in block order.
  tensor_sums tensor_total(std::size_t t, std::size_t lo = 0, std::size_t hi = all) {
    tensor_sums s;
    const std::size_t one[1] = {t};
    for_blocks(one, lo, hi, [&](std::size_t, std::size_t gb) { add_to(s, st_.block_sums()[gb]); });
    return s;
  }

  void set_coeffs(std::size_t t, const tensor_sums& s) {
    sums_[t] = s;
    coeffs_[t] = opt_.coefficients(ctx_, s, ps_[t].exempt);
    ready_[t] = 1;
  }
  const tensor_sums& sums(std::size_t t) const noexcept { return sums_[t]; }
  const typename O::coeffs& coeffs(std::size_t t) const noexcept { return coeffs_[t]; }

  // The update of `tensors` restricted to [lo, hi), in parallel; their coefficients must be set.
  void apply(std::span<const std::size_t> tensors, std::size_t lo = 0, std::size_t hi = all) {
    pieces_.clear();
    const std::size_t task = ps_.policy().task;
    for (std::size_t t : tensors) {
      const tensor_desc& d = ps_[t];
      const std::size_t a = std::max(d.offset, lo), e = std::min(d.offset + d.size, hi);
      if (!ready_[t])
        throw error(errc::invalid_argument, "optim::update", -1, -1,
                    "tensor " + std::to_string(t) + " updated before its norms were known");
      for (std::size_t x = a; x < e; x += task) pieces_.push_back({t, x, std::min(e, x + task)});
    }
    pool_.parallel_for(pieces_.size(), [&](std::size_t i) {
      const piece& p = pieces_[i];
      run_loop(coeffs_[p.t], p.a, p.e - p.a);
    });
  }
  void apply_range(std::size_t lo, std::size_t hi) {
    auto [a, b] = ps_.tensors_in(lo, hi);
    range_.clear();
    for (std::size_t t = a; t < b; ++t) range_.push_back(t);
    apply(range_, lo, hi);
  }

  // Whole tensors, norms included: waves of about policy.wave elements, each summed then updated
  // while its w and g are still in cache.
  void run(std::span<const std::size_t> tensors) {
    std::size_t i = 0;
    while (i < tensors.size()) {
      std::size_t j = i, elems = 0;
      bool sums = false;
      do {
        elems += ps_[tensors[j]].size;
        sums = sums || needs_sums(tensors[j]);
        ++j;
      } while (j < tensors.size() && elems + ps_[tensors[j]].size <= ps_.policy().wave);
      const auto wave = tensors.subspan(i, j - i);
      if (sums) block_sums(wave, 0, all, false);
      for (std::size_t t : wave) set_coeffs(t, needs_sums(t) ? tensor_total(t) : tensor_sums{});
      apply(wave);
      i = j;
    }
  }
  void run_all() {
    std::vector<std::size_t> every(ps_.tensor_count());
    for (std::size_t t = 0; t < every.size(); ++t) every[t] = t;
    // Without norms, waves would only add synchronisation: one sweep over everything.
    bool any = false;
    for (std::size_t t = 0; t < ps_.tensor_count() && !any; ++t) any = needs_sums(t);
    if (!any) {
      prepare_normless();
      apply(every);
    } else {
      run(every);
    }
  }

 private:
  template <class F>
  void for_blocks(std::span<const std::size_t> tensors, std::size_t lo, std::size_t hi, F&& f) {
    for (std::size_t t : tensors) {
      const tensor_desc& d = ps_[t];
      const std::size_t a = std::max(d.offset, lo), e = std::min(d.offset + d.size, hi);
      if (a >= e) continue;
      const std::size_t b0 = (a - d.offset) / ps_.policy().block, b1 = (e - d.offset - 1) / ps_.policy().block + 1;
      for (std::size_t b = b0; b < b1; ++b) f(b, ps_.first_block(t) + b);
    }
  }

  void run_loop(const typename O::coeffs& k, std::size_t a, std::size_t n) noexcept {
    float* w = w_ + a;
    const float* g = g_ + a;
    float* v = v_ ? v_ + a : nullptr;
    std::uint16_t* bf = bf_ ? bf_ + a : nullptr;
    if (v) {
      if (bf) apply_loop<O, true, true>(k, w, g, v, bf, n);
      else apply_loop<O, true, false>(k, w, g, v, bf, n);
    } else {
      if (bf) apply_loop<O, false, true>(k, w, g, v, bf, n);
      else apply_loop<O, false, false>(k, w, g, v, bf, n);
    }
  }

  struct block_task { std::size_t t, b0, b1; };  // blocks [b0, b1) of tensor t
  struct piece { std::size_t t, a, e; };         // elements [a, e) of tensor t

  const O& opt_;
  const param_set& ps_;
  float* w_;
  const float* g_;
  float* v_;
  std::uint16_t* bf_;
  state& st_;
  step_context ctx_;
  thread_pool& pool_;
  std::vector<tensor_sums> sums_;               // (tensor)
  std::vector<typename O::coeffs> coeffs_;      // (tensor)
  std::vector<unsigned char> ready_;            // (tensor): coefficients set this step
  std::vector<std::size_t> range_;              // tensor indices of the current call
  std::vector<block_task> tasks_;
  std::vector<piece> pieces_;
};

// Throws lockstep::error naming the buffer that does not fit the param_set or the state.
template <optimizer O>
void check_buffers(const char* op, const O& opt, const param_set& ps, std::size_t w, std::size_t g, std::size_t bf,
                   state& st) {
  auto bad = [&](const std::string& why) { return error(errc::invalid_argument, op, -1, -1, why); };
  const std::string need = " elements; the param_set spans " + std::to_string(ps.size());
  if (w < ps.size()) throw bad("weights hold " + std::to_string(w) + need);
  if (g < ps.size()) throw bad("gradients hold " + std::to_string(g) + need);
  if (bf != 0 && bf < ps.size()) throw bad("the bf16 copy holds " + std::to_string(bf) + need);
  if (opt.uses_momentum() && st.momentum().size() < ps.size())
    throw bad("the state has no momentum buffer for this param_set (" + std::to_string(st.momentum().size()) +
              need + "): build it as state(params, optimizer)");
  if (st.block_sums().size() != ps.block_count() || st.remaining().size() != ps.tensor_count())
    throw bad("the state was built for another param_set");
}

}  // namespace detail

// One update of every tensor: w, v (and the bf16 copy when given) from w, g, v. Nothing is
// communicated; the gradients are used as they are, times ctx.grad_scale.
// O is unconstrained so that a type that is not an optimizer gets check_optimizer's sentence, not
// a failed constraint.
template <class O>
void update(const O& opt, const param_set& ps, std::span<float> weights, std::span<const float> grads, state& st,
            step_context ctx, std::span<std::uint16_t> weights_bf16 = {},
            thread_pool& pool = thread_pool::shared()) {
  static_assert(check_optimizer<O>());
  if constexpr (optimizer<O>) {
    detail::check_buffers("optim::update", opt, ps, weights.size(), grads.size(), weights_bf16.size(), st);
    detail::sweep<O> sw(opt, ps, weights.data(), grads.data(), st, ctx,
                        weights_bf16.empty() ? nullptr : weights_bf16.data(), pool);
    sw.run_all();
    st.count_step();
  }
}

}  // namespace lockstep::optim
