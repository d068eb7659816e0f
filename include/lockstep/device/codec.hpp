// lockstep/device/codec.hpp: every codec's encode, decode and decode-add as CUDA kernels, on
// device buffers, stream ordered; called through device::cuda_space (space.hpp), which hands error
// feedback's inner codec to them:
//
//   cuda_space(stream).encode(codec, x, n, wire, residual)   wire <- codec(x[0..n)); with a residual
//                                                            (error feedback; else null): v = x + r,
//                                                            wire <- codec(v), r <- v - decoded
//   cuda_space(stream).decode(codec, wire, n, out)           out <- values(wire)
//   cuda_space(stream).decode_add(codec, wire, n, acc)       acc += values(wire)
//
// The wire bytes are the host codec's, bit for bit: the same layout (blockwise.hpp), the same
// element functions and loops (codec::encode_elements and decode_elements, codec::magnitude_bits and
// block_scale, Format::quantize, Format::value), and every product and sum
// rounded on its own (__fmul_rn, __fadd_rn) exactly where the host loop rounds. So the host tests of
// the codecs cover the arithmetic these kernels run. One caveat: nvcc contracts a*b+c into an fma
// inside the shared element functions unless compiled with --fmad=false, as lockstep's own CUDA
// targets are; without it a quantised code can differ from the host's in the last place.
//
// Adding a codec: specialise device::codec_kernels<C> with encode and decode (add = true/false).
#pragma once

#include "config.hpp"
#include "reduce.hpp"

#include <cstdint>

#include "../codec/bf16.hpp"
#include "../codec/blockwise.hpp"
#include "../codec/concept.hpp"
#include "../codec/elementwise.hpp"
#include "../codec/fp32.hpp"

