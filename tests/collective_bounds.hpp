// The error bound of a collective, shared by the in-process and the MPI collective tests and by
// tests/test_bounds.cpp (docs/codecs.md, "Error of a collective", has the derivation):
//   |y - exact| <= (n * delta_block + depth * delta_value) * M        (first order)
// Each quantisation errs by at most delta times its scale: the block's absmax (int8, dyntree8), or
// the value itself (bf16). A block's absmax may be set by any element, so every one of the n
// quantisations on a value's path counts with scale M, on a ring and on a torus alike (every column
// reduce-scatter quantises its own partial sums). Value-relative errors count only the longest
// chain, depth = N on a ring, R + C - 1 on an R x C torus: column j's partial sums are at most
// column j's share of the value's magnitude, and the shares add up to M. M bounds the partial sums:
// max_i sum_r |x_r[i]| over the buffer, or over the value's block (blocks start at chunk starts,
// so every phase cuts the same blocks), or for bf16 over the value alone.
#pragma once

#include <lockstep/codec.hpp>
#include <lockstep/topology.hpp>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace lockstep_test {

template <class C>
constexpr bool exact = std::is_same_v<C, lockstep::codec::fp32>;

// Whether the codec's error is relative to each value (bf16) rather than to a block's absmax.
template <class C>
constexpr bool value_relative = std::is_same_v<C, lockstep::codec::bf16>;

template <class C>
double delta() {
  using namespace lockstep;
  if constexpr (std::is_same_v<C, codec::fp32>) return 0.0;
  else if constexpr (std::is_same_v<C, codec::bf16>) return 1.0 / 256;  // half an ulp of 8 significant bits
  else if constexpr (std::is_same_v<C, codec::int8> || std::is_same_v<C, codec::error_feedback<codec::int8>>) return 1.0 / 254;
  else return 0.9 / 64;  // dyntree8: the top bin [1 - 0.9/64, 1] decodes to 1
}

// Reduce-scatter hops on the longest chain: N-1 on a ring, R+C-2 on an R x C torus, log2 p on
// halving-doubling (p the largest power of two <= N) and 2 more where ranks were folded in (into
// the neighbour, back out to the owner). Recursive doubling's all_reduce chain is log2 p exchanges,
// the fold and the final quantisation; its reduce_scatter is halving-doubling's: the same count
// covers both.
inline int hops(const lockstep::topology::ring&, int n) { return n - 1; }
// direct: every rank's own values go straight to the chunk's owner, one hop (none alone).
inline int hops(const lockstep::topology::direct&, int n) { return n > 1 ? 1 : 0; }
inline int hops(const lockstep::topology::torus2d& t, int n) {
  auto [r, c] = t.shape(n);
  return r + c - 2;
}
inline int hops(const lockstep::topology::halving_doubling&, int n) {
  const lockstep::topology::detail::fold f(n);
  return f.steps() + (f.extra ? 2 : 0);
}
inline int hops(const lockstep::topology::recursive_doubling&, int n) {
  return hops(lockstep::topology::halving_doubling{}, n);
}

// automatic runs one of its candidates: the longest chain of any.
inline int hops(const lockstep::topology::automatic&, int n) {
  return std::max({hops(lockstep::topology::ring{}, n), hops(lockstep::topology::torus2d{}, n),
                   hops(lockstep::topology::halving_doubling{}, n)});
}

// Quantisations on a value's path, each erring by up to delta times M when the error is relative
// to a block's absmax. Where the reduction is a tree (ring, torus, halving-doubling: every rank
// but the owner sends its partial sum of a chunk once) that is its N - 1 edges and the owner's
// final one: N. Recursive doubling quantises both ends of every exchange: E(j) = 2 E(j-1) + 2 over
// log2 p levels, one more per folded rank and the final one, 2p - 1 + (N - p) in all.
template <class T>
int quantisations(const T&, int n) {
  return n;
}
inline int quantisations(const lockstep::topology::recursive_doubling&, int n) {
  const lockstep::topology::detail::fold f(n);
  return n > 1 ? 2 * f.p - 1 + f.extra : 1;
}
inline int quantisations(const lockstep::topology::automatic&, int n) {
  return std::max(n, quantisations(lockstep::topology::recursive_doubling{}, n));
}

// The factor of M for an all_reduce value (first order), from the longest chain's quantisations
// `depth` (hops + 1: N on a ring, R+C-1 on a torus) and n, every quantisation on the value's path
// (quantisations(): the group size N except on recursive doubling). An error relative to a block's absmax counts all n, one
// relative to the value itself only `depth`: the columns of a torus share the value's magnitude out
// among them. dyntree8 is both: half a bin (0.45/64 of the absmax) anywhere, and up to 0.9/64 only
// in the top bin, where the value is within 0.9/64 of the absmax, so the excess is relative to the
// value (0.45/64 / (1 - 0.9/64) of it); the smaller of the two counts holds.
template <class C>
double error_factor(int depth, int n) {
  using namespace lockstep;
  if constexpr (std::is_same_v<C, codec::bf16>) return depth * delta<C>();
  else if constexpr (std::is_same_v<C, codec::dyntree8>) {
    const double half_bin = 0.45 / 64, top_excess = half_bin / (1 - 0.9 / 64);
    return std::min(n * delta<C>(), n * half_bin + depth * top_excess);
  } else return n * delta<C>();
}

// What the derivation proves: the first-order factor times (1 + delta)^(n-1), since an error
// already in a partial sum can enlarge the scale of each later quantisation on its path. No input
// found reaches past the first order (the element that sets a block's scale round-trips exactly),
// so the tests hold the collectives to error_factor and tests/test_bounds.cpp checks both.
template <class C>
double proven_error_factor(int depth, int n) {
  return error_factor<C>(depth, n) * std::pow(1 + delta<C>(), n - 1);
}

// The all_reduce reference in fp64: ref[i] = sum over ranks of input(r, i) (an average is rounded
// as the library rounds it, sum / n in fp32), and m = max over i of sum over ranks of |input(r, i)|,
// the M every bound above multiplies.
struct all_reduce_reference {
  std::vector<double> ref;
  double m = 0;
};
template <class Input>
all_reduce_reference reference_all_reduce(int n, std::size_t count, bool average, Input&& input) {
  all_reduce_reference out{std::vector<double>(count, 0.0), 0.0};
  for (std::size_t i = 0; i < count; ++i) {
    double a = 0;
    for (int r = 0; r < n; ++r) out.ref[i] += input(r, i), a += std::abs(input(r, i));
    if (average) out.ref[i] = static_cast<float>(static_cast<float>(out.ref[i]) / static_cast<float>(n));
    out.m = std::max(out.m, a);
  }
  return out;
}

}  // namespace lockstep_test
