// lockstep/optim/step.hpp: one synchronous data-parallel step: the gradients of every rank are
// reduced and the optimizer turns them into new weights, as the all-reduce's epilogue.
//
//   optim::plan<optim::sgd> p{.opt = opt, .params = ps, .st = st, .weights = w, .grads = g};
//   optim::step(g, topology::ring{}, codec, p, lr);              // the whole buffer, one all-reduce
//   optim::step_sharded(g, topology::ring{}, codec, p, lr);      // reduce-scatter, update, all-gather
//
//   auto s = optim::begin_step(g, topology::ring{}, codec, p, buckets, lr);   // per bucket:
//   backward(..., [&](std::size_t k) { s.bucket_ready(k); });   // starts bucket k's all-reduce
//   s.wait();                                                   // every bucket reduced and applied
//
// The plan (plan.hpp) names what is updated and whether the collective sums (the update folds
// 1/ranks into grad_scale, averaging::in_update, the default) or averages (averaging::in_collective).
// Afterwards `grads` holds the reduced gradients (step, begin_step) or this rank's chunk of them
// (step_sharded).
//
// begin_step — the bucketed form, as PyTorch DDP's reducer and Horovod's fusion buffer think of it:
// backward writes the flat gradient buffer piece by piece, and each piece (a bucket, bucket.hpp)
// starts its own all_reduce_async the moment it is written, so early buckets travel while backward
// computes later ones. Each bucket's all-reduce carries the update as its epilogue, on the group's
// worker thread:
//   SGD:  the update of every element range the epilogue reports final (this rank's chunk after the
//         reduce-scatter, then each gathered chunk): read w, g, v; write w, v, bf16.     20 B/param
//   LARS: the tensors a range completes (all of their elements final; optim::completion) are
//         updated in waves, as optim::update does: per-block sums of w², g², then the update. A
//         tensor never straddles buckets, so its last range always comes from its own bucket.
// bucket_ready may be called in any order, but in the same order on every rank: the k-th
// collective of one rank meets the k-th of every other. wait() waits for every bucket and rethrows
// the first failure, naming the bucket; a bucket never made ready is an error too.
// step is begin_step with the whole buffer as one bucket.
//
// The result is bit for bit that of all_reduce per bucket followed by optim::update (with the same
// averaging): SGD's element math sees the same gradients, and LARS' norms are per-block sums over
// the same final values added in block order (param_set.hpp), however the ranges arrive.
//
// step_sharded — each rank updates only its chunk [rank·n/size, (rank+1)·n/size):
//   1. reduce_scatter_inplace with `codec`; epilogue on the rank's chunk:
//        SGD:  the update of the chunk (20 B/param of the chunk).
//        LARS: per-block sums over the chunk: reads w, g (8 B/param of the chunk).
//   2. LARS only: all_gather (`topo`, fp32 as a plain copy) of each rank's fp64 partial sums of
//      w², g², (g + βw)² per tensor, carried as bit patterns, added by every rank in rank order:
//      every rank knows every tensor's norms, with fp64's range (an fp32 sum of squares is Inf
//      from 1.8e19 up); then the update of the chunk (20 B/param of the chunk).
//   3. all_gather_inplace of the weights, always fp32: a lossy codec would round the master
//      weights themselves. Its epilogue writes the bf16 copy of the gathered chunks.
// The sharded result equals step's up to rounding: a tensor cut by a chunk boundary has its norms
// added from two fp64 partial sums instead of one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../codec/bf16.hpp"
#include "../codec/fp32.hpp"
#include "../collective/collectives.hpp"
#include "../core/thread_pool.hpp"
#include "bucket.hpp"
#include "completion.hpp"
#include "concept.hpp"
#include "param_set.hpp"
#include "plan.hpp"
#include "state.hpp"
#include "update.hpp"

namespace lockstep::optim {

namespace detail {

inline error step_error(const char* op, int rank, const std::string& why) {
  return error(errc::invalid_argument, op, rank, -1, why);
}

// What the collective does for an averaging (host and device plans alike).
constexpr reduce_op reduction_of(averaging a) noexcept {
  return a == averaging::in_collective ? reduce_op::average : reduce_op::sum;
}
template <class O>
reduce_op reduction_of(const plan<O>& p) noexcept {
  return reduction_of(p.average);
}

}  // namespace detail

// What a step's epilogues do to the weights. Every engine answers the bucketed step below through
// engine_base:
//   params()            the tensors (completion and bucket checks)
//   norms()             some tensor needs its norms: whole tensors are updated, not ranges
//   reduction()         what the collective does (sum, or average: the plan's averaging)
//   grads()             the flat gradient buffer the buckets cut
// and does the work in
//   range(lo, hi)       update [lo, hi) of the buffer (no norms)
//   tensors(a, b)       update tensors [a, b), all of whose gradients are final (norms)
//   finish()            the step is complete on this rank
// host_engine runs optim::update's sweep over the thread pool; the device's engine (device/step.hpp)
// enqueues the same element math as kernels. engine_for<Plan> names a plan's engine.
class engine_base {
 public:
  template <class O>
  engine_base(const O& opt, const param_set& ps, std::span<float> grads, averaging a)
      : ps_(ps), grads_(grads), average_(a), norms_(needs_any_sums(opt, ps)) {}
  const param_set& params() const noexcept { return ps_; }
  bool norms() const noexcept { return norms_; }
  reduce_op reduction() const noexcept { return detail::reduction_of(average_); }
  std::span<float> grads() const noexcept { return grads_; }

