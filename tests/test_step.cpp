// Tests for lockstep/optim/step.hpp, ranks as threads (run_inproc):
//   - the fused step (update as the all-reduce's epilogue) equals all_reduce(average) followed by
//     optim::update — bitwise where 1/ranks is a power of two, to fp32 rounding otherwise;
//   - every rank ends with the same bits;
//   - the sharded step equals the unsharded one (SGD bitwise, LARS to fp32 rounding), for ring and
//     torus, with tensors cut by chunk boundaries, and writes the same bf16 copy;
//   - the bucketed step (begin_step / bucket_ready / wait) equals a blocking all_reduce per bucket
//     followed by optim::update bit for bit (SGD and LARS; fp32, bf16, dyntree8; both averagings;
//     1..5 ranks; one bucket, one per tensor, uneven; bucket_ready in any order), and equals the
//     unbucketed step bit for bit where the reduced values cannot depend on the bucketing;
//   - bucket lists that cut a tensor, overlap, leave a gap are refused; misuse of bucket_ready and
//     wait is an error; a bucket whose collective fails makes wait() throw, naming the bucket.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim.hpp>

namespace optim = lockstep::optim;
using lockstep::group;
using lockstep::transport::inproc;

namespace {

// Sizes chosen so that chunk boundaries fall inside tensors for 2, 3 and 4 ranks.
const std::vector<std::size_t> sizes{1000, 3, 64, 4097, 17, 250, 2001, 1};
const std::vector<bool> exempt{false, true, false, false, true, false, false, true};
constexpr int steps = 3;
constexpr float lrs[steps] = {0.5f, 0.25f, 1.0f};

float weight0(std::size_t i) { return std::sin(0.011f * float(i)) + 0.05f; }
float grad(int rank, int s, std::size_t i) {
  return 0.01f * std::cos(0.37f * float(i) + 1.3f * float(rank) + 0.7f * float(s));
}

struct outcome {
  std::vector<std::vector<float>> w, v;          // (rank, element)
  std::vector<std::vector<std::uint16_t>> bf;    // (rank, element)
};

enum class mode { fused, unfused, sharded };

template <class Topo, class Codec, class O>
outcome run(int n, const Topo& topo, const O& opt, mode m) {
  const auto ps = optim::param_set::packed(sizes, exempt, 16, {.block = 128, .task = 300, .wave = 1500});
  outcome out;
  out.w.resize(n);
  out.v.resize(n);
  out.bf.resize(n);
  std::mutex mu;
  lockstep::thread_pool pool(2);
  // Small segments: the all-reduce pipelines several per chunk.
  lockstep::run_inproc(
      n,
      [&](group<inproc>& g) {
        std::vector<float> w(ps.size()), gr(ps.size());
        std::vector<std::uint16_t> bf(ps.size(), 0);
        for (std::size_t i = 0; i < w.size(); ++i) w[i] = weight0(i);
        optim::state st(ps, opt);
        Codec codec{};
        const optim::plan<O> plan{.opt = opt, .params = ps, .st = st, .weights = w, .grads = gr,
                                  .weights_bf16 = bf, .pool = pool};
        for (int s = 0; s < steps; ++s) {
          for (std::size_t i = 0; i < gr.size(); ++i) gr[i] = grad(g.rank(), s, i);
          switch (m) {
            case mode::fused: optim::step(g, topo, codec, plan, lrs[s]); break;
            case mode::sharded: optim::step_sharded(g, topo, codec, plan, lrs[s]); break;
            case mode::unfused:
              lockstep::all_reduce(g, std::span<float>(gr), topo, codec, lockstep::reduce_op::average);
              optim::update(opt, ps, std::span<float>(w), std::span<const float>(gr), st, {.lr = lrs[s]}, bf, pool);
              break;
          }
        }
        std::lock_guard lk(mu);
        out.w[g.rank()] = w;
        out.v[g.rank()].assign(st.momentum().begin(), st.momentum().end());
        out.bf[g.rank()] = bf;
      },
      {.timeout = std::chrono::seconds(60), .segment_bytes = 1024});
  return out;
}

const std::vector<optim::sgd> sgds{
    {.momentum = 0.9f, .weight_decay = 1e-3f},
    {.momentum = 0.9f, .weight_decay = 1e-2f, .nesterov = true, .decay_exempt = true},
    {.momentum = 0.0f, .weight_decay = 1e-3f},
};
const std::vector<optim::lars> larses{
    {},
    {.momentum = 0.9f, .weight_decay = 1e-3f, .trust = 0.01f, .nesterov = true,
     .denom = optim::lars::denominator::decayed_norm, .lr_at = optim::lars::lr_placement::outside},
};

void require_close(const std::vector<float>& a, const std::vector<float>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(double(a[i]) - double(b[i])) <= rel * std::max(1.0, std::fabs(double(b[i])))))
      FAIL("element " << i << ": " << a[i] << " vs " << b[i]);
}

