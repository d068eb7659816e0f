// Tests for lockstep/optim/param_layout.hpp: the flat tensor and block arrays the device kernels
// index, against the param_set they were built from (gaps, partial last blocks, exempt flags).
#include <catch2/catch.hpp>

#include <random>
#include <utility>
#include <vector>

#include <lockstep/optim/param_layout.hpp>

namespace optim = lockstep::optim;

TEST_CASE("param_layout lists a packed param_set's tensors and blocks", "[param_layout]") {
  const std::vector<std::size_t> sizes{5, 16, 17, 1, 100};
  const auto ps = optim::param_set::packed(sizes, {false, true, false, true, false}, 16, {.block = 8});
  const optim::param_layout l(ps);
  REQUIRE(l.tensors.size() == 5);
  REQUIRE(l.blocks.size() == 20);  // 1 + 2 + 3 + 1 + 13
  CHECK(l.tensors[2].offset == 32);
  CHECK(l.tensors[2].size == 17);
  CHECK(l.tensors[2].first_block == 3);
  CHECK(l.tensors[2].blocks == 3);
  CHECK(l.tensors[1].exempt);
  CHECK_FALSE(l.tensors[2].exempt);
  // Tensor 2's last block holds its one element past 32 + 16; tensor 4's last is 4 long.
  CHECK(l.blocks[5].lo == 48);
  CHECK(l.blocks[5].hi == 49);
  CHECK(l.blocks[5].tensor == 2);
  CHECK(l.blocks[19].lo == 176);
  CHECK(l.blocks[19].hi == 180);
  CHECK(l.blocks[19].tensor == 4);
}

TEST_CASE("param_layout agrees with the param_set's accessors", "[param_layout]") {
  std::mt19937 rng(7);
  std::vector<optim::tensor_desc> ts;
  std::size_t at = 0;
  for (int i = 0; i < 60; ++i) {
    at += rng() % 4;  // gaps of 0..3
    const std::size_t n = 1 + rng() % 40;
    ts.push_back({at, n, rng() % 3 == 0});
    at += n;
  }
  const optim::param_set ps(ts, {.block = 7});
  const optim::param_layout l(ps);
  REQUIRE(l.tensors.size() == ps.tensor_count());
  REQUIRE(l.blocks.size() == ps.block_count());
  std::size_t next = 0;  // blocks are listed tensor by tensor, in order, covering each tensor once
  for (std::size_t t = 0; t < ps.tensor_count(); ++t) {
    CAPTURE(t);
    const auto& d = l.tensors[t];
    CHECK(d.offset == ps[t].offset);
    CHECK(d.size == ps[t].size);
    CHECK(d.exempt == ps[t].exempt);
    REQUIRE(d.first_block == next);
    REQUIRE(d.blocks == ps.block_count(t));
    std::size_t covered = d.offset;
    for (std::size_t b = 0; b < d.blocks; ++b) {
      const auto& k = l.blocks[d.first_block + b];
      CHECK(k.tensor == t);
      CHECK(k.lo == covered);
      CHECK(std::pair{k.lo, k.hi} == ps.block_range(t, b));
      covered = k.hi;
    }
    CHECK(covered == d.offset + d.size);
    next += d.blocks;
  }
}

TEST_CASE("blocks_of names the blocks of a run of tensors", "[param_layout]") {
  const std::vector<std::size_t> sizes{5, 16, 17, 1, 100};
  const auto ps = optim::param_set::packed(sizes, {}, 16, {.block = 8});  // blocks 1, 2, 3, 1, 13
  using range = std::pair<std::size_t, std::size_t>;
  CHECK(optim::blocks_of(ps, 0, 5) == range{0, 20});
  CHECK(optim::blocks_of(ps, 0, 1) == range{0, 1});
  CHECK(optim::blocks_of(ps, 2, 4) == range{3, 7});
  CHECK(optim::blocks_of(ps, 4, 5) == range{7, 20});
  CHECK(optim::blocks_of(ps, 3, 3) == range{0, 0});
  CHECK(optim::blocks_of(ps, 4, 2) == range{0, 0});
  const optim::param_layout l(ps);
  for (std::size_t a = 0; a < ps.tensor_count(); ++a)
    for (std::size_t b = a + 1; b <= ps.tensor_count(); ++b) {
      const auto [first, last] = optim::blocks_of(ps, a, b);
      CHECK(l.blocks[first].tensor == a);
      CHECK(l.blocks[last - 1].tensor == b - 1);
      CHECK((last == l.blocks.size() || l.blocks[last].tensor == b));
    }
}

TEST_CASE("param_layout of an empty param_set is empty", "[param_layout]") {
  const optim::param_layout l(optim::param_set({}));
  CHECK(l.tensors.empty());
  CHECK(l.blocks.empty());
}
