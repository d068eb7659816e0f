// lockstep/device/codec.hpp: every codec's encode, decode and decode-add as CUDA kernels, on
// device buffers, stream ordered.
//
//   device::encode(codec, x, n, wire, stream)                     wire <- codec(x[0..n))
//   device::encode(codec, x, n, wire, stream, residual)           error feedback: v = x + r,
//                                                                 wire <- codec(v), r <- v - decoded
//   device::decode(codec, wire, n, out, stream)                   out <- values(wire)
//   device::decode_add(codec, wire, n, acc, stream)               acc += values(wire)
//
// The wire bytes are the host codec's, bit for bit: the same layout (blockwise.hpp), the same
// element functions (bf16_from_bits, Format::quantize, Format::value), and every product and sum
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
#include <type_traits>

#include "../codec/bf16.hpp"
#include "../codec/blockwise.hpp"
#include "../codec/concept.hpp"
#include "../codec/error_feedback.hpp"
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

// ---- elementwise codecs: fp32, bf16 -------------------------------------------------------------

// One wire element per value: W::encode is a value's code, W::value a code's value.
struct fp32_wire {
  using code = float;
  static constexpr const char *encode_op = "fp32 encode", *decode_op = "fp32 decode", *decode_add_op = "fp32 decode_add";
  __device__ static float encode(float v) { return v; }
  __device__ static float value(float c) { return c; }  // so the residual is v - v: an exact codec's
};
struct bf16_wire {
  using code = std::uint16_t;
  static constexpr const char *encode_op = "bf16 encode", *decode_op = "bf16 decode", *decode_add_op = "bf16 decode";
  __device__ static std::uint16_t encode(float v) { return codec::bf16_from_bits(__float_as_uint(v)); }
  __device__ static float value(std::uint16_t h) { return __uint_as_float(codec::bf16_to_bits(h)); }
};

// out[i] <- code of v, v = x[i]; with a residual (else null) v = x + r and r <- v - value(code).
template <class W>
struct encode_elements {
  const float* __restrict__ x;
  float* __restrict__ residual;
  typename W::code* __restrict__ out;
  __device__ void operator()(std::size_t i) const {
    const float v = residual ? __fadd_rn(x[i], residual[i]) : x[i];
    const typename W::code c = W::encode(v);
    out[i] = c;
    if (residual) residual[i] = __fsub_rn(v, W::value(c));
  }
};

// out[i] <- value(in[i]), or out[i] += it when `add`.
template <class W>
struct decode_elements {
  const typename W::code* __restrict__ in;
  float* __restrict__ out;
  bool add;
  __device__ void operator()(std::size_t i) const {
    const float v = W::value(in[i]);
    out[i] = add ? __fadd_rn(out[i], v) : v;
  }
};

// ---- blockwise codecs: one fp32 absmax scale per block of values --------------------------------

// The 256 decoded unit values of a Format in shared memory, built by each CUDA block from
// Format::value, the function the host's blockwise::table() is built from.
template <class Format, int Threads>
__device__ void fill_table(float* table) {
  for (int c = threadIdx.x; c < 256; c += Threads) table[c] = Format::value(static_cast<std::uint8_t>(c));
  __syncthreads();
}

// One CUDA block per codec block, grid-stride over the codec blocks. A thread keeps its first
// `Items` values in registers between the absmax and the quantisation, so a codec block of up to
// Threads * Items values is read from memory once. residual may be null (no error feedback).
template <class Format, int Threads, int Items>
__global__ void __launch_bounds__(Threads)
blockwise_encode(const float* __restrict__ x, float* __restrict__ residual, std::size_t n, std::size_t block,
                 std::size_t nb, float* __restrict__ scales, std::uint8_t* __restrict__ codes) {
  using absmax = block_absmax<Threads>;
  __shared__ typename absmax::storage red;
  __shared__ float table[256];
  if (residual) fill_table<Format, Threads>(table);  // only error feedback decodes while encoding
  auto load = [&](std::size_t i) { return residual ? __fadd_rn(x[i], residual[i]) : x[i]; };

  for (std::size_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const std::size_t lo = b * block, len = (n - lo < block) ? n - lo : block;
    float v[Items];
    std::uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < Items; ++k) {
      const std::size_t i = threadIdx.x + std::size_t(k) * Threads;
      v[k] = i < len ? load(lo + i) : 0.0f;
      m = max(m, absmax::bits(v[k]));
    }
    for (std::size_t i = threadIdx.x + std::size_t(Items) * Threads; i < len; i += Threads) m = max(m, absmax::bits(load(lo + i)));
    const float scale = absmax::scale(absmax::reduce(red, m));
    if (threadIdx.x == 0) scales[b] = scale;

    // As blockwise::quantize_block: an all-zero or non-finite block carries no codes.
    const bool live = codec::block_scale_carries(scale);  // the host encoder's rule (blockwise.hpp)
    const float inv = live ? __fdiv_rn(1.0f, scale) : 0.0f;
    auto emit = [&](std::size_t i, float vi) {
      const std::uint8_t c = live ? Format::quantize(__fmul_rn(vi, inv)) : std::uint8_t{0};
      codes[lo + i] = c;
      if (residual) residual[lo + i] = __fsub_rn(vi, __fmul_rn(table[c], scale));
    };
#pragma unroll
    for (int k = 0; k < Items; ++k) {
      const std::size_t i = threadIdx.x + std::size_t(k) * Threads;
      if (i < len) emit(i, v[k]);
    }
    for (std::size_t i = threadIdx.x + std::size_t(Items) * Threads; i < len; i += Threads) emit(i, load(lo + i));
  }
}