void require_ranks_agree(const outcome& o) {
  for (std::size_t r = 1; r < o.w.size(); ++r) {
    REQUIRE(o.w[r] == o.w[0]);
    REQUIRE(o.bf[r] == o.bf[0]);
  }
}

template <class Topo, class Codec, class O>
void fused_equals_unfused(const Topo& topo, const O& opt) {
  for (int n = 1; n <= 4; ++n) {
    INFO(n << " ranks");
    const outcome f = run<Topo, Codec>(n, topo, opt, mode::fused);
    const outcome u = run<Topo, Codec>(n, topo, opt, mode::unfused);
    require_ranks_agree(f);
    if ((n & (n - 1)) == 0) {
      // x/n and x·(1/n) are the same number when n is a power of two.
      REQUIRE(f.w[0] == u.w[0]);
      REQUIRE(f.v[0] == u.v[0]);
      REQUIRE(f.bf[0] == u.bf[0]);
    } else if constexpr (std::is_same_v<Codec, lockstep::codec::fp32>) {
      require_close(f.w[0], u.w[0], 1e-6);
    } else {
      // The fused step rounds the sum to bf16, the other the average: 2^-9 of each gradient
      // apart, so the weights differ by a few parts in 2^9 of how far they moved.
      double moved = 0;
      for (std::size_t i = 0; i < u.w[0].size(); ++i) moved = std::max(moved, std::fabs(double(u.w[0][i]) - weight0(i)));
      for (std::size_t i = 0; i < u.w[0].size(); ++i)
        REQUIRE(std::fabs(double(f.w[0][i]) - double(u.w[0][i])) <= moved / 128);
    }
  }
}

}  // namespace

TEST_CASE("fused SGD step equals all_reduce(average) then update", "[step]") {
  for (const auto& opt : sgds) {
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::fp32>(lockstep::topology::ring{}, opt);
    fused_equals_unfused<lockstep::topology::torus2d, lockstep::codec::fp32>(lockstep::topology::torus2d{}, opt);
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::bf16>(lockstep::topology::ring{}, opt);
  }
}

TEST_CASE("fused LARS step equals all_reduce(average) then update", "[step]") {
  for (const auto& opt : larses) {
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::fp32>(lockstep::topology::ring{}, opt);
    fused_equals_unfused<lockstep::topology::torus2d, lockstep::codec::fp32>(lockstep::topology::torus2d{}, opt);
    fused_equals_unfused<lockstep::topology::ring, lockstep::codec::bf16>(lockstep::topology::ring{}, opt);
  }
}