 private:
  const param_set& ps_;
  std::span<float> grads_;
  averaging average_;
  bool norms_;
};

template <class O>
class host_engine : public engine_base {
 public:
  template <class G>
  host_engine(const plan<O>& p, float lr, G& g)
      : engine_base(p.opt, p.params, p.grads, p.average),
        p_(p),
        sw_(p_.opt, p_.params, p_.weights.data(), p_.grads.data(), p_.st, step_context{lr, p_.grad_scale(g.size())},
            p_.weights_bf16.empty() ? nullptr : p_.weights_bf16.data(), p_.pool) {
    detail::check_buffers("optim::step", p_.opt, p_.params, p_.weights.size(), p_.grads.size(), p_.weights_bf16.size(), p_.st);
    if (!norms()) sw_.prepare_normless();
  }
  void range(std::size_t lo, std::size_t hi) { sw_.apply_range(lo, hi); }
  void tensors(std::size_t a, std::size_t b) {
    ready_.clear();
    for (std::size_t t = a; t < b; ++t) ready_.push_back(t);
    sw_.run(ready_);
  }
  void finish() { p_.st.count_step(); }

 private:
  plan<O> p_;
  detail::sweep<O> sw_;             // refers to p_'s optimizer and buffers
  std::vector<std::size_t> ready_;  // tensors completed by the current epilogue call
};

template <class Plan>
struct engine_for;
template <class O>
struct engine_for<plan<O>> {
  using type = host_engine<O>;
};

// One step in flight over a list of buckets; made by begin_step. Not copyable or movable: each
// bucket's epilogue refers to it until wait() (or the destructor) has seen that bucket finish.
// On a stream-ordered group the epilogues enqueue the update behind each range's reduction and
// wait() waits for the stream to run the step.
template <class Tr, class T, class C, class Engine>
class bucketed_step {
 public:
  template <class Plan>
  bucketed_step(group<Tr>& g, const T& topo, C& codec, const Plan& p, std::span<const bucket> buckets, float lr)
      : g_(g), topo_(topo), codec_(codec), rank_(g.rank()), buckets_(buckets.begin(), buckets.end()),
        engine_(p, lr, g),
        done_(engine_.params(), "optim::step"),
        pending_(buckets_.size()),
        started_(buckets_.size(), 0) {
    check_buckets(engine_.params(), buckets_, "optim::step", rank_);
  }
  bucketed_step(const bucketed_step&) = delete;
  bucketed_step& operator=(const bucketed_step&) = delete;

  // A step abandoned before wait() (backward threw) still must not leave a collective writing
  // into this object or the buffers: wait for what was started, drop its errors.
  ~bucketed_step() {
    if (finished_) return;
    for (request& r : pending_) {
      try {
        r.wait();
      } catch (...) {  // the step is being abandoned; its caller is already handling an error
      }
    }
  }

  std::size_t bucket_count() const noexcept { return buckets_.size(); }

  // Bucket k of the list is written: start its all-reduce, with the update as its epilogue.
  void bucket_ready(std::size_t k) {
    if (finished_) throw detail::step_error("optim::step", rank_, "bucket_ready(" + std::to_string(k) + ") after wait()");
    if (k >= buckets_.size())
      throw detail::step_error("optim::step", rank_,
                               "bucket_ready(" + std::to_string(k) + ") of a list of " + std::to_string(buckets_.size()) + " buckets");
    if (started_[k]) throw detail::step_error("optim::step", rank_, detail::show(k, buckets_[k]) + " made ready twice");
    started_[k] = 1;
    const bucket b = buckets_[k];
    // The epilogue's ranges are relative to the bucket's span; the engine works in buffer offsets.
    pending_[k] = all_reduce_async(g_, engine_.grads().subspan(b.first, b.last - b.first), topo_, codec_,
                                   engine_.reduction(), [this, at = b.first](std::size_t first, std::size_t count) {
                                     on_final(at + first, at + first + count);
                                   });
  }

