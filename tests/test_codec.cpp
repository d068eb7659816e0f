// Codecs: bit-level format checks, round-trip error bounds, exact 0 and +-absmax, non-finite
// blocks, decode_add == acc + decode, error feedback. Seeded inputs throughout.
#include <lockstep/codec.hpp>

#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#if LOCKSTEP_HOST_AVX2 || LOCKSTEP_HOST_AVX512
#include <immintrin.h>
#endif
#if defined(__SSE__) && !defined(__CUDACC__)
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr: FTZ and DAZ
#endif

using namespace lockstep;

namespace {

// bf16 reference written from the definition: of the two bf16 neighbours of x, the nearer one;
// on a tie the one with an even last bit. Compared in double, independent of the bit trick.
std::uint16_t bf16_reference(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if (std::isnan(x)) return 0;  // checked separately
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return lo;
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dx = x;
  const double dlo = std::bit_cast<float>(static_cast<std::uint32_t>(lo) << 16);
  const float fhi = std::bit_cast<float>(static_cast<std::uint32_t>(hi) << 16);
  // hi may be Inf when x is near FLT_MAX: the midpoint is then 2^128 - 2^103 (fp32's overflow rule).
  const double dhi = std::isinf(fhi) ? std::ldexp(1.0, 128) * (fhi > 0 ? 1 : -1) : double(fhi);
  const double a = std::abs(dx - dlo), b = std::abs(dhi - dx);
  if (a < b) return lo;
  if (b < a) return hi;
  return (lo & 1) ? hi : lo;
}

std::vector<float> normal(std::size_t n, std::uint32_t seed, float sigma = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// The absolute error one dyntree8 code may make for |u| = |x| / absmax (half its bin's width).
double dyntree8_bound(double u) {
  u = std::abs(u);
  if (u < 1e-7) return 1e-7;
  if (u >= 1.0 - 0.9 / 64) return 0.9 / 64;  // the top bin decodes to 1
  int k = 0;
  double p = 1.0;
  while (k < 6 && u < 0.1 * p) ++k, p *= 0.1;
  return 0.9 / (1 << (6 - k)) / 2 * p;
}

template <class C>
std::vector<float> roundtrip(const C& c, const std::vector<float>& x) {
  std::vector<std::byte> w(c.wire_bytes(x.size()));
  std::vector<float> y(x.size());
  c.encode(x.data(), x.size(), w.data());
  c.decode(w.data(), x.size(), y.data());
  return y;
}

}  // namespace

TEST_CASE("bf16 rounds to nearest even on random bit patterns and edge cases", "[codec][bf16]") {
  std::mt19937 g(7);
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x3f800000u, 0x3f808000u, 0x3f818000u,
                                     0x3f80ffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x00000001u,
                                     0x807fffffu, 0x7f800000u, 0xff800000u};
  for (int i = 0; i < 200000; ++i) bits.push_back(g());
  for (std::uint32_t u : bits) {
    const float x = std::bit_cast<float>(u);
    const std::uint16_t h = codec::bf16_from_bits(u);
    if (std::isnan(x)) {
      CHECK(std::isnan(std::bit_cast<float>(codec::bf16_to_bits(h))));
      continue;
    }
    INFO("x bits " << std::hex << u);
    CHECK(h == bf16_reference(x));
  }
  CHECK(codec::bf16_from_bits(0x3f808000u) == 0x3f80);  // tie, even stays
  CHECK(codec::bf16_from_bits(0x3f818000u) == 0x3f82);  // tie, odd rounds up
  CHECK(codec::bf16_from_bits(0x7f7fffffu) == 0x7f80);  // FLT_MAX rounds to +Inf
  CHECK(codec::bf16_from_bits(0x7f800000u) == 0x7f80);  // +Inf stays
  CHECK(codec::bf16_from_bits(0xff800000u) == 0xff80);  // -Inf stays
  CHECK(codec::bf16_from_bits(0x7fffffffu) == 0x7fff);  // NaN with all mantissa bits stays NaN
  CHECK(codec::bf16_from_bits(0x7f800001u) == 0x7fc0);  // signalling NaN becomes quiet, never Inf
}

TEST_CASE("bf16 codec round trip is within half an ulp and keeps specials", "[codec][bf16]") {
  codec::bf16 c;
  auto x = normal(10007, 1);
  x[0] = std::numeric_limits<float>::infinity();
  x[1] = -std::numeric_limits<float>::infinity();
  x[2] = std::numeric_limits<float>::quiet_NaN();
  x[3] = 0.0f;
  x[4] = -0.0f;
  auto y = roundtrip(c, x);
  CHECK(std::isinf(y[0]));
  CHECK(y[0] > 0);
  CHECK(std::isinf(y[1]));
  CHECK(y[1] < 0);
  CHECK(std::isnan(y[2]));
  CHECK(y[3] == 0.0f);
  CHECK(std::signbit(y[4]));
  for (std::size_t i = 5; i < x.size(); ++i) CHECK(std::abs(y[i] - x[i]) <= std::ldexp(std::abs(x[i]), -8));
  CHECK(c.wire_bytes(10) == 24);
}

TEST_CASE("dyntree8 code book is Dettmers' dynamic tree", "[codec][dyntree8]") {
  using f = codec::dyntree8_format;
  // Count the positive values per decade: 64, 32, 16, 8, 4, 2, 1 (the top code is pinned to 1).
  int per_decade[7] = {};
  for (int c = 1; c < 128; ++c) {
    const double v = f::value(static_cast<std::uint8_t>(c));
    REQUIRE(v > 0);
    int k = 0;
    double p = 1.0;
    while (v < 0.1 * p) ++k, p *= 0.1;
    REQUIRE(k <= 6);
    ++per_decade[k];
    CHECK(f::value(static_cast<std::uint8_t>(c | 0x80)) == -f::value(static_cast<std::uint8_t>(c)));
  }
  const int expected[7] = {64, 32, 16, 8, 4, 2, 1};
  for (int k = 0; k < 7; ++k) CHECK(per_decade[k] == expected[k]);
  // Bit layout: magnitude 0b1000000 is the first bin of [0.1, 1), 0b0000001 the lone 1e-6 bin.
  CHECK(f::value(0x40) == Approx(0.1 + 0.9 / 128).epsilon(1e-7));
  CHECK(f::value(0x01) == Approx(0.55e-6).epsilon(1e-7));
  CHECK(f::value(0x20) == Approx((0.1 + 0.9 / 64) * 0.1).epsilon(1e-7));
  CHECK(f::value(0x7f) == 1.0f);
  CHECK(f::value(0x00) == 0.0f);
  // Every code's value encodes back to that code: midpoints lie inside their own bins.
  for (int c = 0; c < 256; ++c) {
    if (c == 0x80) continue;  // negative zero: decodes to 0, which encodes to 0x00
    CHECK(f::quantize(f::value(static_cast<std::uint8_t>(c))) == c);
  }
  // Magnitudes are ordered like their codes.
  for (int c = 1; c < 127; ++c) CHECK(f::value(static_cast<std::uint8_t>(c)) < f::value(static_cast<std::uint8_t>(c + 1)));
}

