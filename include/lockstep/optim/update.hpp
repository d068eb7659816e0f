// lockstep/optim/update.hpp: one optimizer step over every tensor of a param_set, host path.
//
//   optim::update(opt, params, weights, grads, st, {.lr = lr}, weights_bf16);
//
// Passes over memory, per element of every tensor (fp32 unless noted):
//   optimizer without norms (SGD):  one sweep: read w, g, v; write w, v (and the bf16 copy of w).
//                                   20 B (+2 B bf16) per parameter, the minimum.
//   optimizer with norms (LARS):    the tensors are taken in waves of about policy.wave elements;
//                                   per wave, a norm pass reads w and g into per-block sums of
//                                   squares, then the update pass reads w, g, v and writes w, v.
//                                   The second read of w and g comes from the last-level cache as
//                                   long as a wave's w and g stay there until the update (2 MiB
//                                   per wave by default, with one other wave in flight), so memory
//                                   sees 20 B per parameter as for SGD; a tensor bigger than the
//                                   cache is read twice from memory (28 B). Both passes run in one
//                                   parallel_for, pipelined: wave k is summed while wave k-1 is
//                                   updated (see sweep::run).
// Both sweeps cut their work into tasks of policy.task elements and run them on a thread_pool;
// tensors, not threads, decide which elements a sum of squares covers (param_set's blocks), so the
// result does not depend on the number of threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <utility>
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

// Sums of squares over n elements. Sixteen lanes each add 8 squares (128 elements), then the
// lanes are added into fp64 accumulators and, at the end, combined in a fixed order: a block's sum
// depends on its elements alone, never on the ISA or the thread that takes it. The squares are
// taken in fp64 (the values widened first): an fp32 square is 0 below about 1e-19 and Inf above
// about 1.8e19, which made a tensor's norm 0 or Inf, and LARS' trust ratio 1 or NaN, for values
// fp32 holds well (a weight of 1e20, a gradient of 1e-23). (s·g + β·w) is formed in fp32 as the
// update forms it. The lanes are explicit vectors where the compiler has them (GCC, Clang, nvcc's
// host pass): left to the auto-vectoriser, GCC 12 vectorised this loop well when n was a constant
// and with shuffles at a quarter of the speed when it was not.
#if defined(__GNUC__) || defined(__clang__)
using lanes8 = float __attribute__((vector_size(32)));
using lanes8d = double __attribute__((vector_size(64)));
// By reference: returning a 32-byte vector by value would change the ABI between -mavx and not.
inline void load8(lanes8& v, const float* p) noexcept { std::memcpy(&v, p, sizeof v); }
inline void widen8(lanes8d& out, const lanes8& v) noexcept { out = __builtin_convertvector(v, lanes8d); }
#else
struct lanes8 {  // the same arithmetic, one lane at a time
  float x[8];
  float& operator[](int i) noexcept { return x[i]; }
  float operator[](int i) const noexcept { return x[i]; }
  friend lanes8 operator+(lanes8 a, lanes8 b) noexcept { for (int i = 0; i < 8; ++i) a.x[i] += b.x[i]; return a; }
  friend lanes8 operator*(lanes8 a, lanes8 b) noexcept { for (int i = 0; i < 8; ++i) a.x[i] *= b.x[i]; return a; }
  friend lanes8 operator*(float s, lanes8 a) noexcept { for (int i = 0; i < 8; ++i) a.x[i] *= s; return a; }
};
struct lanes8d {
  double x[8];
  double& operator[](int i) noexcept { return x[i]; }
  double operator[](int i) const noexcept { return x[i]; }
  friend lanes8d operator+(lanes8d a, lanes8d b) noexcept { for (int i = 0; i < 8; ++i) a.x[i] += b.x[i]; return a; }
  friend lanes8d operator*(lanes8d a, lanes8d b) noexcept { for (int i = 0; i < 8; ++i) a.x[i] *= b.x[i]; return a; }
};
inline void load8(lanes8& v, const float* p) noexcept { std::memcpy(v.x, p, sizeof v.x); }
inline void widen8(lanes8d& out, const lanes8& v) noexcept { for (int i = 0; i < 8; ++i) out.x[i] = double(v.x[i]); }
#endif