TEST_CASE("sharded step equals the unsharded step", "[step]") {
  auto check = [](const auto& topo, const auto& opt, bool bitwise) {
    using Topo = std::decay_t<decltype(topo)>;
    for (int n = 1; n <= 4; ++n) {
      INFO(n << " ranks, " << topo.name() << ", " << std::decay_t<decltype(opt)>::name());
      const outcome s = run<Topo, lockstep::codec::fp32>(n, topo, opt, mode::sharded);
      const outcome f = run<Topo, lockstep::codec::fp32>(n, topo, opt, mode::fused);
      require_ranks_agree(s);
      if (bitwise) {
        REQUIRE(s.w[0] == f.w[0]);
        REQUIRE(s.bf[0] == f.bf[0]);
      } else {
        require_close(s.w[0], f.w[0], 1e-6);
      }
      // Each rank's momentum is right on its own chunk and untouched elsewhere.
      if (!f.v[0].empty())
        for (int r = 0; r < n; ++r) {
          const auto [lo, hi] = lockstep::chunk_range(f.v[0].size(), n, r);
          for (std::size_t i = 0; i < f.v[0].size(); ++i) {
            if (i >= lo && i < hi) {
              if (bitwise) REQUIRE(s.v[r][i] == f.v[0][i]);
              else REQUIRE(std::fabs(s.v[r][i] - f.v[0][i]) <= 1e-6 * std::max(1.0f, std::fabs(f.v[0][i])));
            } else {
              REQUIRE(s.v[r][i] == 0.0f);
            }
          }
        }
    }
  };
  for (const auto& opt : sgds) {
    check(lockstep::topology::ring{}, opt, true);
    check(lockstep::topology::torus2d{}, opt, true);
  }
  for (const auto& opt : larses) {
    check(lockstep::topology::ring{}, opt, false);
    check(lockstep::topology::torus2d{}, opt, false);
  }
}

TEST_CASE("sharded step with a lossy gradient codec keeps fp32 weights equal on every rank", "[step]") {
  for (int n = 2; n <= 4; ++n) {
    const outcome s = run<lockstep::topology::ring, lockstep::codec::bf16>(n, lockstep::topology::ring{}, larses[0], mode::sharded);
    const outcome f = run<lockstep::topology::ring, lockstep::codec::fp32>(n, lockstep::topology::ring{}, larses[0], mode::fused);
    require_ranks_agree(s);
    // bf16 gradients move each update by at most 2^-8 of itself; the updates are below 1e-2.
    require_close(s.w[0], f.w[0], 1e-4);
    bool any_differs = false;
    for (std::size_t i = 0; i < s.w[0].size(); ++i) any_differs = any_differs || s.w[0][i] != f.w[0][i];
    CHECK(any_differs);  // the codec did act
  }
}

// ---- the bucketed step (begin_step, bucket_ready, wait) ----------------------------------------