TEST_CASE("dyntree8 puts every unit value within half a bin of its decade", "[codec][dyntree8]") {
  // Decade k by the encoder's own thresholds (float(10^-j)); half a bin of decade k is
  // 0.9 / 2^(6-k) / 2 * 10^-k. A value at a bin edge may take either neighbour, so the bound
  // allows half a bin plus the edge's fp32 fuzz (2^-20 |u|, against a decade's bins of 1.4% and
  // more). The top magnitude 0x7f decodes to 1, not its midpoint: within the whole top bin, 0.9/64.
  // Below 1e-7 a value is sent as 0, or near 1e-7 as the lone 0.55e-6 code.
  using f = codec::dyntree8_format;
  const auto& table = codec::dyntree8::table();
  const float thresholds[6] = {1e-1f, 1e-2f, 1e-3f, 1e-4f, 1e-5f, 1e-6f};
  double half_bin[7];
  for (int k = 0; k < 7; ++k) half_bin[k] = 0.9 / double(1 << (6 - k)) / 2 * std::pow(10.0, -k);
  std::size_t bad = 0;
  float first_bad = 0;
  for (std::uint32_t b = 0; b <= 0x3f800000u; b += 3) {
    const float u = std::bit_cast<float>(b);
    int k = 0;
    for (float t : thresholds) k += u < t;
    const std::uint8_t c = f::quantize(u);
    // The top bin by u, not by its code: the nearest code of u in [1 - 0.9/64, 0.98945) is 0x7e.
    const double bound = (u >= 1 - 0.9 / 64 ? 0.9 / 64 : half_bin[k]) + std::ldexp(double(u), -20);
    if (std::abs(double(table[c]) - double(u)) > bound && bad++ == 0) first_bad = u;
  }
  INFO("first value outside its bound: " << first_bad);
  CHECK(bad == 0);
}

namespace {

// dyntree8's boundaries from value() alone: sums[m - 1] = value(m - 1) + value(m) for m = 1..127,
// exact in double. The nearest magnitude of |u| (ties to the smaller) is the count of sums below
// 2|u|.
std::vector<double> dyntree8_sums() {
  using f = codec::dyntree8_format;
  std::vector<double> sums;
  for (int m = 1; m < 128; ++m) sums.push_back(double(f::value(std::uint8_t(m - 1))) + double(f::value(std::uint8_t(m))));
  return sums;
}
std::uint8_t dyntree8_nearest(const std::vector<double>& sums, float u) {
  const double twice = 2.0 * std::abs(double(u));
  const auto mag = std::lower_bound(sums.begin(), sums.end(), twice) - sums.begin();
  return static_cast<std::uint8_t>(mag | (std::signbit(u) ? 0x80 : 0));
}

// Every dyntree8 encoder path over the units x[0..n): the scalar code() (device kernels use it),
// its two halves, the block encoder as compiled here and its portable loop, and each hand-written
// SIMD routine this build has. Returns the number of values where one differs from want.
std::size_t dyntree8_path_mismatches(const std::vector<float>& x, const std::vector<std::uint8_t>& want, std::string& first) {
  using f = codec::dyntree8_format;
  using b = codec::dyntree8;
  const std::size_t n = x.size();
  std::vector<std::pair<std::string, std::vector<std::uint8_t>>> got;
  got.reserve(32);  // path() hands out references into it: no reallocation may move them
  auto path = [&](std::string name) -> std::vector<std::uint8_t>& { return got.emplace_back(std::move(name), std::vector<std::uint8_t>(n)).second; };
  {
    auto& c = path("code");
    auto& e = path("exact");
    auto& s = path("estimate where not near");
    for (std::size_t i = 0; i < n; ++i) {
      c[i] = f::quantize(x[i]);
      e[i] = static_cast<std::uint8_t>(f::exact(x[i]));
      const std::uint32_t est = f::estimate(x[i]);
      s[i] = (est & f::near_bit) ? want[i] : static_cast<std::uint8_t>(est);
    }
  }
  b::quantize_block(x.data(), n, 1.0f, path("quantize_block").data());
  b::quantize_portable(x.data(), n, 1.0f, path("quantize_portable").data());
#if LOCKSTEP_HOST_AVX2
  {
    auto& v = path("codes32 (AVX2)");
    for (std::size_t i = 0; i + 32 <= n; i += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v.data() + i), f::codes32(x.data() + i, _mm256_set1_ps(1.0f)));
    for (std::size_t i = n / 32 * 32; i < n; ++i) v[i] = want[i];
  }
#endif
#if LOCKSTEP_HOST_AVX512
  {
    auto& v = path("codes64 (AVX-512)");
    for (std::size_t i = 0; i + 64 <= n; i += 64) _mm512_storeu_si512(v.data() + i, f::codes64(x.data() + i, _mm512_set1_ps(1.0f)));
    for (std::size_t i = n / 64 * 64; i < n; ++i) v[i] = want[i];
  }
#endif
  std::size_t bad = 0;
  for (auto& [name, c] : got)
    for (std::size_t i = 0; i < n; ++i)
      if (c[i] != want[i] && bad++ == 0)
        first = name + " at bits " + std::to_string(std::bit_cast<std::uint32_t>(x[i])) + ": " + std::to_string(c[i]) +
                " instead of " + std::to_string(want[i]);
  return bad;
}

}  // namespace