// One element's terms of the sums of squares in fp64, each only when asked for: w², g², and
// (s·g + β·w)² with the sum formed in fp32, as the lanes below form it. The tail loop below and the
// CUDA sums kernel (device/optim.hpp, every element).
template <bool W, bool G, bool D>
LOCKSTEP_HD inline void add_squares(double& aw, double& ag, double& ad, float w, float g, float s, float b) noexcept {
  if constexpr (W) aw += double(w) * double(w);
  if constexpr (G) ag += double(g) * double(g);
  if constexpr (D) ad += double(s * g + b * w) * double(s * g + b * w);
}

template <bool W, bool G, bool D>
tensor_sums sum_squares(const float* w, const float* g, std::size_t n, float grad_scale, float decay) noexcept {
  constexpr std::size_t lanes = 16, run = 8 * lanes;
  double aw[lanes] = {}, ag[lanes] = {}, ad[lanes] = {};
  const float s = grad_scale, b = decay;
  const std::size_t full = n / run * run;
  for (std::size_t i = 0; i < full; i += run) {
    lanes8d fw[2] = {}, fg[2] = {}, fd[2] = {};
    for (std::size_t k = 0; k < run; k += lanes)
      for (int h = 0; h < 2; ++h) {
        const std::size_t at = i + k + 8 * static_cast<std::size_t>(h);
        lanes8 x, y;
        lanes8d e;
        if constexpr (W || D) load8(x, w + at);
        if constexpr (G || D) load8(y, g + at);
        if constexpr (W) widen8(e, x), fw[h] = fw[h] + e * e;
        if constexpr (G) widen8(e, y), fg[h] = fg[h] + e * e;
        if constexpr (D) widen8(e, s * y + b * x), fd[h] = fd[h] + e * e;
      }
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) {
        if constexpr (W) aw[8 * h + j] += fw[h][j];
        if constexpr (G) ag[8 * h + j] += fg[h][j];
        if constexpr (D) ad[8 * h + j] += fd[h][j];
      }
  }
  for (std::size_t i = full; i < n; ++i) add_squares<W, G, D>(aw[i % lanes], ag[i % lanes], ad[i % lanes], w[i], g[i], s, b);
  auto total = [](const double* a) {
    double h[lanes / 2];
    for (std::size_t j = 0; j < lanes / 2; ++j) h[j] = a[j] + a[j + lanes / 2];
    return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
  };
  tensor_sums out;
  if constexpr (W) out.w2 = total(aw);
  if constexpr (G) out.g2 = total(ag) * double(s) * double(s);
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

// Element i's update: O's element math between the loads and the stores, v read and written only
// with `momentum`, the bf16 copy of w only with `bf16`. Shared by the host loop below (where both
// are constants) and the CUDA update kernel (device/optim.hpp).
template <class O>
LOCKSTEP_HD inline void update_element(const typename O::coeffs& k, float* w, const float* g, float* v, std::uint16_t* bf,
                                       std::size_t i, bool momentum, bool bf16) noexcept {
  float wi = w[i], vi = momentum ? v[i] : 0.0f;
  O::update(k, wi, g[i], vi);
  w[i] = wi;
  if (momentum) v[i] = vi;
  if (bf16) bf[i] = codec::bf16::to_wire(wi);
}