namespace {

const optim::param_set& bucket_params() {
  static const auto ps = optim::param_set::packed(sizes, exempt, 16, {.block = 128, .task = 300, .wave = 1500});
  return ps;
}

// Buckets starting at the given tensors (ascending, the first 0), padding with the tensor before
// it; the last ends at the buffer's end. Listed last bucket first, as backward writes them.
std::vector<optim::bucket> buckets_at(const optim::param_set& ps, std::vector<std::size_t> starts) {
  std::vector<optim::bucket> b;
  for (std::size_t i = 0; i < starts.size(); ++i)
    b.push_back({i == 0 ? 0 : ps[starts[i]].offset, i + 1 < starts.size() ? ps[starts[i + 1]].offset : ps.size()});
  std::reverse(b.begin(), b.end());
  return b;
}

struct bucket_case {
  const char* name;
  std::vector<optim::bucket> buckets;
};

std::vector<bucket_case> bucket_lists() {
  const auto& ps = bucket_params();
  std::vector<std::size_t> each(ps.tensor_count());
  std::iota(each.begin(), each.end(), std::size_t{0});
  return {{"one bucket", buckets_at(ps, {0})},
          {"one per tensor", buckets_at(ps, each)},
          {"uneven", buckets_at(ps, {0, 3, 4})}};
}

// bucket_ready orders: the list's, reversed, and a fixed shuffle (the same on every rank).
std::vector<std::vector<std::size_t>> ready_orders(std::size_t nb) {
  std::vector<std::size_t> in(nb);
  std::iota(in.begin(), in.end(), std::size_t{0});
  std::vector<std::size_t> rev(in.rbegin(), in.rend()), mixed = in;
  std::shuffle(mixed.begin(), mixed.end(), std::mt19937(7));
  return {in, rev, mixed};
}

// Small multiples of 2^-10: any sum over up to 5 ranks is exact in fp32, in any order, so every
// bucketing reduces to the same bits and bucketed and unbucketed steps can be compared exactly.
float grad_exact(int rank, int s, std::size_t i) {
  return static_cast<float>(static_cast<int>((7 * i + 13 * static_cast<std::size_t>(rank) + 5 * static_cast<std::size_t>(s)) % 41) - 20) /
         1024.0f;
}

enum class how { bucketed, reference };

struct bucket_outcome {
  std::vector<std::vector<float>> w, v, g;      // (rank, element)
  std::vector<std::vector<std::uint16_t>> bf;   // (rank, element)
};

// Three steps on n ranks. bucketed: begin_step, bucket_ready in `order`, wait. reference: the
// same all-reduces, blocking, bucket by bucket in `order`, then optim::update over everything.
template <class Codec, class O>
bucket_outcome run_buckets(int n, const O& opt, optim::averaging avg, std::span<const optim::bucket> buckets,
                           std::span<const std::size_t> order, how h, bool exact_grads) {
  const auto& ps = bucket_params();
  bucket_outcome out;
  out.w.resize(n), out.v.resize(n), out.g.resize(n), out.bf.resize(n);
  std::mutex mu;
  lockstep::thread_pool pool(2);
  const lockstep::topology::ring topo;
  lockstep::run_inproc(
      n,
      [&](group<inproc>& g) {
        std::vector<float> w(ps.size()), gr(ps.size());
        std::vector<std::uint16_t> bf(ps.size(), 0);
        for (std::size_t i = 0; i < w.size(); ++i) w[i] = weight0(i);
        optim::state st(ps, opt);
        Codec codec{};
        const optim::plan<O> plan{.opt = opt, .params = ps, .st = st, .weights = w, .grads = gr,
                                  .weights_bf16 = bf, .pool = pool, .average = avg};
        for (int s = 0; s < steps; ++s) {
          for (std::size_t i = 0; i < gr.size(); ++i) gr[i] = exact_grads ? grad_exact(g.rank(), s, i) : grad(g.rank(), s, i);
          if (h == how::bucketed) {
            auto st_ = optim::begin_step(g, topo, codec, plan, buckets, lrs[s]);
            for (std::size_t k : order) st_.bucket_ready(k);
            st_.wait();
          } else {
            const auto op = avg == optim::averaging::in_collective ? lockstep::reduce_op::average : lockstep::reduce_op::sum;
            for (std::size_t k : order)
              lockstep::all_reduce(g, std::span<float>(gr).subspan(buckets[k].first, buckets[k].last - buckets[k].first),
                                   topo, codec, op);
            optim::update(opt, ps, std::span<float>(w), std::span<const float>(gr), st,
                          {.lr = lrs[s], .grad_scale = plan.grad_scale(g.size())}, bf, pool);
          }
        }
        REQUIRE(st.steps() == static_cast<std::uint64_t>(steps));
        std::lock_guard lk(mu);
        out.w[g.rank()] = w;
        out.v[g.rank()].assign(st.momentum().begin(), st.momentum().end());
        out.g[g.rank()] = gr;
        out.bf[g.rank()] = bf;
      },
      {.timeout = std::chrono::seconds(60), .segment_bytes = 1024});
  return out;
}

void require_same(const bucket_outcome& a, const bucket_outcome& b) {
  for (std::size_t r = 0; r < a.w.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(a.w[r] == b.w[r]);
    REQUIRE(a.v[r] == b.v[r]);
    REQUIRE(a.g[r] == b.g[r]);
    REQUIRE(a.bf[r] == b.bf[r]);
  }
  for (std::size_t r = 1; r < a.w.size(); ++r) REQUIRE(a.w[r] == a.w[0]);
}

// Bit for bit: each bucket's update sees exactly the values a blocking all-reduce of that bucket
// leaves, SGD's element math is per element, and LARS' norms are per-block sums over those values
// added in block order, whichever ranges arrive first.
template <class Codec, class O>
void bucketed_equals_reference(const O& opt) {
  for (const auto avg : {optim::averaging::in_update, optim::averaging::in_collective})
    for (const auto& bc : bucket_lists())
      for (int n = 1; n <= 5; ++n) {
        INFO(bc.name << ", " << n << " ranks, " << O::name() << ", " << Codec{}.name()
                     << (avg == optim::averaging::in_update ? ", average in the update" : ", average in the collective"));
        const auto orders = ready_orders(bc.buckets.size());
        // Every order against the reference for one rank count; the list's order for the rest.
        for (std::size_t o = 0; o < (n == 3 ? orders.size() : 1); ++o) {
          INFO("bucket_ready order " << o);
          require_same(run_buckets<Codec>(n, opt, avg, bc.buckets, orders[o], how::bucketed, false),
                       run_buckets<Codec>(n, opt, avg, bc.buckets, orders[o], how::reference, false));
        }
      }
}

}  // namespace