TEST_CASE("dyntree8 takes the nearest code at every boundary, ties to the smaller magnitude", "[codec][dyntree8]") {
  // For each two adjacent magnitudes m - 1, m: the float just below their midpoint, the midpoint
  // itself where it is a float (a tie), the float just above, and one more step out on each side,
  // against a brute-force nearest over all 128 values; and both signs through every path.
  using f = codec::dyntree8_format;
  const auto& table = codec::dyntree8::table();
  auto brute = [&](float u) {
    int best = 0;
    for (int c = 1; c < 128; ++c)
      if (std::abs(double(u) - table[c]) < std::abs(double(u) - table[best])) best = c;  // strict: ties keep the smaller
    return best;
  };
  std::vector<float> probes;
  std::vector<std::uint8_t> want;
  std::vector<std::uint32_t> first_above;  // the smallest float taking m, per m = 1..127
  int ties = 0;
  for (int m = 1; m < 128; ++m) {
    const double sum = double(table[m - 1]) + double(table[m]);
    float below = static_cast<float>(sum / 2);
    while (2.0 * double(below) >= sum) below = std::nextafter(below, 0.0f);
    while (2.0 * double(std::nextafter(below, 2.0f)) < sum) below = std::nextafter(below, 2.0f);
    const float next = std::nextafter(below, 2.0f);
    const bool tie = 2.0 * double(next) == sum;
    ties += tie;
    const float above = tie ? std::nextafter(next, 2.0f) : next;
    first_above.push_back(std::bit_cast<std::uint32_t>(above));
    INFO("magnitudes " << m - 1 << " | " << m << ", midpoint " << sum / 2);
    for (float u : {std::nextafter(below, 0.0f), below}) {
      CHECK(brute(u) == m - 1);
      probes.push_back(u), want.push_back(static_cast<std::uint8_t>(m - 1));
    }
    if (tie) {
      CHECK(brute(next) == m - 1);  // the brute force's strict compare keeps the smaller on a tie
      probes.push_back(next), want.push_back(static_cast<std::uint8_t>(m - 1));
    }
    for (float u : {above, std::nextafter(above, 2.0f)}) {
      CHECK(brute(u) == m);
      probes.push_back(u), want.push_back(static_cast<std::uint8_t>(m));
    }
  }
  CHECK(ties == 56);  // the tie rule is exercised
  // The boundaries that are no bin edge, which the encoders compare with directly.
  const int edge_of[8] = {1, 2, 4, 8, 16, 32, 64, 127};
  for (int i = 0; i < 8; ++i) CHECK(std::uint32_t(f::edge_bits[i]) == first_above[edge_of[i] - 1]);
  // The midpoints from the issue: 0.1 takes 0.0986 (0x3f), not 0.1070 (0x40).
  CHECK(f::quantize(0.1f) == 0x3f);
  CHECK(f::quantize(0.98f) == 0x7e);
  CHECK(f::quantize(0.99f) == 0x7f);
  CHECK(f::quantize(2e-7f) == 0x00);
  CHECK(f::quantize(-3e-7f) == 0x81);
  const std::size_t n = probes.size();
  for (std::size_t i = 0; i < n; ++i) probes.push_back(-probes[i]), want.push_back(want[i] | 0x80);
  std::string first;
  CHECK(dyntree8_path_mismatches(probes, want, first) == 0);
  INFO(first);
  CHECK(first == "");
}

TEST_CASE("dyntree8 encodes every unit value to its nearest code", "[codec][dyntree8]") {
  // Every fp32 pattern from 0 to a little above 1 (the rounding of x / absmax can exceed 1 by an
  // ulp), in ascending order, so that the reference magnitude only steps up, through the block
  // encoder as compiled; the sweep below it checks that every path gives the same bits.
  const auto sums = dyntree8_sums();
  constexpr std::size_t batch = 1 << 20;
  std::vector<float> x(batch);
  std::vector<std::uint8_t> got(batch);
  std::size_t bad = 0, mag = 0;
  std::uint32_t first_bad = 0;
  for (std::uint64_t lo = 0; lo <= 0x3f800010u; lo += batch) {
    std::size_t n = 0;
    for (std::uint64_t b = lo; b <= 0x3f800010u && n < batch; ++b) x[n++] = std::bit_cast<float>(static_cast<std::uint32_t>(b));
    codec::dyntree8::quantize_block(x.data(), n, 1.0f, got.data());
    for (std::size_t i = 0; i < n; ++i) {
      while (mag < sums.size() && sums[mag] < 2.0 * double(x[i])) ++mag;
      if (got[i] != mag && bad++ == 0) first_bad = std::bit_cast<std::uint32_t>(x[i]);
    }
  }
  INFO("first value not at its nearest code: bits " << first_bad);
  CHECK(bad == 0);
}

TEST_CASE("dyntree8 encoder paths agree bit for bit on random and adversarial units", "[codec][dyntree8]") {
  const auto sums = dyntree8_sums();
  std::mt19937 g(2024);
  std::vector<float> x;
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f), expo(-9.0f, 0.0f);
  std::normal_distribution<float> nd;
  for (int i = 0; i < 200000; ++i) x.push_back(uni(g));
  for (int i = 0; i < 200000; ++i) x.push_back(std::clamp(nd(g) / 4.0f, -1.0f, 1.0f));
  for (int i = 0; i < 200000; ++i) x.push_back((g() & 1 ? -1.0f : 1.0f) * std::pow(10.0f, expo(g)));  // every decade
  // Adversarial: 40 floats around every boundary and every power of ten, in runs, so that whole
  // turns of the vector encoders go the slow way; and the ends.
  const auto& table = codec::dyntree8::table();
  std::vector<float> centres;
  for (int m = 1; m < 128; ++m) centres.push_back(static_cast<float>((double(table[m - 1]) + double(table[m])) / 2));
  for (int k = 0; k <= 8; ++k) centres.push_back(static_cast<float>(std::pow(10.0, -k)));
  for (int m = 0; m < 128; ++m) centres.push_back(table[m]);
  for (float c : centres) {
    float v = c;
    for (int i = 0; i < 20; ++i) v = std::nextafter(v, 0.0f);
    for (int i = 0; i < 40; ++i, v = std::nextafter(v, 2.0f)) x.push_back(v), x.push_back(-v);
  }
  for (float v : {0.0f, -0.0f, 1.0f, -1.0f, std::nextafter(1.0f, 2.0f), -std::nextafter(1.0f, 2.0f), 1e-45f, -1e-45f,
                  1.17549435e-38f, 1e-30f, std::nextafter(1.0f, 0.0f)})
    x.push_back(v);
  std::shuffle(x.begin() + 600000, x.end(), g);  // adversarial values mixed into turns with ordinary ones
  std::vector<std::uint8_t> want(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) want[i] = dyntree8_nearest(sums, x[i]);
  std::string first;
  const std::size_t bad = dyntree8_path_mismatches(x, want, first);
  INFO(first);
  CHECK(bad == 0);
  // The estimate sends few ordinary values the slow way (the encoders' speed depends on it).
  std::size_t near = 0;
  for (std::size_t i = 0; i < 600000; ++i) near += (codec::dyntree8_format::estimate(x[i]) & codec::dyntree8_format::near_bit) != 0;
  INFO(near << " of 600000 flagged");
  CHECK(near < 600000 / 2000);
  // Whole blocks with their own scales: the encoded codes are the nearest codes of x * (1 / absmax).
  codec::dyntree8 c;
  auto y = normal(5000, 9, 3.0f);
  std::vector<std::byte> w(c.wire_bytes(y.size()));
  c.encode(y.data(), y.size(), w.data());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const float inv = 1.0f / codec::dyntree8::absmax(y.data() + i / 512 * 512, std::min<std::size_t>(512, y.size() - i / 512 * 512));
    wrong += std::to_integer<std::uint8_t>(w[c.blocks(y.size()) * 4 + i]) != dyntree8_nearest(sums, y[i] * inv);
  }
  CHECK(wrong == 0);
}

