// lockstep/transport/run_inproc.hpp: run N ranks as threads of this process.
//
// run_inproc(n, f) builds a world of n in-process ranks, calls f(group) on a thread per rank, and
// rethrows the first real failure once every thread has ended. A rank that throws aborts the
// world, so the others leave their waits at once (with errc::aborted) instead of at the timeout.
//
// run_inproc_deferred(n, f) does the same over inproc_deferred: each rank's work is queued on a
// host_stream of its own, exactly as run_inproc_device queues it on a CUDA stream, so the
// stream-ordered path of the executor, the group and the transport runs on the CPU. Each rank's
// stream is drained before its thread ends, so asynchronous failures surface here.
#pragma once

#include "../collective/group.hpp"
#include "../core/host_stream.hpp"
#include "inproc.hpp"
#include "inproc_stream.hpp"

namespace lockstep {

template <class F>
void run_inproc(int n, F&& f, group_options opt = {}) {
  auto world = transport::inproc::make_world(n);
  transport::detail::run_ranks(n, *world, [&](int r) {
    group<transport::inproc> g(transport::inproc(world, r), opt);
    f(g);
  });
}

namespace detail {

// n ranks of the stream-ordered transport Tr (inproc_stream<Space>), a thread each: with_stream(r,
// body) makes rank r's stream, calls body(its handle) and synchronises the stream once body has
// returned; body runs f on rank r's group, which ends inside it (the group frees its scratch on the
// stream).
template <class Tr, class F, class WithStream>
void run_stream_ranks(int n, F& f, const group_options& opt, WithStream&& with_stream) {
  auto world = Tr::make_world(n);
  transport::detail::run_ranks(n, *world, [&](int r) {
    with_stream(r, [&](typename Tr::space_type::handle_type stream) {
      group<Tr> g(Tr(world, r, stream), opt);
      f(g);
    });
  });
}

}  // namespace detail

template <class F>
void run_inproc_deferred(int n, F&& f, group_options opt = {}) {
  detail::run_stream_ranks<transport::inproc_deferred>(n, f, opt, [&](int, auto&& body) {
    host_stream s(opt.timeout);
    body(&s);
    s.synchronize();
  });
}

}  // namespace lockstep