  // Every bucket reduced and its update applied. Waits for all started buckets before it throws:
  // the first failure of a collective (its lockstep::error, with the bucket named), else the
  // buckets never made ready.
  void wait() {
    if (finished_) throw detail::step_error("optim::step", rank_, "wait() called twice");
    finished_ = true;
    std::exception_ptr failure;
    for (std::size_t k = 0; k < pending_.size(); ++k) {
      try {
        pending_[k].wait();
      } catch (const error& e) {
        if (!failure)
          failure = std::make_exception_ptr(
              error(e.code(), "optim::step", rank_, e.peer(), detail::show(k, buckets_[k]) + ", " + e.op() + ": " + e.detail()));
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    std::string missing;
    for (std::size_t k = 0; k < started_.size(); ++k)
      if (!started_[k]) missing += (missing.empty() ? "" : ", ") + std::to_string(k);
    if (!missing.empty())
      throw detail::step_error("optim::step", rank_, "bucket_ready was never called for bucket(s) " + missing +
                                                          " of " + std::to_string(buckets_.size()));
    done_.check_all_reported(rank_);
    engine_.finish();
  }

 private:
  // [lo, hi) of the buffer is final on this rank; runs where the group runs its collectives (the
  // worker thread, or the enqueueing thread of a stream), one bucket's epilogue at a time.
  void on_final(std::size_t lo, std::size_t hi) {
    const auto [a, b] = done_.report(lo, hi, rank_);
    if (!engine_.norms()) engine_.range(lo, hi);
    else if (a < b) engine_.tensors(a, b);
  }

  group<Tr>& g_;
  T topo_;
  C& codec_;
  int rank_;
  std::vector<bucket> buckets_;         // (bucket)
  Engine engine_;
  completion done_;                     // which tensors are final; also checks every element once
  std::vector<request> pending_;        // (bucket)
  std::vector<unsigned char> started_;  // (bucket)
  bool finished_ = false;
};

// Starts a bucketed step: nothing is communicated until bucket_ready. Every rank must call it with
// the same param_set, optimizer, averaging, buckets, topology, codec and learning rate. Any plan
// with an engine_for (optim::plan; device::plan, device/step.hpp).
template <class Tr, class T, class C, class Plan, class Engine = typename engine_for<Plan>::type>
bucketed_step<Tr, T, C, Engine> begin_step(group<Tr>& g, const T& topo, C& codec, const Plan& p,
                                           std::span<const bucket> buckets, float lr) {
  static_assert(check_optimizer<decltype(p.opt)>());
  return bucketed_step<Tr, T, C, Engine>(g, topo, codec, p, buckets, lr);
}

// The fused step over the whole buffer: one all-reduce, the update as its epilogue. Any plan
// begin_step takes (its engine checks that the gradients cover the parameters).
template <class Tr, class T, class C, class Plan>
void step(group<Tr>& g, const T& topo, C& codec, const Plan& p, float lr) {
  // The parameters' extent: the buffers may be longer (a plan's hold at least that many).
  std::size_t n = 0;
  if constexpr (requires { p.params.size(); }) n = p.params.size();
  else n = p.table.params().size();
  const bucket whole[1] = {{0, n}};
  auto s = begin_step(g, topo, codec, p, whole, lr);
  s.bucket_ready(0);
  s.wait();
}

namespace detail {

template <class Tr, class T, class C, optimizer O>
void step_sharded_impl(group<Tr>& g, const T& topo, C& codec, const plan<O>& p, float lr) {
  const param_set& ps = p.params;
  check_buffers("optim::step_sharded", p.opt, ps, p.weights.size(), p.grads.size(), p.weights_bf16.size(), p.st);
  const std::size_t n = ps.size();
  const int rank = g.rank();
  const auto [lo, hi] = chunk_range(n, static_cast<std::size_t>(g.size()), static_cast<std::size_t>(rank));
  const step_context ctx{lr, p.grad_scale(g.size())};
  const reduce_op op = reduction_of(p);
  std::span<float> weights = p.weights, grads = p.grads;
  std::uint16_t* bf = p.weights_bf16.empty() ? nullptr : p.weights_bf16.data();
  thread_pool& pool = p.pool;
  detail::sweep<O> sw(p.opt, ps, weights.data(), grads.data(), p.st, ctx, bf, pool);

  std::vector<std::size_t> own;  // tensors with elements in [lo, hi)
  for (auto [a, b] = ps.tensors_in(lo, hi); a < b; ++a) own.push_back(a);
  std::size_t reported = 0;
  auto check_range = [&](std::size_t first, std::size_t count) {
    if (first < lo || first + count > hi)
      throw detail::step_error("optim::step_sharded", rank,
                               "reduce_scatter reported [" + std::to_string(first) + ", " + std::to_string(first + count) +
                                   ") final, outside this rank's chunk [" + std::to_string(lo) + ", " +
                                   std::to_string(hi) + ")");
    reported += count;
  };

  if (!needs_any_sums(p.opt, ps)) {
    sw.prepare_normless();
    reduce_scatter_inplace(g, grads.first(n), topo, codec, op, [&](std::size_t first, std::size_t count) {
      check_range(first, count);
      sw.apply_range(first, first + count);
    });
  } else {
    sw.clear_block_sums(own, lo, hi);
    reduce_scatter_inplace(g, grads.first(n), topo, codec, op, [&](std::size_t first, std::size_t count) {
      check_range(first, count);
      sw.block_sums(own, first, first + count, true);
    });
    // (tensor, {w², g², d²}): this rank's part of every tensor's sums in fp64, gathered as bit
    // patterns (two floats a double; fp32's all-gather copies bytes) and added in rank order, so
    // every rank has the same sums with fp64's range: cast to fp32 for an all-reduce, a weight of
    // 1e20 made ‖w‖ Inf and a gradient of 1e-23 made ‖g‖ 0.
    const std::size_t per_rank = 3 * ps.tensor_count();
    std::vector<double> partial(per_rank, 0.0);
    for (std::size_t t : own) {
      if (!sw.needs_sums(t)) continue;
      const tensor_sums s = sw.tensor_total(t, lo, hi);
      partial[3 * t] = s.w2;
      partial[3 * t + 1] = s.g2;
      partial[3 * t + 2] = s.d2;
    }
    std::vector<double> everyone(per_rank * static_cast<std::size_t>(g.size()));
    codec::fp32 exact;
    all_gather(g, std::span<const float>(reinterpret_cast<const float*>(partial.data()), 2 * per_rank),
               std::span<float>(reinterpret_cast<float*>(everyone.data()), 2 * everyone.size()), topo, exact);
    for (std::size_t t : own) {
      tensor_sums sum;
      if (sw.needs_sums(t))
        for (std::size_t r = 0; r < static_cast<std::size_t>(g.size()); ++r) {
          sum.w2 += everyone[r * per_rank + 3 * t];
          sum.g2 += everyone[r * per_rank + 3 * t + 1];
          sum.d2 += everyone[r * per_rank + 3 * t + 2];
        }
      sw.set_coeffs(t, sum);
    }
    sw.apply(own, lo, hi);
  }
  if (reported != hi - lo)
    throw detail::step_error("optim::step_sharded", rank,
                             "reduce_scatter reported " + std::to_string(reported) + " of the chunk's " +
                                 std::to_string(hi - lo) + " elements final");

  // The all-gather carries whole chunks, the gaps between tensors with them; the gaps are the
  // caller's (param_set: never written), so each rank's go back as they were.
  std::vector<std::pair<std::size_t, std::vector<float>>> gaps;
  for (std::size_t t = 0, at = 0; t < ps.tensor_count(); at = ps[t].offset + ps[t].size, ++t)
    if (ps[t].offset > at)
      gaps.emplace_back(at, std::vector<float>(weights.begin() + static_cast<std::ptrdiff_t>(at),
                                               weights.begin() + static_cast<std::ptrdiff_t>(ps[t].offset)));
  codec::fp32 exact;
  all_gather_inplace(g, weights.first(n), topo, exact, [&](std::size_t first, std::size_t count) {
    if (!bf || (first >= lo && first + count <= hi)) return;  // our own chunk's copy is written
    const std::size_t last = first + count;
    std::vector<std::pair<std::size_t, std::size_t>> spans;
    for (auto [a, b] = ps.tensors_in(first, last); a < b; ++a) {
      const std::size_t x = std::max(ps[a].offset, first), y = std::min(ps[a].offset + ps[a].size, last);
      for (std::size_t s = x; s < y; s += ps.policy().task) spans.push_back({s, std::min(y, s + ps.policy().task)});
    }
    pool.parallel_for(spans.size(), [&](std::size_t i) {
      for (std::size_t e = spans[i].first; e < spans[i].second; ++e)
        bf[e] = codec::bf16_from_bits(std::bit_cast<std::uint32_t>(weights[e]));
    });
  });
  for (const auto& [at, values] : gaps) std::copy(values.begin(), values.end(), weights.begin() + static_cast<std::ptrdiff_t>(at));
  p.st.count_step();
}

}  // namespace detail

// The sharded step: reduce-scatter, update of this rank's chunk, all-gather of the weights.
template <class Tr, class T, class C, class O>
void step_sharded(group<Tr>& g, const T& topo, C& codec, const plan<O>& p, float lr) {
  static_assert(check_optimizer<O>());
  if constexpr (optimizer<O>) detail::step_sharded_impl(g, topo, codec, p, lr);
}

}  // namespace lockstep::optim