// The block encoder may take a hand-vectorised path (LOCKSTEP_HOST_AVX2: Format::codes32); it must
// give Format::code()'s bits for every unit value an encoder can see. With scale 1 the unit is the
// input itself, so sweeping inputs sweeps units: every float pattern from 0 to a little above 1
// (the rounding of x / absmax can exceed 1 by an ulp), and negatives on a stride.
TEMPLATE_TEST_CASE("8-bit block encoders give Format::code's bits for every unit value", "[codec]",
                   codec::dyntree8_format, codec::linear8_format) {
  using F = TestType;
  constexpr std::size_t batch = 1 << 20;
  std::vector<float> x(batch);
  std::vector<std::uint8_t> got(batch);
  auto sweep = [&](std::uint32_t first, std::uint32_t last, std::uint32_t stride, std::uint32_t sign) {
    std::size_t mismatches = 0;
    std::uint32_t first_bad = 0;
    for (std::uint64_t lo = first; lo <= last; lo += std::uint64_t{batch} * stride) {
      std::size_t n = 0;
      for (std::uint64_t b = lo; b <= last && n < batch; b += stride) x[n++] = std::bit_cast<float>(static_cast<std::uint32_t>(b) | sign);
      codec::blockwise<F>::quantize_block(x.data(), n, 1.0f, got.data());
      for (std::size_t i = 0; i < n; ++i)
        if (got[i] != static_cast<std::uint8_t>(F::code(x[i])) && mismatches++ == 0) first_bad = std::bit_cast<std::uint32_t>(x[i]);
      // Each hand-written routine this build has, also where quantize_block takes another (the
      // zero-padded tail as quantize_block pads it).
      auto direct = [&](auto codes_of, std::size_t w) {
        std::vector<float> in(w);
        std::vector<std::uint8_t> out(w);
        for (std::size_t i = 0; i < n; i += w) {
          std::fill(in.begin(), in.end(), 0.0f);
          std::copy(x.begin() + i, x.begin() + std::min(n, i + w), in.begin());
          codes_of(in.data(), out.data());
          for (std::size_t j = 0; j < w && i + j < n; ++j)
            if (out[j] != static_cast<std::uint8_t>(F::code(x[i + j])) && mismatches++ == 0)
              first_bad = std::bit_cast<std::uint32_t>(x[i + j]);
        }
      };
#if LOCKSTEP_HOST_AVX2
      direct([](const float* in, std::uint8_t* out) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), F::codes32(in, _mm256_set1_ps(1.0f)));
      }, 32);
#endif
#if LOCKSTEP_HOST_AVX512
      direct([](const float* in, std::uint8_t* out) { _mm512_storeu_si512(out, F::codes64(in, _mm512_set1_ps(1.0f))); }, 64);
#endif
      (void)direct;
    }
    INFO(F::name << ": first mismatch at bit pattern " << first_bad << " (AVX2 " << LOCKSTEP_HOST_AVX2 << ", AVX-512 "
                 << LOCKSTEP_HOST_AVX512 << ")");
    CHECK(mismatches == 0);
  };
  sweep(0, 0x3f800010u, 1, 0);                    // every non-negative unit
  sweep(0, 0x3f800010u, 101, 0x80000000u);        // negatives on a stride
  // Every length of the tail that does not fill a turn of 32 (it goes through a padded copy).
  for (std::uint32_t len = 1; len < 64; ++len) sweep(0x3d000000u, 0x3d000000u + len - 1, 1, len % 2 ? 0x80000000u : 0);
}

TEMPLATE_TEST_CASE("8-bit decoders give table() * scale bit for bit, for every code and odd lengths", "[codec]",
                   codec::int8, codec::dyntree8) {
  // decode and decode_add may take a hand-vectorised path (LOCKSTEP_HOST_AVX512: values64);
  // out = table[code] * scale and acc + table[code] * scale exactly, with tails of every length.
  const auto& table = TestType::table();
  for (std::size_t block : {std::size_t{512}, std::size_t{64}, std::size_t{37}, std::size_t{100}}) {
    TestType c(block);
    const std::size_t n = 3 * block + 61;
    std::vector<std::byte> wire(c.wire_bytes(n));
    const std::size_t nb = c.blocks(n);
    std::vector<float> scale(nb);
    for (std::size_t b = 0; b < nb; ++b) scale[b] = std::ldexp(1.2345f + 0.37f * float(b), int(b) - 2);
    std::memcpy(wire.data(), scale.data(), nb * sizeof(float));
    for (std::size_t i = 0; i < n; ++i) wire[nb * sizeof(float) + i] = std::byte(static_cast<std::uint8_t>((i * 37 + block) & 0xff));
    std::vector<float> out(n), acc = normal(n, 17), sum = acc;
    c.decode(wire.data(), n, out.data());
    c.decode_add(wire.data(), n, sum.data());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float v = table[std::to_integer<std::uint8_t>(wire[nb * sizeof(float) + i])] * scale[i / block];
      LOCKSTEP_ROUNDED(v);  // this reference rounds twice too, under test_codec_avx2's -ffp-contract=fast
      bad += std::bit_cast<std::uint32_t>(out[i]) != std::bit_cast<std::uint32_t>(v);
      bad += std::bit_cast<std::uint32_t>(sum[i]) != std::bit_cast<std::uint32_t>(acc[i] + v);
    }
    INFO("block " << block);
    CHECK(bad == 0);
  }
}

