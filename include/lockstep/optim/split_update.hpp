// lockstep/optim/split_update.hpp: one optimizer step over tensors that are split across a group
// (model-parallel slices: parallel::column_linear's columns, row_linear's input rows), where each
// rank holds one slice of every tensor and updates only that slice.
//
//   optim::split_update(g, opt, slices, weights, grads, st, {.lr = lr, .grad_scale = 1.0f / R});
//
// SGD needs nothing but the slice, so this is optim::update with no communication. LARS' trust
// ratio needs the norms of the whole tensor: each rank takes its slices' sums of squares (the same
// per-block sums optim::update takes), the group all-gathers them as fp64 bit patterns (one
// all_gather of 6 floats per tensor: the fp32 codec copies bits exactly), and every rank adds the
// K ranks' sums in rank order 0, 1, ..., K-1. So every rank computes the same λ, bit for bit,
// whatever its slice, and the whole tensor's sums differ from a single rank's only in summation
// order (fp64; relative error about K·2⁻⁵³ on top of the fp32 block sums).
// Tensor i of the param_set is rank k's slice of the same whole tensor on every rank: the ranks
// must list the same tensors in the same order with the same exempt flags (slice sizes may differ,
// as chunk_range cuts them, but none may be empty: param_set refuses an empty tensor, so a tensor
// with fewer elements than ranks is updated whole on every rank, not split). A different tensor
// count is an all_gather size mismatch, which fails every rank with errc::mismatch naming the
// peer; a different exempt flag is caught here.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../codec/fp32.hpp"
#include "../collective/collectives.hpp"
#include "../core/error.hpp"
#include "../topology/ring.hpp"
#include "update.hpp"

namespace lockstep::optim {

namespace detail {

// Per tensor: w2, g2, d2 as (lo, hi) 32-bit halves, then the exempt flag and a magic word.
inline constexpr std::size_t split_fields = 8;
inline constexpr std::uint32_t split_magic = 0x5350534c;  // "LSPS"

inline void put_double(float* at, double v) {
  const auto bits = std::bit_cast<std::uint64_t>(v);
  at[0] = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
  at[1] = std::bit_cast<float>(static_cast<std::uint32_t>(bits >> 32));
}
inline double get_double(const float* at) {
  return std::bit_cast<double>(std::uint64_t{std::bit_cast<std::uint32_t>(at[0])} |
                               std::uint64_t{std::bit_cast<std::uint32_t>(at[1])} << 32);
}

}  // namespace detail

// The whole tensors' sums of squares (as optimizer `opt` asks for them), from every rank's slices:
// the same values, bit for bit, on every rank of g. Tensors that need no sums get zeros. The sweep
// `sw` has taken nothing yet; its block sums are filled here.
template <class G, optimizer O>
std::vector<tensor_sums> split_sums(G& g, const O& opt, const param_set& ps, detail::sweep<O>& sw) {
  const std::size_t T = ps.tensor_count(), K = static_cast<std::size_t>(g.size());
  std::vector<std::size_t> all_tensors(T);
  for (std::size_t t = 0; t < T; ++t) all_tensors[t] = t;
  sw.block_sums(all_tensors, 0, detail::sweep<O>::all, false);
  std::vector<float> mine(T * detail::split_fields), every(K * T * detail::split_fields);
  for (std::size_t t = 0; t < T; ++t) {
    const tensor_sums s = opt.sums(ps[t].exempt).any() ? sw.tensor_total(t) : tensor_sums{};
    float* f = mine.data() + t * detail::split_fields;
    detail::put_double(f, s.w2);
    detail::put_double(f + 2, s.g2);
    detail::put_double(f + 4, s.d2);
    f[6] = std::bit_cast<float>(static_cast<std::uint32_t>(ps[t].exempt));
    f[7] = std::bit_cast<float>(detail::split_magic);
  }
  codec::fp32 c;
  all_gather(g, std::span<const float>(mine), std::span<float>(every), topology::ring{}, c);
  std::vector<tensor_sums> out(T);
  for (std::size_t k = 0; k < K; ++k)
    for (std::size_t t = 0; t < T; ++t) {
      const float* f = every.data() + (k * T + t) * detail::split_fields;
      if (std::bit_cast<std::uint32_t>(f[7]) != detail::split_magic)
        throw error(errc::mismatch, "optim::split_update", g.rank(), static_cast<int>(k),
                    "rank " + std::to_string(k) + " sent no split_update sums: another collective was called");
      if (std::bit_cast<std::uint32_t>(f[6]) != static_cast<std::uint32_t>(ps[t].exempt))
        throw error(errc::mismatch, "optim::split_update", g.rank(), static_cast<int>(k),
                    "tensor " + std::to_string(t) + " is " + (ps[t].exempt ? "exempt" : "not exempt") +
                        " on this rank and " + (ps[t].exempt ? "not exempt" : "exempt") + " on rank " +
                        std::to_string(k) + ": the ranks must list the slices of the same tensors in the same order");
      out[t].w2 += detail::get_double(f);  // rank order 0..K-1 on every rank: the same bits everywhere
      out[t].g2 += detail::get_double(f + 2);
      out[t].d2 += detail::get_double(f + 4);
    }
  return out;
}

// One update of this rank's slices, with the coefficients of the whole tensors. Every rank of g
// must call it (it is a collective when the optimizer needs norms). O is unconstrained so that a
// type that is not an optimizer gets check_optimizer's sentence.
template <class G, class O>
void split_update(G& g, const O& opt, const param_set& ps, std::span<float> weights, std::span<const float> grads,
                  state& st, step_context ctx, std::span<std::uint16_t> weights_bf16 = {},
                  thread_pool& pool = thread_pool::shared()) {
  static_assert(check_optimizer<O>());
  if constexpr (optimizer<O>) {
    detail::check_buffers("optim::split_update", opt, ps, weights.size(), grads.size(), weights_bf16.size(), st);
    detail::sweep<O> sw(opt, ps, weights.data(), grads.data(), st, ctx,
                        weights_bf16.empty() ? nullptr : weights_bf16.data(), pool);
    if (!needs_any_sums(opt, ps) || g.size() == 1) {
      sw.run_all();  // SGD, or nothing to combine: the plain update
    } else {
      const std::vector<tensor_sums> whole = split_sums(g, opt, ps, sw);
      std::vector<std::size_t> every(ps.tensor_count());
      for (std::size_t t = 0; t < every.size(); ++t) {
        every[t] = t;
        sw.set_coeffs(t, whole[t]);
      }
      sw.apply(every);
    }
    st.count_step();
  }
}

}  // namespace lockstep::optim
