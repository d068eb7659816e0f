// lockstep/parallel/lanes.hpp: where one call of a model-parallel layer does its work, and what
// orders it. A call has two lanes: the wire (the group's collectives and the copies into and out
// of their buffers) and the compute lane (the caller's products and the copies around them).
//
//   host group                   both lanes are the calling thread, working now; a round's
//   (inproc, mpi)                collective runs on the group's worker and its request is waited
//                                for before either lane reads what it wrote.
//   stream-ordered group         nothing is done at call time. The wire is the group's stream, the
//   (inproc_deferred,            compute lane the layer's compute stream (the group's own unless
//    inproc_device, nccl)        the caller set another), and each lane waits for the other by an
//                                event where it reads what the other wrote. The caller's matmul
//                                enqueues its product on the compute stream and returns.
//
// Per call on a stream: the constructor orders the wire after the compute stream (the inputs were
// written there); leave() joins the two (the outputs are complete in the compute stream's order,
// and the wire frees the call's staging only behind the compute stream's last read of it).
// Staging lives as long as the lanes object. A call that fails waits for every request (host) or
// drains both streams (ordered) on its way out, so no queued work still uses a buffer being freed.
//
//   lanes<G> l = layer.make_lanes();       // enter
//   l.wire_copy(buf, x, bytes); l.posted(r, all_gather_v_inplace_async(g, ...));
//   l.arrived(r); l.gemm(mm, {...});       // the compute lane reads round r
//   l.handed(); l.posted(r, reduce_scatter_v_inplace_async(g, partial, ...));  // the wire reads it
//   l.landed(r); l.wire_copy(out, partial + at, bytes);
//   l.leave();
#pragma once

#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <vector>

#include "../collective/group.hpp"
#include "../collective/request.hpp"
#include "../core/error.hpp"
#include "gemm.hpp"

namespace lockstep::parallel::detail {

template <class G, bool Ordered = G::ordered>
class lanes;

// A stream of G's space (ordered groups); nothing on a host group.
template <class G, bool Ordered = G::ordered>
struct stream_of {
  using type = std::nullptr_t;
};
template <class G>
struct stream_of<G, true> {
  using type = typename G::space_type::handle_type;
};

// A host group: everything now, on this thread.
template <class G>
class lanes<G, false> {
 public:
  explicit lanes(G&) {}
  lanes(const lanes&) = delete;
  lanes& operator=(const lanes&) = delete;
  ~lanes() {
    for (auto& q : reqs_) try {
        q.wait();
      } catch (...) {
      }
  }

  float* staging(std::size_t n) { return staged_.emplace_back(n).data(); }  // (n), zeroed
  float* compute_staging(std::size_t n) { return staging(n); }
  void wire_copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void compute_copy(void* dst, const void* src, std::size_t bytes) const { wire_copy(dst, src, bytes); }

  void posted(std::size_t r, request q) {
    if (reqs_.size() <= r) reqs_.resize(r + 1);
    reqs_[r] = std::move(q);
  }
  void arrived(std::size_t r) { reqs_[r].wait(); }  // the compute lane may read round r
  void landed(std::size_t r) { reqs_[r].wait(); }   // the wire may read round r's result
  void handed() const noexcept {}                   // the wire may read what the compute lane wrote
  template <matmul M>
  void gemm(M& mm, const gemm_args& a) const {
    run_gemm(mm, a);
  }
  void leave() const noexcept {}

 private:
  std::vector<request> reqs_;            // (round)
  std::deque<std::vector<float>> staged_;
};

// A stream-ordered group: everything enqueued, the lanes ordered by events.
template <class G>
class lanes<G, true> {
  using space_type = typename G::space_type;
  using event = typename space_type::event;

 public:
  lanes(G& g, typename space_type::handle_type compute)
      : g_(g), wire_(g.space()), compute_(compute), split_(compute != g.stream()), unwinding_(std::uncaught_exceptions()) {
    if (split_) cross(compute_, wire_);
  }
  lanes(const lanes&) = delete;
  lanes& operator=(const lanes&) = delete;
  ~lanes() {
    if (std::uncaught_exceptions() > unwinding_) {
      const auto until = g_.deadline();
      compute_.drain(until);
      wire_.drain(until);
    }
  }

  // (n) in the group's space, uninitialised, freed behind the call's work. staging() allocates on
  // the wire, for buffers the wire writes first; compute_staging() on the compute stream, for
  // buffers the compute lane writes first. Stream-ordered memory is the allocating stream's until
  // another stream waits for that stream: the pool may hand back a block the wire freed while the
  // wire's earlier work still reads it, and a compute stream writing it at once would race that
  // work (waiting for the wire instead would serialise compute behind the rounds in flight).
  float* staging(std::size_t n) { return allocate_on(wire_, n); }
  float* compute_staging(std::size_t n) { return allocate_on(compute_, n); }
  void wire_copy(void* dst, const void* src, std::size_t bytes) const { wire_.copy(dst, src, bytes); }
  void compute_copy(void* dst, const void* src, std::size_t bytes) const { compute_.copy(dst, src, bytes); }

  // The call only enqueued: an error found while enqueueing (a peer gone, a size that does not
  // match) waits in the request; rethrow it now, without waiting for the stream.
  void posted(std::size_t r, request q) {
    (void)q.wait_for(std::chrono::seconds(0));
    if (!split_) return;
    while (round_.size() <= r) round_.emplace_back();
    wire_.record(round_[r]);
  }
  void arrived(std::size_t r) {
    if (split_) compute_.wait(round_[r]);
  }
  void landed(std::size_t) const noexcept {}  // the wire is in order with itself
  void handed() {
    if (split_) cross(compute_, wire_);
  }
  // Products of nothing are settled here (run_gemm's rule), in the compute stream's order.
  template <matmul M>
  void gemm(M& mm, const gemm_args& a) {
    if (a.m == 0 || a.n == 0) return;
    if (a.k == 0) {
      if (a.beta != 0.0f) throw error(errc::invalid_argument, "parallel gemm", g_.rank(), -1, "an empty product with beta != 0");
      if (a.ldc == a.n) compute_.zero(a.c, a.m * a.n * sizeof(float));
      else
        for (std::size_t i = 0; i < a.m; ++i) compute_.zero(a.c + i * a.ldc, a.n * sizeof(float));
      return;
    }
    mm(a);
  }
  void leave() {
    if (!split_) return;
    cross(compute_, wire_);
    cross(wire_, compute_);
  }

 private:
  float* allocate_on(space_type& s, std::size_t n) {
    return reinterpret_cast<float*>(mem_.emplace_back(s.allocate(n * sizeof(float))).data());
  }
  // `to` runs its later work after what `from` has queued so far.
  void cross(space_type& from, space_type& to) {
    event& e = joins_.emplace_back();
    from.record(e);
    to.wait(e);
  }

  G& g_;
  space_type wire_, compute_;
  bool split_;
  int unwinding_;
  std::deque<event> round_, joins_;  // (round): the wire has posted it; joins of the two lanes
  std::deque<typename space_type::memory> mem_;
};

}  // namespace lockstep::parallel::detail