TEST_CASE("bf16 codec gives bf16_from_bits for every bit pattern on a stride, and decodes every code", "[codec][bf16]") {
  // The codec's loops may be hand-vectorised (LOCKSTEP_HOST_AVX512); they must give the element
  // function's bits: every 3rd pattern of all 2^32 (subnormals, ties, NaNs and Infs among them),
  // and every pattern whose low 16 bits are a tie or next to one; odd lengths for the tails.
  codec::bf16 c;
  constexpr std::size_t batch = (1 << 20) + 7;
  std::vector<float> x(batch);
  std::vector<std::byte> w(c.wire_bytes(batch));
  std::size_t bad = 0;
  std::uint32_t first_bad = 0;
  auto check = [&](std::size_t n) {
    c.encode(x.data(), n, w.data());
    const auto* h = reinterpret_cast<const std::uint16_t*>(w.data());
    for (std::size_t i = 0; i < n; ++i)
      if (h[i] != codec::bf16_from_bits(std::bit_cast<std::uint32_t>(x[i])) && bad++ == 0) first_bad = std::bit_cast<std::uint32_t>(x[i]);
  };
  std::size_t n = 0;
  for (std::uint64_t b = 0; b <= 0xffffffffu; b += 3) {
    x[n++] = std::bit_cast<float>(static_cast<std::uint32_t>(b));
    if (n == batch) check(n), n = 0;
  }
  check(n), n = 0;
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (std::uint32_t lo : {0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x0001u}) {
      x[n++] = std::bit_cast<float>(hi << 16 | lo);
      if (n == batch) check(n), n = 0;
    }
  check(n);
  INFO("first mismatch at bits " << first_bad);
  CHECK(bad == 0);
  // Decoding: every one of the 65536 codes, into and onto a buffer, with a tail.
  const std::size_t m = 65536 + 13;
  std::vector<std::uint16_t> codes(m);
  for (std::size_t i = 0; i < m; ++i) codes[i] = static_cast<std::uint16_t>(i * 40503u);
  std::vector<float> out(m), acc = normal(m, 23), sum = acc;
  c.decode(reinterpret_cast<const std::byte*>(codes.data()), m, out.data());
  c.decode_add(reinterpret_cast<const std::byte*>(codes.data()), m, sum.data());
  std::size_t dbad = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const float v = std::bit_cast<float>(codec::bf16_to_bits(codes[i]));
    dbad += std::bit_cast<std::uint32_t>(out[i]) != std::bit_cast<std::uint32_t>(v);
    dbad += !(std::bit_cast<std::uint32_t>(sum[i]) == std::bit_cast<std::uint32_t>(acc[i] + v) || (std::isnan(sum[i]) && std::isnan(acc[i] + v)));
  }
  CHECK(dbad == 0);
}

TEMPLATE_TEST_CASE("a block whose absmax is below the smallest normal float is sent as zeros", "[codec]",
                   codec::int8, codec::dyntree8) {
  // 1 / absmax would overflow to Inf and x * Inf is no unit value; such blocks carry no codes, on
  // host and device alike (codec::block_scale_carries), and decode to zeros.
  TestType c;
  std::vector<float> x(600, 0.0f);
  x[3] = 1e-39f;     // subnormal: the first block (512 values) has absmax 1e-39
  x[4] = -5e-40f;
  x[599] = 0.25f;    // the second block is ordinary
  auto y = roundtrip(c, x);
  CHECK(y[3] == 0.0f);
  CHECK(y[4] == 0.0f);
  CHECK(y[599] == 0.25f);
  CHECK_FALSE(codec::block_scale_carries(1e-39f));
  CHECK(codec::block_scale_carries(1.17549435e-38f));
  CHECK_FALSE(codec::block_scale_carries(std::numeric_limits<float>::infinity()));
  CHECK_FALSE(codec::block_scale_carries(std::numeric_limits<float>::quiet_NaN()));
  CHECK_FALSE(codec::block_scale_carries(0.0f));
}

TEMPLATE_TEST_CASE("8-bit codecs: exact 0 and +-absmax, bounded error, non-finite blocks", "[codec]",
                   codec::int8, codec::dyntree8) {
  TestType c;
  REQUIRE(c.block() == 512);
  CHECK(4.0 / c.block() < 0.01);  // scale overhead under 1%
  const std::size_t n = 3 * 512 + 77;
  auto x = normal(n, 3);
  x[10] = 0.0f;
  x[700] = 0.0f;
  auto y = roundtrip(c, x);
  for (std::size_t b = 0; b * 512 < n; ++b) {
    const std::size_t lo = b * 512, hi = std::min(n, lo + 512);
    float m = 0;
    std::size_t at = lo;
    for (std::size_t i = lo; i < hi; ++i)
      if (std::abs(x[i]) > m) m = std::abs(x[i]), at = i;
    CHECK(y[at] == x[at]);  // +-absmax exactly
    for (std::size_t i = lo; i < hi; ++i) {
      const double u = x[i] / m;
      const double bound = std::is_same_v<TestType, codec::int8> ? m / 254.0 : dyntree8_bound(u) * m;
      INFO("i " << i << " x " << x[i] << " y " << y[i] << " absmax " << m);
      CHECK(std::abs(double(y[i]) - x[i]) <= bound * (1 + 1e-5) + 1e-7 * m);
    }
  }
  CHECK(y[10] == 0.0f);
  CHECK(y[700] == 0.0f);

  // A NaN or Inf poisons its own block only.
  auto z = x;
  z[600] = std::numeric_limits<float>::infinity();
  z[1300] = std::numeric_limits<float>::quiet_NaN();
  auto w = roundtrip(c, z);
  for (std::size_t i = 0; i < n; ++i) {
    const bool poisoned = (i / 512 == 1) || (i / 512 == 2);
    if (poisoned) CHECK(std::isnan(w[i]));
    else CHECK(w[i] == y[i]);
  }

  // An all-zero block stays zero; decode_add adds decode, bit for bit (the product is rounded
  // before the sum whatever the build's -ffp-contract: LOCKSTEP_ROUNDED).
  std::vector<float> zeros(600, 0.0f);
  for (float v : roundtrip(c, zeros)) CHECK(v == 0.0f);
  std::vector<std::byte> wire(c.wire_bytes(n));
  c.encode(x.data(), n, wire.data());
  std::vector<float> acc = normal(n, 4), expect = acc;
  for (std::size_t i = 0; i < n; ++i) expect[i] += y[i];
  c.decode_add(wire.data(), n, acc.data());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < n; ++i) differ += std::bit_cast<std::uint32_t>(acc[i]) != std::bit_cast<std::uint32_t>(expect[i]);
  CHECK(differ == 0);
}