namespace lockstep::device {

template <class C>
struct codec_kernels {
  static_assert(sizeof(C) == 0,
                "lockstep::device::codec_kernels<C>: this codec has no device kernels; use fp32, bf16, "
                "int8, dyntree8, another codec::blockwise<Format> or error_feedback of one of them, or "
                "specialise codec_kernels<C> in lockstep/device/codec.hpp");
};

namespace kernels {

// ---- blockwise codecs: one fp32 absmax scale per block of values --------------------------------

// The 256 decoded unit values of a Format in shared memory, built by each CUDA block from
// Format::value, the function the host's blockwise::table() is built from.
template <class Format, int Threads>
__device__ void fill_table(float* table) {
  for (int c = threadIdx.x; c < 256; c += Threads) table[c] = Format::value(static_cast<std::uint8_t>(c));
  __syncthreads();
}

// One CUDA block per codec block, grid-stride over the codec blocks: the absmax pass, then the
// quantisation pass, which reads the block again (4 KiB of x and residual at most, still in L1).
// residual may be null (no error feedback).
template <class Format, int Threads>
__global__ void __launch_bounds__(Threads)
blockwise_encode(codec::blockwise<Format> cw, const float* __restrict__ x, float* __restrict__ residual, std::size_t n,
                 std::byte* __restrict__ wire) {
  using absmax = block_reduce<std::uint32_t, Threads>;
  __shared__ typename absmax::storage red;
  __shared__ float table[256];
  if (residual) fill_table<Format, Threads>(table);  // only error feedback decodes while encoding
  auto load = [&](std::size_t i) { return residual ? __fadd_rn(x[i], residual[i]) : x[i]; };

  float* __restrict__ scales = reinterpret_cast<float*>(wire);
  std::uint8_t* __restrict__ codes = cw.codes(wire, n);
  for (std::size_t b = blockIdx.x; b < cw.blocks(n); b += gridDim.x) {
    const auto [lo, len] = cw.block_span(b, n);
    std::uint32_t m = 0;
    for (std::size_t i = threadIdx.x; i < len; i += Threads) m = max(m, codec::magnitude_bits(load(lo + i)));
    const float scale = codec::block_scale(absmax::all(red, m, ::cuda::maximum<>{}));
    if (threadIdx.x == 0) scales[b] = scale;

    // As blockwise::quantize_block: an all-zero or non-finite block carries no codes.
    const bool live = codec::block_scale_carries(scale);  // the host encoder's rule (blockwise.hpp)
    // Above huge_scale, values and scale stepped down first, as the host does (blockwise.hpp).
    const bool huge = scale > codec::huge_scale;
    const float inv = live ? __fdiv_rn(1.0f, huge ? __fmul_rn(scale, codec::scale_step) : scale) : 0.0f;
    for (std::size_t i = threadIdx.x; i < len; i += Threads) {
      const float v = load(lo + i);
      const float u = huge ? __fmul_rn(v, codec::scale_step) : v;
      const std::uint8_t c = live ? Format::quantize(__fmul_rn(u, inv)) : std::uint8_t{0};
      codes[lo + i] = c;
      if (residual) residual[lo + i] = codec::feedback_residual(v, __fmul_rn(table[c], scale));
    }
  }
}

// out <- values(wire), or out += them when `add`.
template <class Format, int Threads>
__global__ void __launch_bounds__(Threads)
blockwise_decode(codec::blockwise<Format> cw, const std::byte* __restrict__ wire, std::size_t n, float* __restrict__ out,
                 bool add) {
  __shared__ float table[256];
  fill_table<Format, Threads>(table);
  const std::uint8_t* __restrict__ codes = cw.codes(wire, n);
  for (std::size_t b = blockIdx.x; b < cw.blocks(n); b += gridDim.x) {
    const auto [lo, len] = cw.block_span(b, n);
    const float scale = reinterpret_cast<const float*>(wire)[b];
#pragma unroll 4
    for (std::size_t i = threadIdx.x; i < len; i += Threads) {
      const float v = __fmul_rn(table[codes[lo + i]], scale);
      out[lo + i] = add ? __fadd_rn(out[lo + i], v) : v;
    }
  }
}

}  // namespace kernels

// ---- dispatch ------------------------------------------------------------------------------------

// A codec of one wire element per value (fp32, bf16): codec::encode_elements and decode_elements,
// the host's own loops, one index per thread; an identity codec's plain encode and decode copy.
template <codec::elementwise C>
struct codec_kernels<C> {
  static void encode(const C&, const float* x, std::size_t n, std::byte* out, float* residual, cudaStream_t s) {
    if (C::identity && !residual) return check(cudaMemcpyAsync(out, x, n * sizeof(float), cudaMemcpyDefault, s), "encode copy");
    for_each_index(n, codec::encode_elements<C>{x, residual, reinterpret_cast<typename C::element*>(out)}, s, "encode");
  }
  static void decode(const C&, const std::byte* in, std::size_t n, float* out, bool add, cudaStream_t s) {
    if (C::identity && !add) return check(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDefault, s), "decode copy");
    const auto* codes = reinterpret_cast<const typename C::element*>(in);
    for_each_index(n, codec::decode_elements<C>{codes, out, add}, s, add ? "decode_add" : "decode");
  }
};

template <class Format>
struct codec_kernels<codec::blockwise<Format>> {
  using P = codec_policy;
  static void encode(const codec::blockwise<Format>& c, const float* x, std::size_t n, std::byte* out, float* residual,
                     cudaStream_t s) {
    if (!n) return;
    kernels::blockwise_encode<Format, P::block_threads>
        <<<grid_for(c.blocks(n), P::blocks_per_sm), P::block_threads, 0, s>>>(c, x, residual, n, out);
    check_launch("blockwise encode");
  }
  static void decode(const codec::blockwise<Format>& c, const std::byte* in, std::size_t n, float* out, bool add, cudaStream_t s) {
    if (!n) return;
    kernels::blockwise_decode<Format, P::block_threads>
        <<<grid_for(c.blocks(n), P::blocks_per_sm), P::block_threads, 0, s>>>(c, in, n, out, add);
    check_launch(add ? "blockwise decode_add" : "blockwise decode");
  }
};

}  // namespace lockstep::device