template <class Format, bool Add, int Threads>
__global__ void __launch_bounds__(Threads)
blockwise_decode(const float* __restrict__ scales, const std::uint8_t* __restrict__ codes, std::size_t n,
                 std::size_t block, std::size_t nb, float* __restrict__ out) {
  __shared__ float table[256];
  fill_table<Format, Threads>(table);
  for (std::size_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const std::size_t lo = b * block, len = (n - lo < block) ? n - lo : block;
    const float scale = scales[b];
#pragma unroll 4
    for (std::size_t i = threadIdx.x; i < len; i += Threads) {
      const float v = __fmul_rn(table[codes[lo + i]], scale);
      out[lo + i] = Add ? __fadd_rn(out[lo + i], v) : v;
    }
  }
}

}  // namespace kernels

// ---- dispatch ------------------------------------------------------------------------------------

// fp32 and bf16: elementwise kernels over W; an identity codec's plain encode and decode copy.
template <class C, class W>
struct elementwise_codec_kernels {
  static void encode(const C&, const float* x, std::size_t n, std::byte* out, float* residual, cudaStream_t s) {
    if (C::identity && !residual) {
      if (n) check(cudaMemcpyAsync(out, x, n * sizeof(float), cudaMemcpyDeviceToDevice, s), W::encode_op);
      return;
    }
    for_each_index(n, kernels::encode_elements<W>{x, residual, reinterpret_cast<typename W::code*>(out)}, s, W::encode_op);
  }
  static void decode(const C&, const std::byte* in, std::size_t n, float* out, bool add, cudaStream_t s) {
    if (C::identity && !add) {
      if (n) check(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, s), W::decode_op);
      return;
    }
    const auto* codes = reinterpret_cast<const typename W::code*>(in);
    for_each_index(n, kernels::decode_elements<W>{codes, out, add}, s, add ? W::decode_add_op : W::decode_op);
  }
};
template <>
struct codec_kernels<codec::fp32> : elementwise_codec_kernels<codec::fp32, kernels::fp32_wire> {};
template <>
struct codec_kernels<codec::bf16> : elementwise_codec_kernels<codec::bf16, kernels::bf16_wire> {};

template <class Format>
struct codec_kernels<codec::blockwise<Format>> {
  using P = codec_policy;
  static void encode(const codec::blockwise<Format>& c, const float* x, std::size_t n, std::byte* out, float* residual,
                     cudaStream_t s) {
    if (!n) return;
    const std::size_t nb = c.blocks(n);
    kernels::blockwise_encode<Format, P::block_threads, P::items><<<grid_for(nb, P::blocks_per_sm), P::block_threads, 0, s>>>(
        x, residual, n, c.block(), nb, reinterpret_cast<float*>(out), reinterpret_cast<std::uint8_t*>(out) + nb * sizeof(float));
    check_launch("blockwise encode");
  }
  static void decode(const codec::blockwise<Format>& c, const std::byte* in, std::size_t n, float* out, bool add, cudaStream_t s) {
    if (!n) return;
    const std::size_t nb = c.blocks(n);
    const auto* scales = reinterpret_cast<const float*>(in);
    const auto* codes = reinterpret_cast<const std::uint8_t*>(in) + nb * sizeof(float);
    const unsigned grid = grid_for(nb, P::blocks_per_sm);
    if (add) kernels::blockwise_decode<Format, true, P::block_threads><<<grid, P::block_threads, 0, s>>>(scales, codes, n, c.block(), nb, out);
    else kernels::blockwise_decode<Format, false, P::block_threads><<<grid, P::block_threads, 0, s>>>(scales, codes, n, c.block(), nb, out);
    check_launch("blockwise decode");
  }
};

// Error feedback on the wire is its inner codec; the residual lives wherever the caller keeps it.
template <class C>
struct codec_kernels<codec::error_feedback<C>> {
  static void encode(const codec::error_feedback<C>& c, const float* x, std::size_t n, std::byte* out, float* residual,
                     cudaStream_t s) {
    codec_kernels<C>::encode(c.inner(), x, n, out, residual, s);
  }
  static void decode(const codec::error_feedback<C>& c, const std::byte* in, std::size_t n, float* out, bool add, cudaStream_t s) {
    codec_kernels<C>::decode(c.inner(), in, n, out, add, s);
  }
};

// ---- the calls -----------------------------------------------------------------------------------

template <codec::codec C>
void encode(const C& c, const float* x, std::size_t n, std::byte* wire, cudaStream_t s, float* residual = nullptr) {
  codec_kernels<std::remove_cvref_t<C>>::encode(c, x, n, wire, residual, s);
}
template <codec::codec C>
void decode(const C& c, const std::byte* wire, std::size_t n, float* out, cudaStream_t s) {
  codec_kernels<std::remove_cvref_t<C>>::decode(c, wire, n, out, false, s);
}
template <codec::codec C>
void decode_add(const C& c, const std::byte* wire, std::size_t n, float* acc, cudaStream_t s) {
  codec_kernels<std::remove_cvref_t<C>>::decode(c, wire, n, acc, true, s);
}

}  // namespace lockstep::device
