// The error bound of a lossy all_reduce (docs/codecs.md, "Error of a collective"), met by inputs
// built to reach it. Random inputs stay far below any bound (their errors partly cancel), so they
// cannot tell a right bound from a wrong one; these inputs make every quantisation on a value's
// path err by its most, in the same direction, at the largest scale the bound allows.
//
// Layout: one block per chunk (count = N * L, L = 512 = the blockwise codecs' default block). In
// chunk c, element r < N is a "big" element: 1 on rank r, 0 elsewhere, so that every partial sum
// that holds any rank's share has block absmax 1 (a different element sets it in each column of a
// torus). The other elements are targets, alternately positive and negative: a fixed point v with
// a step x such that quantising v + x gives v back, and |x| as large as that allows:
//   int8      v = 0, x just below half a code step (1/254): every rank sends x, every partial sum
//             the target is part of reads x again (what came before rounded to 0), so all N
//             quantisations err by x;
//   dyntree8  v = 1, x just above -0.9/64: v + x lies in the top bin [1 - 0.9/64, 1], which
//             decodes to 1;
//   bf16      v = 1, x = 2^-8 (a tie, rounded to even: back to 1).
// For dyntree8 and bf16 the carrier, the first rank of the owner's chains (torus: row a+1 of
// column b+1 for chunk a*C + b; ring: rank c+1), sends v + x; every other rank of its column sends
// x, and so does row a of each other column (its column sum is x, added to v in the row
// reduce-scatter). That reaches R + C - 1 quantisations on a torus, the longest chain: bf16's
// bound, and for dyntree8 what these inputs can reach (docs/codecs.md says why).
//
// Each case prints error / bound (the first-order (N delta_block + D delta_value) M of
// collective_bounds.hpp, without the fp32 allowance) and error / the old (R + C - 1) delta M
// bound; it checks the error is within the bound everywhere (the first-order one and the proven
// one, (1 + delta)^(N-1) times larger), that the
// adversary reached what it was built to reach, and, for int8 on a torus with R, C >= 2, that the
// old bound is exceeded.
#include <lockstep/lockstep.hpp>

#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "collective_bounds.hpp"

using namespace lockstep;
using lockstep_test::delta;
using lockstep_test::error_factor;
using lockstep_test::value_relative;

namespace {

constexpr std::size_t chunk_len = 512;

template <class C>
std::string codec_name() {
  return std::string(C::name());
}

// The codec's image of `p` in a block whose absmax is set by `big` (a second element).
template <class C>
float roundtrip(float p, float big) {
  C codec{};
  const float in[2] = {big, p};
  std::vector<std::byte> wire(codec.wire_bytes(2));
  float out[2];
  codec.encode(in, 2, wire.data());
  codec.decode(wire.data(), 2, out);
  return out[1];
}

struct fixed_point {
  float v, x;
};

// The largest |x| (sign `dir`) with roundtrip(v + x) == v, by bisection on the bits of |x| below
// `lim`: the set of such x is an interval around 0.
template <class C>
fixed_point find_fixed_point(float v, float dir, float lim) {
  auto ok = [&](std::uint32_t bits) {
    const float x = dir * std::bit_cast<float>(bits);
    return roundtrip<C>(v + x, 1.0f) == v;
  };
  std::uint32_t lo = 0, hi = std::bit_cast<std::uint32_t>(lim);  // ok(lo), !ok(hi)
  REQUIRE(ok(lo));
  REQUIRE(!ok(hi));
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    (ok(mid) ? lo : hi) = mid;
  }
  return {v, dir * std::bit_cast<float>(lo)};
}

template <class C>
fixed_point adversary() {
  if constexpr (std::is_same_v<C, codec::int8>) return find_fixed_point<C>(0.0f, 1.0f, 0.01f);
  else if constexpr (std::is_same_v<C, codec::dyntree8>) {
    // v = 1: the top bin decodes to the block's absmax (the big element, 1).
    return find_fixed_point<C>(1.0f, -1.0f, 0.05f);
  } else return find_fixed_point<C>(1.0f, 1.0f, 0.01f);
}

struct outcome {
  double ratio = 0;      // max over elements of error / (q delta M), without the fp32 allowance
  double old_ratio = 0;  // max over elements of error / ((R + C - 1) delta M)
  double max_error = 0;  // at the target elements, of the sum
};

