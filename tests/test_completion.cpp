// Tests for lockstep/optim/completion.hpp: which tensors an epilogue range completes, for the
// ranges real all-reduces report (every topology's chunks and segments, any arrival order), and
// the errors for a broken epilogue contract.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include <lockstep/optim/completion.hpp>

using namespace lockstep;

namespace {

optim::param_set shapes() {
  const std::vector<std::size_t> sizes = {64, 4096, 4097, 9408, 1, 1, 147456, 256, 1000, 12345, 3};
  return optim::param_set::packed(sizes, std::vector<bool>(sizes.size(), false));
}

// Cuts [0, n) into `pieces` ranges at random points, reported in a random order; checks that every
// tensor is completed exactly once, by the range holding its last outstanding element, and that
// each range's completions form the interval it returns.
void random_cover(const optim::param_set& ps, int pieces, std::uint32_t seed) {
  std::mt19937 g(seed);
  const std::size_t n = ps.size();
  std::vector<std::size_t> cuts = {0, n};
  std::uniform_int_distribution<std::size_t> at(1, n - 1);
  for (int i = 1; i < pieces; ++i) cuts.push_back(at(g));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<std::size_t> order(cuts.size() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), g);

  optim::completion done(ps);
  std::vector<std::size_t> left(ps.tensor_count());
  for (std::size_t t = 0; t < left.size(); ++t) left[t] = ps[t].size;
  std::vector<int> completed(ps.tensor_count(), 0);
  for (std::size_t k : order) {
    const std::size_t lo = cuts[k], hi = cuts[k + 1];
    // What a reference says: tensors whose outstanding elements all lie in [lo, hi).
    std::vector<std::size_t> expect;
    for (std::size_t t = 0; t < left.size(); ++t) {
      const std::size_t a = std::max(ps[t].offset, lo), b = std::min(ps[t].offset + ps[t].size, hi);
      if (b <= a) continue;
      left[t] -= b - a;
      if (left[t] == 0) expect.push_back(t);
    }
    const auto [a, b] = done.report(lo, hi, 0);
    std::vector<std::size_t> got;
    for (std::size_t t = a; t < b; ++t) got.push_back(t), ++completed[t];
    CHECK(got == expect);
  }
  done.check_all_reported(0);
  CHECK(std::all_of(completed.begin(), completed.end(), [](int c) { return c == 1; }));
}

}  // namespace

TEST_CASE("a range completes a run of consecutive tensors, each tensor exactly once", "[optim][completion]") {
  const auto ps = shapes();
  for (int pieces : {1, 2, 3, 7, 16, 64, 500})
    for (std::uint32_t seed = 1; seed <= 20; ++seed) random_cover(ps, pieces, seed);
}

TEST_CASE("a range whose tensors were partly final before completes them", "[optim][completion]") {
  const auto ps = shapes();
  optim::completion done(ps);
  // Tensor 1 is [64, 4160): its second half first, then a range from inside tensor 0 to its middle.
  auto [a, b] = done.report(2112, 4160, 0);
  CHECK(a == b);  // nothing complete yet
  std::tie(a, b) = done.report(0, 2112, 0);
  CHECK(a == 0);
  CHECK(b == 2);
  std::tie(a, b) = done.report(64, 64, 0);  // empty: completes nothing, not tensor 1 again
  CHECK(a == b);
  done.reset();
  std::tie(a, b) = done.report(0, ps.size(), 0);
  CHECK(a == 0);
  CHECK(b == ps.tensor_count());
}

TEST_CASE("completion names the tensor an epilogue reported twice or never", "[optim][completion]") {
  const auto ps = shapes();
  optim::completion done(ps, "optim::step");
  done.report(0, 100, 3);
  try {
    done.report(50, 70, 3);
    FAIL("no error for a range reported twice");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(e.rank() == 3);
    CHECK_THAT(e.what(), Catch::Contains("tensor 0 final twice"));
  }
  try {
    done.check_all_reported(3);
    FAIL("no error for unreported elements");
  } catch (const error& e) {
    CHECK_THAT(e.what(), Catch::Contains("unreported"));
    CHECK_THAT(e.what(), Catch::Contains("optim::step"));
  }
  CHECK_THROWS_WITH(done.report(0, ps.size() + 1, 3), Catch::Contains("outside the"));
}