// The update loop around O's element math: one variant per (momentum buffer, bf16 copy) so that
// neither test sits inside the loop.
template <optimizer O, bool Momentum, bool Bf16>
void apply_loop(const typename O::coeffs k, float* LOCKSTEP_RESTRICT w, const float* LOCKSTEP_RESTRICT g,
                float* LOCKSTEP_RESTRICT v, std::uint16_t* LOCKSTEP_RESTRICT bf, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) update_element<O>(k, w, g, v, bf, i, Momentum, Bf16);
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
        bf_(bf), st_(st), ctx_(ctx), pool_(pool), coeffs_(ps.tensor_count()),
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
        if (accumulate) slot += s;
        else slot = s;
      }
    });
  }
  // Zeroes the block sums of `tensors` inside [lo, hi) before an accumulating pass.
  void clear_block_sums(std::span<const std::size_t> tensors, std::size_t lo, std::size_t hi) {
    for (std::size_t t : tensors)
      for (auto [b, e] = blocks_in(t, lo, hi); b < e; ++b) st_.block_sums()[b] = {};
  }
  // A tensor's sums over its blocks inside [lo, hi), added in block order.
  tensor_sums tensor_total(std::size_t t, std::size_t lo = 0, std::size_t hi = all) {
    const auto [b0, b1] = blocks_in(t, lo, hi);
    return sum_blocks(st_.block_sums().data(), b0, b1);
  }

  void set_coeffs(std::size_t t, const tensor_sums& s) {
    coeffs_[t] = opt_.coefficients(ctx_, s, ps_[t].exempt);
    ready_[t] = 1;
  }

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

  // Whole tensors, norms included, in one parallel_for with no barrier inside. The tensors are
  // taken in waves of about policy.wave elements; the task list is
  //   S0 S1 U0 S2 U1 S3 U2 ... Un
  // (Sk: sums of squares over wave k's blocks, Uk: update of wave k's pieces), so wave k's norms
  // are taken while wave k-1 is updated, and wave k is updated while its w and g are still in
  // cache. Tasks
  // are claimed in list order, so a tensor's sum tasks are all claimed before its first update
  // task; the thread that finishes a tensor's last sum task computes its coefficients, and an
  // update task that finds them not yet published waits for that thread (which waits for nothing).
  void run(std::span<const std::size_t> tensors) {
    const std::size_t per_sum = std::max<std::size_t>(1, ps_.policy().task / ps_.policy().block);
    const std::size_t task = ps_.policy().task;
    struct item {
      bool sum;
      std::size_t t, a, e;  // sum: blocks [a, e) of tensor t; update: elements [a, e)
    };
    std::vector<item> list, sums, updates;
    std::vector<std::atomic<std::uint32_t>> pending(ps_.tensor_count());
    std::vector<std::atomic<bool>> published(ps_.tensor_count());
    auto wave_tasks = [&](std::span<const std::size_t> wave) {
      sums.clear();
      updates.clear();
      for (std::size_t t : wave) {
        const tensor_desc& d = ps_[t];
        if (needs_sums(t)) {
          std::uint32_t k = 0;
          for (std::size_t b = 0; b < ps_.block_count(t); b += per_sum, ++k)
            sums.push_back({true, t, b, std::min(ps_.block_count(t), b + per_sum)});
          pending[t].store(k, std::memory_order_relaxed);
          published[t].store(false, std::memory_order_relaxed);
        } else {
          set_coeffs(t, tensor_sums{});
          published[t].store(true, std::memory_order_relaxed);
        }
        for (std::size_t x = d.offset; x < d.offset + d.size; x += task)
          updates.push_back({false, t, x, std::min(d.offset + d.size, x + task)});
      }
    };
    std::vector<item> previous_updates;
    for (std::size_t i = 0; i < tensors.size();) {
      std::size_t j = i, elems = 0;
      do elems += ps_[tensors[j++]].size;
      while (j < tensors.size() && elems + ps_[tensors[j]].size <= ps_.policy().wave);
      wave_tasks(tensors.subspan(i, j - i));
      // This wave's sums go before the previous wave's updates: a whole wave of tasks separates a
      // tensor's last sum task from its first update task, so updates do not wait on sums.
      list.insert(list.end(), sums.begin(), sums.end());
      list.insert(list.end(), previous_updates.begin(), previous_updates.end());
      previous_updates = updates;
      i = j;
    }
    list.insert(list.end(), previous_updates.begin(), previous_updates.end());

    std::span<tensor_sums> bs = st_.block_sums();
    pool_.parallel_for(list.size(), [&](std::size_t i) {
      const item& it = list[i];
      if (it.sum) {
        const sum_request r = opt_.sums(ps_[it.t].exempt);
        for (std::size_t b = it.a; b < it.e; ++b) {
          const auto [x, y] = ps_.block_range(it.t, b);
          bs[ps_.first_block(it.t) + b] = sum_squares(r, w_ + x, g_ + x, y - x, ctx_.grad_scale);
        }
        if (pending[it.t].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          set_coeffs(it.t, tensor_total(it.t));
          published[it.t].store(true, std::memory_order_release);
        }
        return;
      }
      for (int spins = 0; !published[it.t].load(std::memory_order_acquire); ++spins)
        if (spins > 64) std::this_thread::yield();
      run_loop(coeffs_[it.t], it.a, it.e - it.a);
    });
  }
  void run_all() {
    std::vector<std::size_t> every(ps_.tensor_count());
    for (std::size_t t = 0; t < every.size(); ++t) every[t] = t;
    // Without norms, waves would only add synchronisation: one sweep over everything.
    if (!needs_any_sums(opt_, ps_)) {
      prepare_normless();
      apply(every);
    } else {
      run(every);
    }
  }

 private:
  // The blocks of tensor t that hold elements of [lo, hi), as indices [b0, b1) of the state's block
  // sums; empty when none does.
  std::pair<std::size_t, std::size_t> blocks_in(std::size_t t, std::size_t lo, std::size_t hi) const noexcept {
    const tensor_desc& d = ps_[t];
    const std::size_t a = std::max(d.offset, lo), e = std::min(d.offset + d.size, hi);
    if (a >= e) return {0, 0};
    const std::size_t first = ps_.first_block(t), block = ps_.policy().block;
    return {first + (a - d.offset) / block, first + (e - d.offset - 1) / block + 1};
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
  std::vector<typename O::coeffs> coeffs_;      // (tensor)
  std::vector<unsigned char> ready_;            // (tensor): coefficients set this step
  std::vector<std::size_t> range_;              // tensor indices of the current call
  std::vector<block_task> tasks_;
  std::vector<piece> pieces_;
};