TEST_CASE("bucketed step equals per-bucket all_reduce then update, bit for bit", "[step][bucket]") {
  bucketed_equals_reference<lockstep::codec::fp32>(sgds[0]);
  bucketed_equals_reference<lockstep::codec::fp32>(sgds[2]);
  bucketed_equals_reference<lockstep::codec::fp32>(larses[0]);
  bucketed_equals_reference<lockstep::codec::fp32>(larses[1]);
  bucketed_equals_reference<lockstep::codec::dyntree8>(sgds[1]);
  bucketed_equals_reference<lockstep::codec::dyntree8>(larses[0]);
}

TEST_CASE("bucketed step equals the unbucketed step where the sums are exact", "[step][bucket]") {
  // With fp32 and exactly summable gradients, how the buffer is cut into buckets cannot change a
  // reduced value, so every bucket list and order must give optim::step's bits (one bucket).
  auto check = [](const auto& opt) {
    for (const auto avg : {optim::averaging::in_update, optim::averaging::in_collective})
      for (int n = 1; n <= 5; ++n) {
        const auto lists = bucket_lists();
        const std::vector<std::size_t> one{0};
        const auto whole = run_buckets<lockstep::codec::fp32>(n, opt, avg, lists[0].buckets, one, how::bucketed, true);
        for (std::size_t l = 1; l < lists.size(); ++l) {
          INFO(lists[l].name << ", " << n << " ranks, " << std::decay_t<decltype(opt)>::name());
          const auto orders = ready_orders(lists[l].buckets.size());
          require_same(run_buckets<lockstep::codec::fp32>(n, opt, avg, lists[l].buckets, orders[2], how::bucketed, true),
                       whole);
        }
      }
  };
  check(sgds[0]);
  check(larses[0]);
  check(larses[1]);
}

TEST_CASE("step with the average in the collective equals all_reduce(average) then update", "[step]") {
  // Today's trainers' arithmetic, which averaging::in_collective must reproduce for any rank count
  // and a lossy codec (the other averaging is bitwise only where 1/ranks is a power of two).
  for (int n = 1; n <= 5; ++n) {
    INFO(n << " ranks");
    const std::vector<optim::bucket> whole{{0, bucket_params().size()}};
    const std::vector<std::size_t> one{0};
    for (const auto& opt : larses)
      require_same(run_buckets<lockstep::codec::bf16>(n, opt, optim::averaging::in_collective, whole, one, how::bucketed, false),
                   run_buckets<lockstep::codec::bf16>(n, opt, optim::averaging::in_collective, whole, one, how::reference, false));
  }
}

TEST_CASE("a bucket list that cuts a tensor, overlaps, leaves a gap or runs past the end is refused", "[step][bucket]") {
  const auto& ps = bucket_params();
  const std::size_t n = ps.size(), t3 = ps[3].offset, t4 = ps[4].offset;
  auto refused = [&](std::vector<optim::bucket> b, std::vector<std::string> words) {
    lockstep::run_inproc(1, [&](group<inproc>& g) {
      std::vector<float> w(n, 1.0f), gr(n, 0.0f);
      optim::state st(ps, sgds[0]);
      lockstep::codec::fp32 c;
      const optim::plan<optim::sgd> plan{.opt = sgds[0], .params = ps, .st = st, .weights = w, .grads = gr};
      try {
        auto s = optim::begin_step(g, lockstep::topology::ring{}, c, plan, b, 0.1f);
        FAIL("accepted");
      } catch (const lockstep::error& e) {
        CHECK(e.code() == lockstep::errc::invalid_argument);
        CHECK(e.op() == "optim::step");
        for (const auto& wd : words) CHECK_THAT(e.what(), Catch::Contains(wd));
      }
    });
  };
  refused({{0, t3 + 10}, {t3 + 10, n}}, {"tensor 3 [" + std::to_string(t3) + ", ", "cut by bucket 0 [0, "});
  refused({{t4, n}, {0, t3 + 1}, {t3 + 1, t4}}, {"tensor 3", "cut by bucket 1"});
  refused({{0, t4}, {t3, n}}, {"bucket 1 [" + std::to_string(t3) + ", " + std::to_string(n) + ") overlaps bucket 0"});
  refused({{t4, n}, {0, t3}}, {"elements [" + std::to_string(t3) + ", " + std::to_string(t4) + ") are in no bucket"});
  refused({{0, t4}}, {"elements [" + std::to_string(t4) + ", " + std::to_string(n) + ") are in no bucket"});
  refused({{0, t4}, {t4, n + 16}}, {"bucket 1", "ends past the " + std::to_string(n) + " elements"});
  refused({{0, t4}, {t4, t4}, {t4, n}}, {"bucket 1", "is empty"});
  refused({}, {"no buckets"});
}

