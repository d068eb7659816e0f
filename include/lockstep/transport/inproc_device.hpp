// lockstep/transport/inproc_device.hpp: N ranks on one GPU, each a host thread with its own CUDA
// stream, so multi-rank device tests and benchmarks run on a single GPU.
//
// It is inproc_stream (transport/inproc_stream.hpp) over the CUDA stream space: a send posts
// (pointer, size, event) into the receiver's mailbox, the receiver's stream waits on the event and
// its kernels read the sender's device memory directly (decode-add from the neighbour's wire slot,
// no copy), and a second event tells the sender's stream when it may overwrite the bytes. The same
// code runs on the CPU as inproc_deferred, where the test suite exercises it.
#pragma once

#include <cuda_runtime.h>

#include "../device/runtime.hpp"
#include "../device/space.hpp"
#include "inproc_stream.hpp"
#include "run_inproc.hpp"

namespace lockstep {

namespace transport { using inproc_device = inproc_stream<device::cuda_space>; }

// Runs n ranks on the current GPU, one host thread and one stream each: f(group<inproc_device>&) on
// each. Each rank's stream is synchronised before its thread ends (so asynchronous failures
// surface here); the first failure is rethrown after all threads end, a failing rank aborting
// the others' waits.
template <class F>
void run_inproc_device(int n, F&& f, group_options opt = {}) {
  int dev = 0;
  device::check(cudaGetDevice(&dev), "cudaGetDevice");
  detail::run_stream_ranks<transport::inproc_device>(n, f, opt, [&](int r, auto&& body) {
    device::check(cudaSetDevice(dev), "cudaSetDevice", r);
    device::stream s;
    body(s.get());
    s.synchronize();
  });
}

}  // namespace lockstep
