// lockstep/core/config.hpp: version and the macros every other header relies on.
#pragma once

#define LOCKSTEP_VERSION_MAJOR 0
#define LOCKSTEP_VERSION_MINOR 1
#define LOCKSTEP_VERSION_PATCH 0

// Element math is written once and compiled for both host and device: under nvcc a function marked
// LOCKSTEP_HD is callable from kernels, under a host compiler the marker disappears.
#if defined(__CUDACC__)
#define LOCKSTEP_HD __host__ __device__
#else
#define LOCKSTEP_HD
#endif

// Pointers the compiler may assume do not alias; the host loops only vectorise with this.
#if defined(__CUDACC__) || defined(__GNUC__) || defined(__clang__)
#define LOCKSTEP_RESTRICT __restrict__
#else
#define LOCKSTEP_RESTRICT
#endif

// Host loops with hand-written AVX2 where the compiler's own vectorisation falls short (the 8-bit
// encoders). Not under nvcc: CUDA translation units take the portable loops, which compute the
// same bits (tests/test_codec.cpp compares the two paths).
#if defined(__AVX2__) && !defined(__CUDACC__) && !defined(LOCKSTEP_NO_SIMD)
#define LOCKSTEP_HOST_AVX2 1
#else
#define LOCKSTEP_HOST_AVX2 0
#endif

// The same for AVX-512 (F, BW, VL, DQ and VBMI, whose byte permutes narrow and look up 64 bytes
// at once; dyntree8's tables use DQ's 256-bit broadcasts and inserts, and every CPU with VBMI has
// DQ): the 8-bit encoders and decoders and bf16 take 16-lane loops. LOCKSTEP_NO_AVX512 keeps a
// build on the AVX2 loops (to compare them, or where 512-bit code lowers the clock).
#if LOCKSTEP_HOST_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VBMI__) && !defined(LOCKSTEP_NO_AVX512)
#define LOCKSTEP_HOST_AVX512 1
#else
#define LOCKSTEP_HOST_AVX512 0
#endif

// Ends the optimiser's view of an fp32 (or vector register) value so that it is rounded where it
// stands: a product marked with it is not fused with a later sum into an fma. GCC contracts
// a*b + c across statements by default (-ffp-contract=fast) wherever the target has FMA, so
// without this a build's flags would change the last bit of the codecs' decode_add, which is
// specified as the scalar reference's two roundings (and the CUDA kernels' __fmul_rn, __fadd_rn).
// The empty asm claims to change the value in its register and costs no instruction, but it keeps
// a scalar loop from being unrolled and vectorised as before (decode_add on the portable loop
// lost a third of its speed): such loops are marked LOCKSTEP_NO_FP_CONTRACT instead, a function
// attribute under GCC and a pragma under clang (LOCKSTEP_HAS_NO_FP_CONTRACT 1), and take
// LOCKSTEP_ROUNDED only where there is neither (nvcc's host pass).
#if defined(__CUDA_ARCH__) || !(defined(__GNUC__) || defined(__clang__))
#define LOCKSTEP_ROUNDED(v) ((void)0)
#elif defined(__x86_64__) || defined(__i386__)
#define LOCKSTEP_ROUNDED(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define LOCKSTEP_ROUNDED(v) __asm__("" : "+w"(v))
#else
#define LOCKSTEP_ROUNDED(v) __asm__("" : "+m"(v))
#endif
// LOCKSTEP_NO_FP_CONTRACT marks such a function (GCC: an attribute); LOCKSTEP_FP_CONTRACT_OFF
// opens its body (clang: the pragma, which must come first in a compound statement).
#if defined(__clang__) && !defined(__CUDACC__)
#define LOCKSTEP_NO_FP_CONTRACT
#define LOCKSTEP_FP_CONTRACT_OFF _Pragma("clang fp contract(off)")
#define LOCKSTEP_HAS_NO_FP_CONTRACT 1
#elif defined(__GNUC__) && !defined(__CUDACC__)
#define LOCKSTEP_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#define LOCKSTEP_FP_CONTRACT_OFF
#define LOCKSTEP_HAS_NO_FP_CONTRACT 1
#else
#define LOCKSTEP_NO_FP_CONTRACT
#define LOCKSTEP_FP_CONTRACT_OFF
#define LOCKSTEP_HAS_NO_FP_CONTRACT 0
#endif