TEMPLATE_TEST_CASE("8-bit codecs: blocks near FLT_MAX keep their codes with the FPU flushing subnormals", "[codec]",
                   codec::int8, codec::dyntree8) {
  // Above 2^126, 1 / absmax is subnormal; values and absmax are stepped down by 2^-64 first
  // (codec::huge_scale), so these blocks' codes do not depend on FTZ/DAZ, which -ffast-math
  // programs and torch.set_flush_denormal turn on: before, such a block then went out as zeros.
  // (A block of subnormal values still does: DAZ reads them as 0. None is here.)
  TestType c(64);
  std::vector<float> x(131);
  std::mt19937 g(29);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (auto& v : x) v = d(g) * 1e38f;
  x[5] = 3.0e38f;          // block 0's absmax, above 2^126
  x[64] = -0x1p127f;       // block 1's
  x[128] = 0x1p126f;       // block 2 (3 values): exactly 2^126, the ordinary path
  x[129] = 0x1p125f;
  x[130] = 1e-30f;         // 2^-99 of its absmax: code 0 either way
  std::vector<std::byte> plain(c.wire_bytes(x.size())), flushed(plain.size());
  c.encode(x.data(), x.size(), plain.data());
#if defined(__SSE__) && !defined(__CUDACC__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);  // FTZ and DAZ
  c.encode(x.data(), x.size(), flushed.data());
  _mm_setcsr(csr);
  CHECK(std::memcmp(plain.data(), flushed.data(), plain.size()) == 0);
#endif
  auto y = roundtrip(c, x);
  for (std::size_t b = 0; b * 64 < x.size(); ++b) {
    const std::size_t lo = b * 64, hi = std::min(x.size(), lo + 64);
    float m = 0;
    for (std::size_t i = lo; i < hi; ++i) m = std::max(m, std::abs(x[i]));
    for (std::size_t i = lo; i < hi; ++i) {
      const double u = double(x[i]) / m;
      const double bound = std::is_same_v<TestType, codec::int8> ? m / 254.0 : dyntree8_bound(u) * m;
      INFO("i " << i << " x " << x[i] << " y " << y[i] << " absmax " << m);
      CHECK(std::abs(double(y[i]) - x[i]) <= bound * (1 + 1e-5) + 1e-7 * m);
    }
  }
  CHECK(y[5] == x[5]);  // +-absmax exactly
  CHECK(y[64] == x[64]);
  CHECK(y[128] == x[128]);
  CHECK(y[130] == 0.0f);
}

TEMPLATE_TEST_CASE("8-bit codecs: block sizes from 1 to 2^32 - 1 values, larger ones refused", "[codec]",
                   codec::int8, codec::dyntree8) {
  // A block as large as the buffer (one scale for all) works, and costs no block-sized scratch;
  // one whose size the 32-bit id cannot hold is refused rather than sharing a fingerprint.
  const std::vector<float> x{1.0f, -0.5f, 0.25f};
  for (std::size_t block : {std::size_t{1}, std::size_t{3}, std::size_t{1} << 20, TestType::max_block}) {
    TestType c(block);
    INFO("block " << block);
    CHECK(c.blocks(3) == (block >= 3 ? 1u : (3 + block - 1) / block));
    // One block or one per value: the same values as a block of 3, or exact (absmax = the value).
    const std::vector<float> expect = block >= 3 ? roundtrip(TestType(3), x) : x;
    CHECK(roundtrip(c, x) == expect);
    std::vector<std::byte> w(c.wire_bytes(3));
    std::vector<float> y(3), r(3, 0.0f);
    c.encode_feedback(x.data(), 3, w.data(), r.data());
    c.decode(w.data(), 3, y.data());
    CHECK(y == expect);
    for (std::size_t i = 0; i < 3; ++i) CHECK(r[i] == x[i] - expect[i]);
  }
  CHECK(TestType(0).block() == 1);
  CHECK_THROWS_WITH(TestType(std::size_t{1} << 32), Catch::Contains("at most 4294967295"));
  CHECK_THROWS_AS(TestType(std::numeric_limits<std::size_t>::max()), error);
}

TEST_CASE("mean relative error on N(0,1) is near Dettmers' figures", "[codec]") {
  auto x = normal(1 << 18, 11);
  auto mean_rel = [&](auto c) {
    auto y = roundtrip(c, x);
    double s = 0;
    for (std::size_t i = 0; i < x.size(); ++i) s += std::abs(y[i] - x[i]) / std::abs(x[i]);
    return s / static_cast<double>(x.size());
  };
  const double dt = mean_rel(codec::dyntree8{}), dt64 = mean_rel(codec::dyntree8{64});
  const double li = mean_rel(codec::int8{}), li64 = mean_rel(codec::int8{64});
  INFO("dyntree8 " << dt << " (64: " << dt64 << "), int8 " << li << " (64: " << li64 << ")");
  CHECK(dt < 0.025);
  CHECK(dt64 < 0.02);
  CHECK(dt < li);  // the dynamic type beats linear on Gaussian data
  CHECK(li64 < li);
}

TEST_CASE("codec ids tell formats and block sizes apart", "[codec]") {
  CHECK(codec::fp32{}.id() != codec::bf16{}.id());
  CHECK(codec::int8{}.id() != codec::dyntree8{}.id());
  CHECK(codec::int8{512}.id() != codec::int8{256}.id());
  CHECK(codec::error_feedback<codec::int8>{}.id() == codec::int8{}.id());
  static_assert(codec::codec<codec::fp32> && codec::codec<codec::bf16> && codec::codec<codec::int8> &&
                codec::codec<codec::dyntree8> && codec::codec<codec::error_feedback<codec::dyntree8>>);
  static_assert(codec::feedback_codec<codec::error_feedback<codec::int8>>);
  static_assert(!codec::feedback_codec<codec::int8>);
}

TEST_CASE("error feedback refuses to grow without end when buffers move, and forgets on request", "[codec][ef]") {
  codec::error_feedback<codec::int8> ef(codec::int8{}, 4);
  std::vector<float> bufs[5];
  for (int i = 0; i < 4; ++i) REQUIRE(ef.residual(&bufs[i], 8, 0) != nullptr);
  CHECK(ef.residual(&bufs[0], 8, 0) == ef.residual(&bufs[0], 8, 0));  // the same key: the same storage
  CHECK(ef.buffers() == 4);
  CHECK_THROWS_WITH(ef.residual(&bufs[4], 8, 0), Catch::Contains("per buffer address") && Catch::Contains("4 ("));
  ef.forget(&bufs[1]);
  CHECK(ef.buffers() == 3);
  float* r = ef.residual(&bufs[4], 8, 1);
  REQUIRE(r != nullptr);
  CHECK(r[7] == 0.0f);  // a new key starts from zero
  ef.reset();
  CHECK(ef.buffers() == 0);
}