TEST_CASE("an empty parameter set steps as a no-op, fused as sharded", "[step]") {
  // optim::step's one bucket is {0, 0} there, which check_buckets used to refuse while
  // optim::update and step_sharded took the empty set (found by review).
  const optim::param_set empty(std::vector<optim::tensor_desc>{});
  lockstep::run_inproc(3, [&](group<inproc>& g) {
    std::vector<float> w, gr;
    const optim::sgd o{};
    optim::state st(empty, o);
    lockstep::codec::fp32 c;
    const optim::plan<optim::sgd> p{.opt = o, .params = empty, .st = st, .weights = w, .grads = gr};
    optim::step(g, lockstep::topology::ring{}, c, p, 0.1f);
    optim::step(g, lockstep::topology::ring{}, c, p, 0.1f);  // the group is still in step
  });
}

TEST_CASE("bucket_ready and wait refuse misuse, and a dropped step finishes its buckets", "[step][bucket]") {
  const auto& ps = bucket_params();
  const auto b = buckets_at(ps, {0, 3, 4});
  lockstep::run_inproc(1, [&](group<inproc>& g) {
    std::vector<float> w(ps.size(), 1.0f), gr(ps.size(), 0.5f);
    optim::state st(ps, sgds[0]);
    lockstep::codec::fp32 c;
    const optim::plan<optim::sgd> plan{.opt = sgds[0], .params = ps, .st = st, .weights = w, .grads = gr};
    const lockstep::topology::ring ring;
    {
      auto s = optim::begin_step(g, ring, c, plan, b, 0.1f);
      s.bucket_ready(1);
      CHECK_THROWS_WITH(s.bucket_ready(1), Catch::Contains("bucket 1 [") && Catch::Contains("made ready twice"));
      CHECK_THROWS_WITH(s.bucket_ready(3), Catch::Contains("bucket_ready(3) of a list of 3 buckets"));
      s.bucket_ready(2);
      CHECK_THROWS_WITH(s.wait(), Catch::Contains("bucket_ready was never called for bucket(s) 0 of 3"));
      CHECK_THROWS_WITH(s.bucket_ready(0), Catch::Contains("after wait()"));
      CHECK_THROWS_WITH(s.wait(), Catch::Contains("wait() called twice"));
    }
    CHECK(st.steps() == 0);
    // Dropped without wait(): the destructor waits for the started bucket, whose update ran.
    std::fill(w.begin(), w.end(), 1.0f);
    {
      auto s = optim::begin_step(g, ring, c, plan, b, 0.1f);
      s.bucket_ready(0);  // the last tensors: [offset of tensor 4, end)
    }
    CHECK(st.steps() == 0);
    CHECK(w[ps[4].offset] != 1.0f);
    CHECK(w[ps.size() - 1] != 1.0f);
    CHECK(w[0] == 1.0f);
    // The group is usable afterwards: a whole step runs.
    optim::step(g, ring, c, plan, 0.1f);
    CHECK(st.steps() == 1);
  });
}

