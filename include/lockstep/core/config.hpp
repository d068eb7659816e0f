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