TEST_CASE("error feedback keeps the running sum of decoded values close to the true sum", "[codec][ef]") {
  codec::error_feedback<codec::dyntree8> ef;
  codec::dyntree8 plain;
  const std::size_t n = 4096;
  std::vector<double> truth(n, 0.0), with_ef(n, 0.0), without(n, 0.0);
  std::vector<std::byte> w(ef.wire_bytes(n));
  std::vector<float> y(n);
  float* r = ef.residual(&truth, n, 0);
  for (int step = 0; step < 200; ++step) {
    auto x = normal(n, 100 + static_cast<std::uint32_t>(step));
    for (std::size_t i = 0; i < n; ++i) x[i] = x[i] * 0.01f + 0.003f;  // a small bias: plain rounding drifts
    ef.encode_with_residual(x.data(), n, w.data(), r);
    ef.decode(w.data(), n, y.data());
    for (std::size_t i = 0; i < n; ++i) with_ef[i] += y[i], truth[i] += x[i];
    plain.encode(x.data(), n, w.data());
    plain.decode(w.data(), n, y.data());
    for (std::size_t i = 0; i < n; ++i) without[i] += y[i];
  }
  double e_ef = 0, e_plain = 0;
  for (std::size_t i = 0; i < n; ++i) {
    e_ef = std::max(e_ef, std::abs(with_ef[i] - truth[i]));
    e_plain = std::max(e_plain, std::abs(without[i] - truth[i]));
  }
  INFO("max drift with feedback " << e_ef << ", without " << e_plain);
  // With feedback the drift is one step's residual, not 200 steps' worth.
  CHECK(e_ef < 0.05 * 0.9 / 64 * 2);
  CHECK(e_ef * 5 < e_plain);
}

// Error feedback over an elementwise codec encodes in one pass (codec::encode_elements, the CUDA
// kernel's loop too); it must leave the wire and the residual of the general path: v = x + r,
// encode(v), r = v - decode(wire) (0 where not finite). Inputs with ties, subnormals, huge values, Inf and NaN.
template <class C>
void check_fused_feedback() {
  const std::size_t n = 4099;  // odd: the vector loops' tails
  std::vector<float> x = normal(n, 77), r(n);
  for (std::size_t i = 0; i < n; ++i) r[i] = x[(i * 7) % n] * 0.01f;
  const float specials[] = {0.0f, -0.0f, 1e-40f, -3e-39f, 3.4e38f, -3.4e38f, std::bit_cast<float>(0x3f808000u),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (std::size_t k = 0; k < std::size(specials); ++k) x[13 * k + 1] = specials[k], r[13 * k + 1] = 0.0f;
  x[200] = 3.4e38f, r[200] = 3.4e38f;  // the sum overflows to Inf
  codec::error_feedback<C> ef;
  std::vector<std::byte> fused(ef.wire_bytes(n)), plain(ef.wire_bytes(n));
  std::vector<float> r_fused = r, v(n), dec(n);
  ef.encode_with_residual(x.data(), n, fused.data(), r_fused.data());
  for (std::size_t i = 0; i < n; ++i) v[i] = x[i] + r[i];
  C{}.encode(v.data(), n, plain.data());
  C{}.decode(plain.data(), n, dec.data());
  const std::size_t wire_bytes = std::is_same_v<C, codec::fp32> ? n * 4 : n * 2;
  std::size_t bad = 0;
  CHECK(std::memcmp(fused.data(), plain.data(), wire_bytes) == 0);
  std::size_t first_bad = n;
  for (std::size_t i = 0; i < n; ++i)
    if (std::bit_cast<std::uint32_t>(r_fused[i]) != std::bit_cast<std::uint32_t>(codec::feedback_residual(v[i], dec[i])) &&
        bad++ == 0)
      first_bad = i;
  CAPTURE(first_bad);
  CHECK(bad == 0);
}

// One overflowed step (the one a loss scaler skips) must not poison the steps after it: the
// residual restarts at 0 where v - decode(wire) is not finite, on every path.
template <class C>
void check_feedback_recovers(C inner) {
  const std::size_t n = 1000;
  codec::error_feedback<C> ef(inner);
  std::vector<std::byte> w(ef.wire_bytes(n));
  std::vector<float> y(n);
  float* r = ef.residual(&y, n, 0);
  for (const float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), 3.4e38f}) {
    std::vector<float> x = normal(n, 31);
    x[17] = bad;
    if (bad == 3.4e38f) r[17] = 3.4e38f;  // x + r overflows
    ef.encode_with_residual(x.data(), n, w.data(), r);
    ef.decode(w.data(), n, y.data());
    INFO(ef.name() << ", bad value " << bad);
    CHECK(!std::isfinite(y[17]));  // the bad step still shows its overflow
    for (std::size_t i = 0; i < n; ++i) REQUIRE(std::isfinite(r[i]));
    for (int step = 0; step < 2; ++step) {
      const std::vector<float> ok = normal(n, 32 + static_cast<std::uint32_t>(step));
      ef.encode_with_residual(ok.data(), n, w.data(), r);
      ef.decode(w.data(), n, y.data());
      for (std::size_t i = 0; i < n; ++i) REQUIRE(std::isfinite(y[i]));
      for (std::size_t i = 0; i < n; ++i) REQUIRE(std::isfinite(r[i]));
    }
  }
  // Finite values keep their exact residual.
  CHECK(codec::feedback_residual(1.5f, 1.25f) == 0.25f);
  CHECK(codec::feedback_residual(-0.0f, 0.0f) == 0.0f);
  CHECK(codec::feedback_residual(std::numeric_limits<float>::infinity(), 1.0f) == 0.0f);
  CHECK(codec::feedback_residual(3.4e38f, -3.4e38f) == 0.0f);  // the difference overflows
}

TEST_CASE("error feedback recovers after a step with Inf or NaN on every codec", "[codec][ef]") {
  check_feedback_recovers(codec::bf16{});
  check_feedback_recovers(codec::int8{});
  check_feedback_recovers(codec::dyntree8{});
  check_feedback_recovers(codec::int8{64});
}