TEST_CASE("a failing bucket's collective surfaces from wait(), naming the bucket", "[step][bucket]") {
  // Rank 1 never makes the last bucket ready, so rank 0's all-reduce of it times out; both ranks'
  // earlier buckets complete and are applied.
  const auto& ps = bucket_params();
  const auto b = buckets_at(ps, {0, 3, 4});
  std::vector<std::string> seen(2);
  std::vector<std::vector<float>> weights(2);
  lockstep::run_inproc(
      2,
      [&](group<inproc>& g) {
        std::vector<float> w(ps.size(), 1.0f), gr(ps.size(), 0.5f);
        optim::state st(ps, sgds[0]);
        lockstep::codec::fp32 c;
        const optim::plan<optim::sgd> plan{.opt = sgds[0], .params = ps, .st = st, .weights = w, .grads = gr};
        auto s = optim::begin_step(g, lockstep::topology::ring{}, c, plan, b, 0.1f);
        s.bucket_ready(0);
        s.bucket_ready(1);
        if (g.rank() == 0) s.bucket_ready(2);
        try {
          s.wait();
          seen[g.rank()] = "no error";
        } catch (const lockstep::error& e) {
          seen[g.rank()] = e.what();
          if (g.rank() == 0) {
            CHECK(e.code() == lockstep::errc::timeout);
            CHECK(e.peer() == 1);
          }
        }
        weights[g.rank()] = w;
      },
      {.timeout = std::chrono::milliseconds(300)});
  INFO(seen[0] << "\n" << seen[1]);
  CHECK_THAT(seen[0], Catch::Contains("optim::step on rank 0 (peer 1)") && Catch::Contains("bucket 2 [0, ") &&
                          Catch::Contains("all_reduce"));
  CHECK_THAT(seen[1], Catch::Contains("bucket_ready was never called for bucket(s) 2 of 3"));
  for (int r = 0; r < 2; ++r) {
    CHECK(weights[r][ps.size() - 1] != 1.0f);  // bucket 0
    CHECK(weights[r][ps[3].offset] != 1.0f);   // bucket 1
  }
}

TEST_CASE("sharded step with the average in the collective equals the fused step", "[step]") {
  // SGD is per element, so sharding changes nothing; the divide happens once either way.
  for (int n = 1; n <= 5; ++n) {
    INFO(n << " ranks");
    const auto& ps = bucket_params();
    std::vector<std::vector<float>> out(2 * n);
    lockstep::run_inproc(n, [&](group<inproc>& g) {
      for (int sharded = 0; sharded < 2; ++sharded) {
        std::vector<float> w(ps.size()), gr(ps.size());
        for (std::size_t i = 0; i < w.size(); ++i) w[i] = weight0(i);
        optim::state st(ps, sgds[0]);
        lockstep::codec::fp32 c;
        const optim::plan<optim::sgd> plan{.opt = sgds[0], .params = ps, .st = st, .weights = w, .grads = gr,
                                           .average = optim::averaging::in_collective};
        for (int s = 0; s < steps; ++s) {
          for (std::size_t i = 0; i < gr.size(); ++i) gr[i] = grad(g.rank(), s, i);
          if (sharded) optim::step_sharded(g, lockstep::topology::ring{}, c, plan, lrs[s]);
          else optim::step(g, lockstep::topology::ring{}, c, plan, lrs[s]);
        }
        out[2 * g.rank() + sharded] = w;
      }
    });
    for (int r = 0; r < n; ++r) REQUIRE(out[2 * r + 1] == out[0]);
  }
}


