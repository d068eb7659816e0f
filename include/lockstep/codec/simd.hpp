// lockstep/codec/simd.hpp: the intrinsics the host codec loops use, where config.hpp enables them.
#pragma once

#include "../core/config.hpp"

#if LOCKSTEP_HOST_AVX2 || LOCKSTEP_HOST_AVX512
// GCC 12 warns (-W[maybe-]uninitialized, its bug 105593) inside its own AVX-512 intrinsics when
// they are inlined at -O3; the warning's location is the intrinsics header, whose lines take the
// diagnostic state in force where it is first included.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