TEST_CASE("error feedback over fp32 and bf16 encodes in one pass with the general path's bits", "[codec][ef]") {
  check_fused_feedback<codec::fp32>();
  check_fused_feedback<codec::bf16>();
}

TEST_CASE("error feedback says so in its name; its id stays the inner codec's", "[codec][ef]") {
  // Labels ("all_reduce(ring, dyntree8+ef)") and error messages show that it is on.
  const codec::error_feedback<codec::dyntree8> dt;
  static_assert(std::is_same_v<decltype(dt.name()), std::string_view>);  // static storage, as the plain codecs'
  CHECK(dt.name() == "dyntree8+ef");
  CHECK(codec::error_feedback<codec::int8>{codec::int8{64}}.name() == "int8+ef");
  CHECK(codec::error_feedback<codec::bf16>{}.name() == "bf16+ef");
  CHECK(codec::error_feedback<codec::fp32>{}.name() == "fp32+ef");
  // An inner codec whose name is not a constant of its type still gets the suffix.
  CHECK(codec::error_feedback<codec::error_feedback<codec::int8>>{}.name() == std::string("int8+ef+ef"));
  // The wire format does not change, so neither does the id: ranks with and without error feedback
  // exchange valid data, and using it is each rank's choice.
  CHECK(dt.id() == codec::dyntree8{}.id());
  CHECK(dt.wire_bytes(1000) == codec::dyntree8{}.wire_bytes(1000));
  CHECK(codec::error_feedback<codec::int8>{codec::int8{64}}.id() == codec::int8{64}.id());
  CHECK(codec::error_feedback<codec::int8>{codec::int8{64}}.id() != codec::int8{}.id());
}

TEST_CASE("int8: the never-written code 0x80 decodes as -127 on every path, a finite block stays finite", "[codec][int8]") {
  using f = lockstep::codec::linear8_format;
  CHECK(f::value(0x80) == -1.0f);
  CHECK(f::value(0x81) == -1.0f);
  lockstep::codec::int8 c;
  const std::size_t n = 1000;  // the vector paths and a tail
  std::vector<float> x(n, 0.5f);
  x[0] = 3.0e38f;  // a scale near FLT_MAX: -128/127 of it would overflow to -Inf
  std::vector<std::byte> w(c.wire_bytes(n));
  c.encode(x.data(), n, w.data());
  auto* codes = reinterpret_cast<std::uint8_t*>(w.data()) + c.blocks(n) * sizeof(float);
  for (std::size_t i = 0; i < n; i += 3) codes[i] = 0x80;
  std::vector<float> y(n), acc(n, 0.0f);
  c.decode(w.data(), n, y.data());
  c.decode_add(w.data(), n, acc.data());
  for (std::size_t i = 0; i < n; i += 3) {
    INFO("element " << i);
    float scale;  // of the element's block
    std::memcpy(&scale, w.data() + (i / c.block()) * sizeof(float), sizeof scale);
    CHECK(std::isfinite(y[i]));
    CHECK(y[i] == -scale);
    CHECK(acc[i] == y[i]);
  }
}

TEST_CASE("the blockwise codecs' fused error-feedback step gives the four passes' bits", "[codec][ef]") {
  // error_feedback<int8 / dyntree8> encodes through blockwise::encode_feedback (one block at a time
  // in cache); every other codec through encode_in_passes. Both must leave the same wire bytes and
  // residuals, round after round, special blocks included.
  auto check = [](auto c) {
    using C = decltype(c);
    static_assert(requires(C& k, const float* in, std::byte* out, float* r) { k.encode_feedback(in, 1, out, r); });
    const std::size_t B = c.block();
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, B - 1, B, B + 1, 3 * B + 7, std::size_t{4099}, std::size_t{100003}}) {
      std::vector<float> r_fused = normal(n, 99 + static_cast<std::uint32_t>(n), 0.01f), r_passes = r_fused;
      std::vector<std::byte> w_fused(c.wire_bytes(n), std::byte{0xab}), w_passes = w_fused;
      for (std::uint32_t round = 0; round < 3; ++round) {
        std::vector<float> x = normal(n, 7 + static_cast<std::uint32_t>(n) + 1000 * round);
        // Block 1 all zero, 2 holds a NaN, 3 an Inf, 4 subnormals only, 5 overflows to Inf in x + r.
        auto block = [&](std::size_t b, auto fill) {
          for (std::size_t i = b * B; i < std::min(n, (b + 1) * B); ++i) fill(i);
        };
        block(1, [&](std::size_t i) { x[i] = 0.0f, r_fused[i] = r_passes[i] = 0.0f; });
        if (2 * B < n) x[2 * B] = std::numeric_limits<float>::quiet_NaN();
        if (3 * B + 1 < n) x[3 * B + 1] = -std::numeric_limits<float>::infinity();
        block(4, [&](std::size_t i) { x[i] = 1e-39f * static_cast<float>(i % 7), r_fused[i] = r_passes[i] = 0.0f; });
        block(5, [&](std::size_t i) { x[i] = 3e38f, r_fused[i] = r_passes[i] = 3e38f; });
        c.encode_feedback(x.data(), n, w_fused.data(), r_fused.data());
        codec::error_feedback<C>::encode_in_passes(c, x.data(), n, w_passes.data(), r_passes.data());
        INFO(c.name() << " block " << B << ", n " << n << ", round " << round);
        // memcmp wants real pointers even for 0 bytes, and an empty vector's data() may be null.
        REQUIRE((w_fused.empty() || std::memcmp(w_fused.data(), w_passes.data(), w_fused.size()) == 0));
        REQUIRE((n == 0 || std::memcmp(r_fused.data(), r_passes.data(), n * sizeof(float)) == 0));
      }
    }
    // And error_feedback<C> takes the fused path: the same bits as the passes through it.
    codec::error_feedback<C> ef(c);
    const std::size_t n = 5 * B + 3;
    const std::vector<float> x = normal(n, 5);
    std::vector<float> r(n, 0.001f), r_passes = r;
    std::vector<std::byte> w(c.wire_bytes(n)), w_passes(w.size());
    ef.encode_with_residual(x.data(), n, w.data(), r.data());
    codec::error_feedback<C>::encode_in_passes(c, x.data(), n, w_passes.data(), r_passes.data());
    CHECK(std::memcmp(w.data(), w_passes.data(), w.size()) == 0);
    CHECK(std::memcmp(r.data(), r_passes.data(), n * sizeof(float)) == 0);
  };
  check(codec::dyntree8{});
  check(codec::dyntree8{64});
  check(codec::int8{});
  check(codec::int8{64});
}
