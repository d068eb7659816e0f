// Tests for lockstep/optim/param_set.hpp: layout, blocks, range lookups against a brute-force scan,
// rejected layouts, and the ResNet-50 table the benchmark uses.
#include <catch2/catch.hpp>

#include <random>
#include <vector>

#include <lockstep/optim/param_set.hpp>

#include "../bench/resnet50_shapes.hpp"

namespace optim = lockstep::optim;

TEST_CASE("packed layout aligns every tensor and counts its blocks", "[param_set]") {
  const std::vector<std::size_t> sizes{5, 16, 17, 1, 100};
  const auto ps = optim::param_set::packed(sizes, {false, true, false, true, false}, 16, {.block = 8});
  REQUIRE(ps.tensor_count() == 5);
  CHECK(ps[0].offset == 0);
  CHECK(ps[1].offset == 16);
  CHECK(ps[2].offset == 32);
  CHECK(ps[3].offset == 64);
  CHECK(ps[4].offset == 80);
  CHECK(ps.size() == 180);
  CHECK(ps.params() == 139);
  CHECK(ps[1].exempt);
  CHECK_FALSE(ps[2].exempt);
  // Blocks of 8 from each tensor's start: 1 + 2 + 3 + 1 + 13.
  CHECK(ps.block_count() == 20);
  CHECK(ps.first_block(4) == 7);
  CHECK(ps.block_count(2) == 3);
  CHECK(ps.block_range(2, 2) == std::pair<std::size_t, std::size_t>{48, 49});
  CHECK(ps.block_range(4, 12) == std::pair<std::size_t, std::size_t>{176, 180});
  const auto tight = optim::param_set::packed(sizes, {}, 1);
  CHECK(tight.size() == 139);
  CHECK(tight[4].offset == 39);
}

TEST_CASE("tensors_in finds exactly the overlapping tensors", "[param_set]") {
  std::mt19937 rng(3);
  std::vector<optim::tensor_desc> ts;
  std::size_t at = 0;
  for (int i = 0; i < 40; ++i) {
    at += rng() % 3;  // gaps of 0..2
    const std::size_t n = 1 + rng() % 9;
    ts.push_back({at, n, false});
    at += n;
  }
  const optim::param_set ps(ts);
  for (std::size_t lo = 0; lo <= ps.size(); ++lo)
    for (std::size_t hi = lo; hi <= ps.size() + 2; ++hi) {
      std::size_t first = ts.size(), last = 0;
      for (std::size_t t = 0; t < ts.size(); ++t)
        if (ts[t].offset < hi && ts[t].offset + ts[t].size > lo) {
          first = std::min(first, t);
          last = t + 1;
        }
      const auto [a, b] = ps.tensors_in(lo, hi);
      if (first == ts.size()) REQUIRE(a == b);
      else REQUIRE(std::pair{a, b} == std::pair{first, last});
    }
}

TEST_CASE("layouts that cannot be swept are rejected with a reason", "[param_set]") {
  using optim::param_set;
  CHECK_THROWS_WITH(param_set({{0, 10}, {5, 10}}), Catch::Contains("overlaps"));
  CHECK_THROWS_WITH(param_set({{20, 10}, {0, 10}}), Catch::Contains("ascending offset order"));
  CHECK_THROWS_WITH(param_set({{0, 0}}), Catch::Contains("tensor 0 is empty"));
  CHECK_THROWS_AS(param_set({{0, 4}}, {.block = 0}), lockstep::error);
  CHECK_THROWS_WITH(param_set::packed(std::vector<std::size_t>{1, 2}, {true}), Catch::Contains("2 sizes but 1 exempt"));
  CHECK_NOTHROW(param_set({}));
}

TEST_CASE("the ResNet-50 table has 161 tensors and 25,557,032 parameters", "[param_set]") {
  const auto shapes = lockstep::bench::resnet50_shapes();
  std::vector<std::size_t> sizes;
  std::vector<bool> exempt;
  for (const auto& s : shapes) {
    sizes.push_back(s.size());
    exempt.push_back(s.exempt);
  }
  const auto ps = optim::param_set::packed(sizes, exempt);
  CHECK(ps.tensor_count() == 161);
  CHECK(ps.params() == 25557032);
  CHECK(std::count(exempt.begin(), exempt.end(), true) == 107);  // 53 batch norms x 2 + the fc bias
  CHECK(shapes.back().name == "fc.bias");
  CHECK(shapes[0].size() == 64 * 3 * 7 * 7);
}