// Throws lockstep::error naming the buffer (w, g, the bf16 copy when bf != 0, in elements) that is
// shorter than the param_set's n elements: the host's checks and the device step's.
inline void check_sizes(const char* op, std::size_t n, std::size_t w, std::size_t g, std::size_t bf) {
  auto bad = [&](const std::string& why) { return error(errc::invalid_argument, op, -1, -1, why); };
  const std::string need = " elements; the param_set spans " + std::to_string(n);
  if (w < n) throw bad("weights hold " + std::to_string(w) + need);
  if (g < n) throw bad("gradients hold " + std::to_string(g) + need);
  if (bf != 0 && bf < n) throw bad("the bf16 copy holds " + std::to_string(bf) + need);
}

// Throws lockstep::error naming the buffer that does not fit the param_set or the state.
template <optimizer O>
void check_buffers(const char* op, const O& opt, const param_set& ps, std::size_t w, std::size_t g, std::size_t bf,
                   state& st) {
  auto bad = [&](const std::string& why) { return error(errc::invalid_argument, op, -1, -1, why); };
  const std::string need = " elements; the param_set spans " + std::to_string(ps.size());
  check_sizes(op, ps.size(), w, g, bf);
  if (opt.uses_momentum() && st.momentum().size() < ps.size())
    throw bad("the state has no momentum buffer for this param_set (" + std::to_string(st.momentum().size()) +
              need + "): build it as state(params, optimizer)");
  if (st.block_sums().size() != ps.block_count())
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
