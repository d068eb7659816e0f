// samples/fashion_cnn/split_update_cuda.cuh: optim::split_update on the device: one optimizer step
// of this rank's slices of tensors split over a stream-ordered group, with the coefficients of the
// whole tensors (the hybrid replica's fc1/fc2 slices, replica_hybrid_cuda.cuh).
//
//   gpu::split_update<G, O> up(g, opt, slices);        // slices: this rank's param_set
//   lockstep::request r = up(lr, 1.0f / R, w, g, v, s);  // enqueued on s; r.wait() before the next call
//
// SGD (no norms), or one rank: device::update_async on the slices. LARS: device::sweep's block sums
// of this rank's slices, added per tensor in block order (slice_sums_kernel); the (T, 3) fp64 sums
// all-gathered over the group as fp32 words (the fp32 codec copies them, no arithmetic), added in
// rank order on every rank, so every rank gets the same bits (split_coefficients_kernel), and
// turned into the optimizer's coefficients, which the sweep's update then applies. Nothing goes
// through the host; the gather is the one collective, on the group's stream between two events.
// As on the host, the whole tensors' norms differ from a single rank's in summation order only.
// Limits: the ranks must list their slices of the same tensors in the same order (the host
// split_update checks it; here a mismatch is not detected); at most 32 tensors.
#pragma once

#include <span>
#include <stdexcept>

#include <lockstep/codec.hpp>
#include <lockstep/collective/collectives.hpp>
#include <lockstep/device/optim.hpp>
#include <lockstep/device/runtime.hpp>
#include <lockstep/optim/param_set.hpp>

#include "layers_cuda.cuh"

namespace fashion::gpu {

// (T, 3) fp64 sums of this rank's slices, per tensor: Σw², Σ(s·g)², Σ(s·g + β·w)² as optimizer o
// asks for them (zeros where it asks for none), added from the table's block sums in block order.
template <class O>
__global__ void slice_sums_kernel(O o, const lockstep::device::param_table::tensor* tensors, std::size_t T,
                                  const lockstep::optim::tensor_sums* blocks, double* out) {
  const std::size_t t = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const auto ts = tensors[t];
  lockstep::optim::tensor_sums s{};
  if (o.sums(ts.exempt).any()) s = lockstep::optim::sum_blocks(blocks, ts.first_block, ts.first_block + ts.blocks);
  out[3 * t] = s.w2, out[3 * t + 1] = s.g2, out[3 * t + 2] = s.d2;
}

// Every rank's slice sums (R, T, 3) added in rank order into the whole tensors' sums, then the
// optimizer's coefficients of each tensor, where the sweep's update reads them.
template <class O>
__global__ void split_coefficients_kernel(O o, const lockstep::device::param_table::tensor* tensors, std::size_t T,
                                          std::size_t R, const double* every, lockstep::optim::step_context ctx,
                                          typename O::coeffs* out) {
  const std::size_t t = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  lockstep::optim::tensor_sums s{};
  for (std::size_t k = 0; k < R; ++k) {  // rank order 0..R-1 on every rank: the same bits everywhere
    const double* f = every + (k * T + t) * 3;
    s.w2 += f[0], s.g2 += f[1], s.d2 += f[2];
  }
  out[t] = o.coefficients(ctx, s, tensors[t].exempt);
}

template <class Group, class O>
class split_update {
 public:
  split_update(Group& g, const O& opt, const lockstep::optim::param_set& slices)
      : g_(g), opt_(opt), table_(slices, g.stream()),
        norms_(lockstep::optim::needs_any_sums(opt, slices) && g.size() > 1) {
    if (slices.tensor_count() > 32)
      throw std::invalid_argument("gpu::split_update: at most 32 tensors (one warp adds their sums)");
    if (norms_)
      every_ = lockstep::device::buffer<double>(static_cast<std::size_t>(g.size()) * slices.tensor_count() * 3, g.stream());
    LOCKSTEP_SAMPLE_CHECK(cudaStreamSynchronize(g.stream()));
  }

  // One step of the slices w (their gradients g, momentum v or null), enqueued on s, the stream g
  // and w are ready on; returns the norms' all-gather (an empty request without one), to be waited
  // for before the next call.
  lockstep::request operator()(float lr, float grad_scale, float* w, const float* g, float* v, cudaStream_t s) {
    const lockstep::optim::step_context ctx{lr, grad_scale};
    if (!norms_) {
      lockstep::device::update_async(opt_, table_, ctx, w, g, v, s);
      return {};
    }
    const cudaStream_t wire = g_.stream();
    const std::size_t T = table_.params().tensor_count(), R = static_cast<std::size_t>(g_.size());
    lockstep::device::sweep<O> sw(opt_, table_, ctx, w, g, v, nullptr, s);
    sw.coefficients(0, T, true);  // the block sums (and the slices' own coefficients, replaced below)
    slice_sums_kernel<<<1, 32, 0, s>>>(opt_, table_.tensors(), T, table_.sums(),
                                       every_.data() + static_cast<std::size_t>(g_.rank()) * T * 3);
    LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
    summed_.record(s);
    LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(wire, summed_.get(), 0));
    lockstep::request r = lockstep::all_gather_inplace_async(
        g_, std::span<float>(reinterpret_cast<float*>(every_.data()), R * T * 6), lockstep::topology::ring{}, words_);
    gathered_.record(wire);  // enqueued by now (as parallel/lanes.hpp relies on)
    LOCKSTEP_SAMPLE_CHECK(cudaStreamWaitEvent(s, gathered_.get(), 0));
    split_coefficients_kernel<<<1, 32, 0, s>>>(opt_, table_.tensors(), T, R, every_.data(), ctx,
                                               table_.coeffs<typename O::coeffs>(s));
    LOCKSTEP_SAMPLE_CHECK(cudaGetLastError());
    sw.update(0, T, 0, table_.params().size());
    return r;
  }

 private:
  Group& g_;
  O opt_;
  lockstep::device::param_table table_;
  bool norms_;                                 // the optimizer needs whole-tensor norms and R > 1
  lockstep::device::buffer<double> every_;     // (rank, tensor, 3): every rank's slice sums, all-gathered
  lockstep::codec::fp32 words_;                // their codec; outlives the gather
  lockstep::device::event summed_, gathered_;  // this rank's sums written; every rank's arrived
};

}  // namespace fashion::gpu
