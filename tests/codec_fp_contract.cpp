// tests/codec_fp_contract.cpp: decode_add rounds twice, acc + fl(value * scale), under a build that
// fuses wherever the compiler may (clang -ffp-contract=fast, which ignores `#pragma clang fp
// contract(off)`). Built by tests/fuzz/meson.build with the clang found there, once per ISA path
// (AVX-512, AVX2, the portable loop on a target with FMA, and AVX-512 without DQ, which must build
// and take the AVX2 loops: core/config.hpp); no Catch2, so that nothing but this file is compiled by
// clang. Exits 1 naming the first value that differs, 77 where the CPU lacks the variant's ISA.
#include <lockstep/codec.hpp>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

template <class C>
static int check(const char* name) {
  std::mt19937 gen(20261207);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> acc_dist(-4.0f, 4.0f);
  C c;
  int bad = 0;
  // Sizes around the loops' widths (8, 16, 32, 64) and the block size, and a prime.
  for (std::size_t n : {1u, 7u, 8u, 9u, 15u, 17u, 63u, 64u, 65u, 511u, 512u, 513u, 1021u, 4099u}) {
    std::vector<float> x(n), acc(n), decoded(n);
    for (auto& v : x) v = normal(gen);
    for (auto& v : acc) v = acc_dist(gen);
    std::vector<std::byte> wire(c.wire_bytes(n));
    c.encode(x.data(), n, wire.data());
    c.decode(wire.data(), n, decoded.data());  // value * scale: one rounding, nothing to fuse
    std::vector<float> got = acc;
    c.decode_add(wire.data(), n, got.data());
    for (std::size_t i = 0; i < n; ++i) {
      volatile float sum = acc[i];
      sum = sum + decoded[i];  // the second rounding, apart from the first
      if (std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(static_cast<float>(sum)) && bad++ == 0)
        std::printf("%s n=%zu i=%zu: acc %a + decoded %a: decode_add gave %a, two roundings give %a\n", name, n, i,
                    acc[i], decoded[i], got[i], static_cast<float>(sum));
    }
  }
  std::printf("%s: %d values differ\n", name, bad);
  return bad;
}

int main() {
  // A variant built for more than this CPU has (the no-DQ build on an AVX2 machine) is skipped.
#if defined(__AVX512F__)
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return std::printf("skipped: no AVX-512\n"), 77;
#endif
#if defined(__AVX512VBMI__)
  if (!__builtin_cpu_supports("avx512vbmi")) return std::printf("skipped: no AVX-512 VBMI\n"), 77;
#endif
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return std::printf("skipped: no AVX2\n"), 77;
#endif
#if LOCKSTEP_HOST_AVX512
  std::printf("path: AVX-512\n");
#elif LOCKSTEP_HOST_AVX2
  std::printf("path: AVX2\n");
#else
  std::printf("path: portable\n");
#endif
  const int bad = check<lockstep::codec::int8>("int8") + check<lockstep::codec::dyntree8>("dyntree8") +
                  check<lockstep::codec::bf16>("bf16");
  return bad ? 1 : 0;
}