TEST_CASE("the gaps between tensors and the buffers' tails are the caller's, fused and sharded", "[step]") {
  // param_set: gaps are never written; plan: the buffers hold at least params.size() elements.
  // Each rank puts its own values in the gaps and past the end: a step must leave them there (the
  // sharded step's all-gather carried the owner's gap values to every rank; the fused step
  // refused buffers longer than the parameters).
  const auto ps = optim::param_set::packed(std::vector<std::size_t>{100, 37, 5}, {}, 16);
  REQUIRE(ps.size() > 142);  // gaps: 100..112, 149..160
  const std::size_t extra = 16;
  for (const mode m : {mode::fused, mode::sharded}) {
    for (int n : {1, 3}) {
      INFO((m == mode::fused ? "fused" : "sharded") << ", " << n << " ranks");
      std::vector<std::vector<float>> tensors(static_cast<std::size_t>(n));
      lockstep::run_inproc(n, [&](group<inproc>& g) {
        const float mine = 1000.0f + float(g.rank());
        std::vector<float> w(ps.size() + extra, mine), gr(ps.size() + extra, 0.0f);
        for (std::size_t t = 0; t < ps.tensor_count(); ++t)
          for (std::size_t i = ps[t].offset; i < ps[t].offset + ps[t].size; ++i) w[i] = weight0(i), gr[i] = grad(g.rank(), 0, i);
        optim::lars opt{};
        optim::state st(ps, opt);
        lockstep::codec::fp32 codec;
        const optim::plan<optim::lars> plan{.opt = opt, .params = ps, .st = st, .weights = w, .grads = gr};
        if (m == mode::fused) optim::step(g, lockstep::topology::ring{}, codec, plan, 0.5f);
        else optim::step_sharded(g, lockstep::topology::ring{}, codec, plan, 0.5f);
        std::vector<float> values;
        for (std::size_t i = 0, t = 0; i < w.size(); ++i) {
          while (t < ps.tensor_count() && i >= ps[t].offset + ps[t].size) ++t;
          const bool in_tensor = t < ps.tensor_count() && i >= ps[t].offset;
          if (in_tensor) values.push_back(w[i]);
          else if (w[i] != mine) FAIL("rank " << g.rank() << ": element " << i << " outside every tensor changed to " << w[i]);
        }
        tensors[static_cast<std::size_t>(g.rank())] = values;
      });
      for (const auto& t : tensors) CHECK(t == tensors[0]);
      CHECK(tensors[0].size() == 142);
    }
  }
}

TEST_CASE("sharded LARS keeps fp64's range in the norms it gathers", "[step]") {
  // The per-rank partial sums of squares used to be all-reduced as fp32: a weight of 1e20 made
  // ‖w‖² Inf (λ NaN) and a gradient of 1e-23 made ‖g‖² 0 (λ 1). Tensor 0 is cut by the chunks of
  // 3 ranks; the fused step (one rank's fp64 sums) is the reference.
  const auto ps = optim::param_set::packed(std::vector<std::size_t>{300, 7, 200});
  auto fill = [&](std::vector<float>& w, std::vector<float>& gr, int rank) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const bool t0 = i < 300, t1 = i >= ps[1].offset && i < ps[1].offset + 7;
      w[i] = t0 ? 1e20f * (1.0f + 0.001f * float(i % 7)) : t1 ? 0.5f : 1e-23f * float(1 + i % 5);
      gr[i] = t0 ? 1.0f + float(rank) : t1 ? 1e-23f * float(1 + rank) : 2e-25f;
    }
  };
  std::vector<std::vector<float>> got(2);
  for (const mode m : {mode::fused, mode::sharded}) {
    std::vector<std::vector<float>> per(3);
    lockstep::run_inproc(3, [&](group<inproc>& g) {
      std::vector<float> w(ps.size()), gr(ps.size());
      fill(w, gr, g.rank());
      optim::lars opt{.momentum = 0.0f};
      optim::state st(ps, opt);
      lockstep::codec::fp32 codec;
      const optim::plan<optim::lars> plan{.opt = opt, .params = ps, .st = st, .weights = w, .grads = gr};
      if (m == mode::fused) optim::step(g, lockstep::topology::ring{}, codec, plan, 1.0f);
      else optim::step_sharded(g, lockstep::topology::ring{}, codec, plan, 1.0f);
      per[static_cast<std::size_t>(g.rank())] = w;
    });
    for (const auto& w : per) CHECK(w == per[0]);
    got[m == mode::fused ? 0 : 1] = per[0];
  }
  std::vector<float> w0(ps.size()), g0(ps.size());
  fill(w0, g0, 0);
  for (std::size_t t = 0; t < ps.tensor_count(); ++t)
  for (std::size_t i = ps[t].offset; i < ps[t].offset + ps[t].size; ++i) {
    INFO("element " << i);
    REQUIRE(std::isfinite(got[1][i]));
    CHECK(got[1][i] != w0[i]);  // every tensor moved: no λ of 0 or NaN
    CHECK(std::fabs(double(got[1][i]) - double(got[0][i])) <= 1e-6 * std::fabs(double(got[0][i])));
  }
}