// One all_reduce of the adversarial input over an R x C grid (ring: 1 x N).
template <class C, class T>
outcome run_case(const T& topo, int rows, int cols, reduce_op op) {
  const int n = rows * cols;
  const fixed_point fp = adversary<C>();
  const std::size_t count = chunk_len * static_cast<std::size_t>(n);
  // (rank, element)
  std::vector<std::vector<float>> in(static_cast<std::size_t>(n), std::vector<float>(count, 0.0f));
  for (int c = 0; c < n; ++c) {
    const std::size_t lo = chunk_len * static_cast<std::size_t>(c);
    const int a = c / cols, b = c % cols;
    const int carrier = ((a + 1) % rows) * cols + (b + 1) % cols;
    for (int r = 0; r < n; ++r) {
      in[static_cast<std::size_t>(r)][lo + static_cast<std::size_t>(r)] = 1.0f;
      const bool sends_x = fp.v == 0.0f || r % cols == carrier % cols || r / cols == a;
      for (std::size_t k = static_cast<std::size_t>(n); k < chunk_len; ++k) {
        const float s = k % 2 ? -1.0f : 1.0f;
        float& e = in[static_cast<std::size_t>(r)][lo + k];
        if (r == carrier) e = s * (fp.v + fp.x);
        else if (sends_x) e = s * fp.x;
      }
    }
  }

  std::mutex m;
  std::vector<float> y;
  run_inproc(n, [&](auto& g) {
    std::vector<float> v = in[static_cast<std::size_t>(g.rank())];
    C codec{};
    all_reduce(g, std::span<float>(v), topo, codec, op);
    std::lock_guard lk(m);
    if (g.rank() == 0) y = std::move(v);
  });
  REQUIRE(y.size() == count);

  const double scale = op == reduce_op::average ? 1.0 / n : 1.0;
  const int depth = lockstep_test::hops(topo, n) + 1;
  const int q = lockstep_test::quantisations(topo, n);
  const double factor = error_factor<C>(depth, q), proven = lockstep_test::proven_error_factor<C>(depth, q);
  const double old_factor = (rows + cols - 1) * delta<C>();
  outcome o;
  for (int c = 0; c < n; ++c) {
    const std::size_t lo = chunk_len * static_cast<std::size_t>(c);
    // M over the block (one block per chunk) for the blockwise codecs; per element for bf16.
    std::vector<double> mass(chunk_len, 0.0);
    double block_m = 0;
    for (std::size_t k = 0; k < chunk_len; ++k) {
      for (int r = 0; r < n; ++r) mass[k] += std::abs(static_cast<double>(in[static_cast<std::size_t>(r)][lo + k]));
      block_m = std::max(block_m, mass[k]);
    }
    for (std::size_t k = 0; k < chunk_len; ++k) {
      double ref = 0;
      for (int r = 0; r < n; ++r) ref += in[static_cast<std::size_t>(r)][lo + k];
      ref *= scale;
      const double mm = value_relative<C> ? mass[k] : block_m;
      const double err = std::abs(static_cast<double>(y[lo + k]) - ref);
      const double bound = factor * mm * scale, allowance = n * 1e-6 * mm * scale;
      if (!(err <= proven * mm * scale + allowance))
        FAIL(codec_name<C>() << " " << rows << "x" << cols << ", chunk " << c << " element " << k << ": error " << err
                             << " > proven bound " << proven * mm * scale);
      if (!(err <= bound + allowance))
        FAIL(codec_name<C>() << " " << rows << "x" << cols << ", chunk " << c << " element " << k << ": error " << err
                             << " > bound " << bound);
      o.ratio = std::max(o.ratio, err / bound);
      o.old_ratio = std::max(o.old_ratio, err / (old_factor * mm * scale));
      if (k >= static_cast<std::size_t>(n)) o.max_error = std::max(o.max_error, err / scale);
    }
  }
  return o;
}

// The quantisations these inputs make err by |x|: all N for int8 (v = 0), the longest chain
// R + C - 1 for the others.
template <class C>
int reached(int rows, int cols) {
  return std::is_same_v<C, codec::int8> ? rows * cols : rows + cols - 1;
}

template <class C, class T>
void check_shape(const T& topo, int rows, int cols, const char* label) {
  const fixed_point fp = adversary<C>();
  for (reduce_op op : {reduce_op::sum, reduce_op::average}) {
    const outcome o = run_case<C>(topo, rows, cols, op);
    std::printf("bounds: %-8s %-8s %dx%d %-7s error/bound %.6f  error/old bound %.6f\n", codec_name<C>().c_str(), label,
                rows, cols, op == reduce_op::sum ? "sum" : "average", o.ratio, o.old_ratio);
    if (op != reduce_op::sum) continue;  // the division moves the owner's value off the threshold
    INFO(codec_name<C>() << " " << label << " " << rows << "x" << cols);
    // The adversary did what it was built for: every quantisation it aims at erred by |x|.
    CHECK(o.max_error >= 0.9999 * reached<C>(rows, cols) * std::abs(static_cast<double>(fp.x)));
    if (std::is_same_v<C, codec::int8>) {
      CHECK(o.ratio > 0.95);
      if (rows >= 2 && cols >= 2) CHECK(o.old_ratio > 1.0);  // the (R + C - 1) delta M bound was wrong
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a lossy all_reduce stays within its bound on inputs built to reach it", "[bounds]", codec::bf16,
                   codec::int8, codec::dyntree8) {
  for (int n = 2; n <= 8; ++n) check_shape<TestType>(topology::ring{}, 1, n, "ring");
  const std::pair<int, int> shapes[] = {{2, 2}, {2, 3}, {3, 2}, {3, 3}, {4, 2}, {1, 5}, {5, 1}};
  for (auto [r, c] : shapes) check_shape<TestType>(topology::torus2d{r, c}, r, c, "torus2d");
}

// Halving-doubling's reduction is a tree too: the N - 1 partial sums and the owner's quantisation
// all reach the value, and int8's adversary (every rank x, every partial sum reading x again)
// makes each err by x. Recursive doubling is held to its larger count (2p - 1 + N - p): this
// adversary reaches only N of it there (an exchange replaces a rank's own x by its image, 0),
// so it shows the bound holds, not that it is tight.
TEST_CASE("int8 over the latency topologies stays within its bound, tight on halving-doubling", "[bounds]") {
  for (int n = 2; n <= 8; ++n) {
    INFO("N = " << n);
    const outcome hd = run_case<codec::int8>(topology::halving_doubling{}, 1, n, reduce_op::sum);
    CHECK(hd.ratio > 0.95);
    CHECK(hd.max_error >= 0.9999 * n * std::abs(static_cast<double>(adversary<codec::int8>().x)));
    const outcome rd = run_case<codec::int8>(topology::recursive_doubling{}, 1, n, reduce_op::sum);
    CHECK(rd.ratio <= 1.0);
    std::printf("bounds: int8     halving_doubling N=%d error/bound %.4f; recursive_doubling %.4f\n", n, hd.ratio, rd.ratio);
  }
}
