// Collectives over the mpi transport under mpirun -np 1..4: every op x topology x codec, counts 0,
// 1, N-1, a prime and 4 Mi; asynchronous calls, split groups, barrier; and mismatch and timeout
// errors that arrive in seconds. The checks are those of tests/test_collective.cpp:
//   fp32 exact on integer-valued inputs (nccl-tests style);
//   lossy codecs |y - exact| <= (H + 1) * delta * M (docs/codecs.md), H the reduce-scatter hops,
//   delta the codec's error per quantisation relative to its block's absmax, M = max_i sum_r |x_r[i]|;
//   the same bits on every rank.
// Every rank computes the fp64 reference itself: inputs are a function of (rank, index) alone.
// Failures are CHECKs, not REQUIREs, so that a rank that fails one still takes part in the
// collectives that follow and the others do not wait for it until their timeout.
#include <lockstep/lockstep.hpp>
#include <lockstep/transport/counting.hpp>
#include <lockstep/transport/mpi.hpp>

#include "../collective_bounds.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

using namespace lockstep;
using lockstep_test::delta;
using lockstep_test::exact;
using lockstep_test::hops;
using namespace std::chrono_literals;
using mpi_group = group<transport::mpi>;

namespace {

// A fresh group over a duplicate of MPI_COMM_WORLD: earlier test cases cannot leave messages in it.
mpi_group world_group(std::chrono::milliseconds timeout = 60s) {
  group_options o;
  o.timeout = timeout;
  return mpi_group(transport::mpi(MPI_COMM_WORLD), o);
}

// Integers in [-8, 8] for exact fp32 checks, standard normal values otherwise (Box-Muller over a
// hash of (rank, i), cheap enough for 4 Mi elements on every rank).
float input(int rank, std::size_t i, bool integer) {
  auto mix = [](std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const std::uint64_t h = mix(i * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank + 1) * 0xd1b54a32d192ed03ull);
  if (integer) return static_cast<float>(static_cast<int>((h >> 7) % 17) - 8);
  const double u1 = (static_cast<double>(h >> 11) + 0.5) / 9007199254740992.0;
  const double u2 = static_cast<double>(mix(h) >> 11) / 9007199254740992.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// "" when y is within the bound of `ref` (exactly equal for fp32), else the first bad element.
template <class C>
std::string check_close(const float* y, const std::vector<double>& ref, double m, int h, int n, double scale) {
  const double bound = lockstep_test::error_factor<C>(h + 1, n) * m * scale * (codec::feedback_codec<C> ? 2 : 1) + n * 1e-6 * m * scale;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const bool ok = exact<C> ? static_cast<double>(y[i]) == ref[i] : std::abs(y[i] - ref[i]) <= bound;
    if (!ok) {
      std::ostringstream o;
      o << "element " << i << ": " << y[i] << " vs " << ref[i] << " (bound " << bound << ")";
      return o.str();
    }
  }
  return {};
}

// True when every rank of `comm` holds the same bytes.
bool same_everywhere(const float* y, std::size_t n, MPI_Comm comm) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* b = reinterpret_cast<const unsigned char*>(y);
  for (std::size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  std::uint64_t lo = h, hi = h;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, comm);
  return lo == hi;
}

template <class C, class T>
void all_reduce_case(mpi_group& g, const T& topo, std::size_t count, reduce_op op) {
  const int n = g.size();
  const bool integer = exact<C>;
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = input(g.rank(), i, integer);
  C c{};
  all_reduce(g, std::span<float>(v), topo, c, op);
  const auto [ref, m] = lockstep_test::reference_all_reduce(n, count, op == reduce_op::average,
                                                           [&](int r, std::size_t i) { return input(r, i, integer); });
  INFO("all_reduce " << (op == reduce_op::sum ? "sum" : "average"));
  CHECK(check_close<C>(v.data(), ref, m, hops(topo, n), lockstep_test::quantisations(topo, n),
                       op == reduce_op::average ? 1.0 / n : 1.0) == "");
  CHECK(same_everywhere(v.data(), count, g.transport().comm()));
}

template <class C, class T>
void reduce_scatter_case(mpi_group& g, const T& topo, std::size_t m_per) {
  const int n = g.size();
  const bool integer = exact<C>;
  const std::size_t count = m_per * static_cast<std::size_t>(n), first = m_per * static_cast<std::size_t>(g.rank());
  std::vector<float> in(count), out(m_per, -1.0f);
  for (std::size_t i = 0; i < count; ++i) in[i] = input(g.rank(), i, integer);
  const auto copy = in;
  C c{};
  reduce_scatter(g, std::span<const float>(in), std::span<float>(out), topo, c);
  std::vector<double> ref(m_per, 0.0);
  double mx = 0;
  for (std::size_t i = 0; i < count; ++i) {  // M over the whole buffer: partial sums of every chunk travel
    double a = 0;
    for (int q = 0; q < n; ++q) {
      const float x = input(q, i, integer);
      if (i >= first && i < first + m_per) ref[i - first] += x;
      a += std::abs(x);
    }
    mx = std::max(mx, a);
  }
  INFO("reduce_scatter");
  CHECK(in == copy);  // the input is not touched
  CHECK(check_close<C>(out.data(), ref, std::max(mx, 1.0), hops(topo, n), n, 1.0) == "");
}

template <class C, class T>
void all_gather_case(mpi_group& g, const T& topo, std::size_t m_per) {
  const int n = g.size();
  const bool integer = exact<C>;
  std::vector<float> in(m_per), out(m_per * static_cast<std::size_t>(n), -1.0f);
  for (std::size_t k = 0; k < m_per; ++k) in[k] = input(g.rank(), k, integer);
  C c{};
  all_gather(g, std::span<const float>(in), std::span<float>(out), topo, c);
  std::vector<double> ref(out.size());
  double mx = 1;
  for (int r = 0; r < n; ++r)
    for (std::size_t k = 0; k < m_per; ++k) {
      ref[static_cast<std::size_t>(r) * m_per + k] = input(r, k, integer);
      mx = std::max(mx, std::abs(ref[static_cast<std::size_t>(r) * m_per + k]));
    }
  INFO("all_gather");
  CHECK(check_close<C>(out.data(), ref, mx, 0, 1, 1.0) == "");
  CHECK(same_everywhere(out.data(), out.size(), g.transport().comm()));
}

template <class C, class T>
void broadcast_case(mpi_group& g, const T& topo, std::size_t count, int root) {
  const bool integer = exact<C>;
  std::vector<float> v(count, 0.0f);
  if (g.rank() == root)
    for (std::size_t i = 0; i < count; ++i) v[i] = input(root, i, integer);
  C c{};
  broadcast(g, std::span<float>(v), root, topo, c);
  std::vector<double> ref(count);
  double mx = 1;
  for (std::size_t i = 0; i < count; ++i) ref[i] = input(root, i, integer), mx = std::max(mx, std::abs(ref[i]));
  INFO("broadcast from " << root);
  CHECK(check_close<C>(v.data(), ref, mx, 0, 1, 1.0) == "");
  CHECK(same_everywhere(v.data(), count, g.transport().comm()));
}

template <class C>
void every_op(mpi_group& g) {
  const int n = g.size();
  const std::vector<std::size_t> counts = {0, 1, static_cast<std::size_t>(n - 1), 10007};
  auto each = [&](const auto& topo) {
    std::string shape = topo.name();
    if constexpr (std::is_same_v<std::decay_t<decltype(topo)>, topology::torus2d>) {
      const auto [rows, cols] = topo.shape(n);
      shape += " " + std::to_string(rows) + "x" + std::to_string(cols);
    }
    INFO("topology " << shape << ", N = " << n);
    for (std::size_t count : counts) {
      INFO("count " << count);
      all_reduce_case<C>(g, topo, count, reduce_op::sum);
      all_reduce_case<C>(g, topo, count, reduce_op::average);
      reduce_scatter_case<C>(g, topo, count == 10007 ? 1009 : count);
      all_gather_case<C>(g, topo, count == 10007 ? 1009 : count);
      broadcast_case<C>(g, topo, count, n - 1);
    }
  };
  each(topology::ring{});
  each(topology::torus2d{});
  if (n == 4) each(topology::torus2d{4, 1});  // a torus that is not square
  if (n == 3) each(topology::torus2d{3, 1});
  each(topology::halving_doubling{});  // n = 3: one folded pair
  each(topology::recursive_doubling{});
  each(topology::direct{});  // the fan-in: every peer's copy lands in a slot of its own
}

// The error a call throws; errc::invalid_argument with op "nothing thrown" when it throws none.
template <class F>
error caught(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e;
  }
  return error(errc::invalid_argument, "nothing thrown", -1, -1, "");
}

// Every rank hears of a failing rank at once (its abort message, and through shared memory its
// flag): it throws errc::aborted with that rank's message instead of reaching its own diagnosis.
// Either way the error says what went wrong: `what` is in the message.
bool is_or_relays(const error& e, errc code, const std::string& what) {
  const std::string text = e.what();
  if (e.code() == code) return what.empty() || text.find(what) != std::string::npos;
  return e.code() == errc::aborted && text.find(std::string(to_string(code))) != std::string::npos &&
         text.find(what) != std::string::npos;
}
bool timeout_or_mismatch(const error& e) {
  return is_or_relays(e, errc::timeout, "") || is_or_relays(e, errc::mismatch, "");
}

}  // namespace

TEMPLATE_TEST_CASE("every op x topology over mpi", "[mpi][collective]", codec::fp32, codec::bf16, codec::int8,
                   codec::dyntree8, codec::error_feedback<codec::int8>) {
  mpi_group g = world_group();
  every_op<TestType>(g);
}

TEST_CASE("4 Mi elements over mpi: fp32 exact, dyntree8 bounded, ring and torus", "[mpi][collective][large]") {
  mpi_group g = world_group();
  const std::size_t big = std::size_t{4} << 20;
  all_reduce_case<codec::fp32>(g, topology::ring{}, big + 3, reduce_op::sum);
  all_reduce_case<codec::fp32>(g, topology::torus2d{}, big, reduce_op::sum);
  all_reduce_case<codec::dyntree8>(g, topology::torus2d{}, big, reduce_op::average);
  // Chunks of several segments: the fan-in's landing slots per peer and segment.
  all_reduce_case<codec::fp32>(g, topology::direct{}, big + 5, reduce_op::sum);
  all_reduce_case<codec::dyntree8>(g, topology::direct{}, big + 5, reduce_op::sum);
}

TEST_CASE("over shared memory a reduce step's sums go straight into the next step's messages, exactly", "[mpi][collective][needs_shm]") {
  using counted = transport::counting<transport::mpi>;
  group_options o;
  o.timeout = 60s;
  group<counted> g(counted(transport::mpi(MPI_COMM_WORLD)), o);
  const int n = g.size();
  if (n > 1 && g.transport().inner().shared_memory_peers() == 0) FAIL("shared memory is off: " << g.transport().inner().shared_memory_note());
  auto run = [&](const auto& topo, std::size_t count) {
    std::vector<float> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = input(g.rank(), i, true);
    codec::fp32 c;
    g.transport().reset();
    all_reduce(g, std::span<float>(v), topo, c);
    const auto filled = g.transport().sent().filled;
    bool exact_sum = true;
    for (std::size_t i = 0; i < count && exact_sum; ++i) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += input(r, i, true);
      exact_sum = static_cast<double>(v[i]) == want;
    }
    CHECK(exact_sum);
    return filled;
  };
  // 1 MiB: every partial sum a ring's reduce-scatter passes on (all its steps but the last) fits
  // the 2 MiB ring whole, as does halving-doubling's quarter at 4 ranks; at 2 ranks no step
  // passes a sum on.
  const std::size_t mib = std::size_t{1} << 18;
  CHECK(run(topology::ring{}, mib) == static_cast<std::uint64_t>(std::max(n - 2, 0)));
  if (n == 4) CHECK(run(topology::halving_doubling{}, mib) == 1);
  if (n <= 2) CHECK(run(topology::halving_doubling{}, mib) == 0);
  // Prime counts, tiny and past a segment per chunk (where a fill may find no room and the rest
  // of the step goes the usual way), on every topology that reduces in steps.
  for (std::size_t count : {std::size_t{7}, std::size_t{1000003}}) {
    INFO("count " << count);
    run(topology::ring{}, count);
    run(topology::torus2d{}, count);
    run(topology::halving_doubling{}, count);
    run(topology::direct{}, count);
  }
  // The fills are counted as data like any send: the same bytes on the wire as through MPI.
  std::vector<float> v(mib, 1.0f);
  codec::fp32 c;
  g.transport().reset();
  all_reduce(g, std::span<float>(v), topology::ring{}, c);
  const std::uint64_t want_bytes = n > 1 ? 2 * static_cast<std::uint64_t>(n - 1) * (mib * sizeof(float) / static_cast<std::uint64_t>(n)) : 0;
  if (mib % static_cast<std::size_t>(n) == 0) CHECK(g.transport().sent().bytes == want_bytes);
}

TEST_CASE("results over mpi are the same from run to run", "[mpi][collective]") {
  mpi_group g = world_group();
  auto once = [&] {
    std::vector<float> v(50000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = input(g.rank(), i, false);
    codec::dyntree8 c;
    all_reduce(g, std::span<float>(v), topology::ring{}, c);
    return v;
  };
  const auto a = once(), b = once();
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("asynchronous all_reduce over mpi overlaps the caller and keeps call order", "[mpi][collective][async]") {
  mpi_group g = world_group();
  const int n = g.size();
  std::vector<float> a(100003), b(7);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = input(g.rank(), i, true);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = input(g.rank(), i + 1000000, true);
  codec::fp32 c;
  auto ra = all_reduce_async(g, std::span<float>(a), topology::ring{}, c);
  auto rb = all_reduce_async(g, std::span<float>(b), topology::torus2d{}, c);
  all_reduce(g, std::span<float>(b), topology::ring{}, c);  // queued behind both: runs third
  ra.wait();
  rb.wait();
  std::vector<double> ra_ref(a.size(), 0.0), rb_ref(b.size(), 0.0);
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < a.size(); ++i) ra_ref[i] += input(r, i, true);
    for (std::size_t i = 0; i < b.size(); ++i) rb_ref[i] += input(r, i + 1000000, true);
  }
  for (auto& x : rb_ref) x *= n;  // b was reduced twice
  CHECK(check_close<codec::fp32>(a.data(), ra_ref, 0, 0, n, 1) == "");
  CHECK(check_close<codec::fp32>(b.data(), rb_ref, 0, 0, n, 1) == "");
}

TEST_CASE("split groups over mpi reduce among their own members; barrier waits for everyone", "[mpi][collective][split]") {
  mpi_group g = world_group();
  const int n = g.size(), me = g.rank();
  // Colour by parity, key reverses the order: statistics of batch norm groups, say.
  mpi_group sub = g.split(me % 2, -me);
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  REQUIRE(sub.size() == static_cast<int>(members.size()));
  CHECK(members[static_cast<std::size_t>(sub.rank())] == me);
  std::vector<float> v(1001);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = input(me, i, true);
  codec::fp32 c;
  all_reduce(sub, std::span<float>(v), topology::torus2d{}, c, reduce_op::sum);
  std::vector<double> ref(v.size(), 0.0);
  for (int r : members)
    for (std::size_t i = 0; i < v.size(); ++i) ref[i] += input(r, i, true);
  CHECK(check_close<codec::fp32>(v.data(), ref, 0, 0, n, 1) == "");

  // barrier: the last rank arrives late, nobody leaves before it arrives.
  barrier(g);
  if (me == n - 1) std::this_thread::sleep_for(300ms);
  const auto t0 = transport::clock::now();
  barrier(g);
  if (n > 1) CHECK(transport::clock::now() - t0 >= (me == n - 1 ? 0ms : 200ms));
}

TEST_CASE("mismatched counts and codecs over mpi are errors naming the peer, in seconds", "[mpi][collective][errors]") {
  int n = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (n == 1) return;  // nobody to disagree with
  const int prev = (me + n - 1) % n;
  std::vector<float> v(1000 + (me == 0 ? 1 : 0), 1.0f);

  SECTION("count") {
    mpi_group g = world_group(2s);
    const auto t0 = transport::clock::now();
    codec::fp32 c;
    const error e = caught([&] { all_reduce(g, std::span<float>(v), topology::ring{}, c); });
    CHECK(transport::clock::now() - t0 < 10s);
    // Ranks 0 and 1 read rank 0's or rank n-1's header and see the disagreement; the others wait
    // for data that never comes.
    CHECK(e.op() == "all_reduce(ring, fp32)");
    if (me <= 1 && e.code() == errc::mismatch) {
      CHECK(e.peer() == prev);
      CHECK_THAT(e.what(), Catch::Contains("element count " + std::to_string(me == 0 ? 1001 : 1000) + " here, " +
                                           std::to_string(me == 0 ? 1000 : 1001) + " on the peer"));
    } else if (me <= 1) {
      CHECK(is_or_relays(e, errc::mismatch, "element count"));  // relayed: the other rank's words
    } else {
      CHECK(timeout_or_mismatch(e));
    }
  }
  SECTION("codec") {
    mpi_group g = world_group(2s);
    v.resize(1000);
    codec::fp32 f;
    codec::bf16 b;
    const auto t0 = transport::clock::now();
    const error e = caught([&] {
      if (me == 0) all_reduce(g, std::span<float>(v), topology::ring{}, b);
      else all_reduce(g, std::span<float>(v), topology::ring{}, f);
    });
    CHECK(transport::clock::now() - t0 < 10s);
    if (me <= 1) {
      CHECK(is_or_relays(e, errc::mismatch, "codecs differ"));
      if (e.code() == errc::mismatch) CHECK(e.peer() == prev);
    } else {
      CHECK(timeout_or_mismatch(e));
    }
  }
  SECTION("operation: a failing call leaves the buffer as it was") {
    // Same count and codec. With 2 ranks rank 0's all_reduce sends chunk 0 (500 values; fp32
    // sends its first step beside the headers) and rank 1's broadcast first receives chunk 1 (500
    // values, the root's scatter): equal sizes, so only the header tells them apart. No receive
    // may be posted into the buffer before the header is checked (MPI would start copying a
    // matched message while the rank waits for anything).
    mpi_group g = world_group(2s);
    v.assign(1000, static_cast<float>(me + 1));
    codec::fp32 c;
    const error e = caught([&] {
      if (me == 0) {
        all_reduce(g, std::span<float>(v), topology::ring{}, c);
      } else {
        std::this_thread::sleep_for(200ms);  // rank 0's header and first data have arrived by now
        broadcast(g, std::span<float>(v), 0, topology::ring{}, c);
      }
    });
    CHECK(timeout_or_mismatch(e));
    if (me <= 1) CHECK(is_or_relays(e, errc::mismatch, "operation"));
    CHECK(std::all_of(v.begin(), v.end(), [&](float x) { return x == static_cast<float>(me + 1); }));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A LOCKSTEP_TOPOLOGY that names no topology on one rank only: that rank's call fails choosing,
// before any header, and aborts the group, so the others fail at once naming it instead of
// waiting out their (here 60 s) timeout for its headers.
TEST_CASE("a bad LOCKSTEP_TOPOLOGY on one rank fails every rank at once over mpi", "[mpi][collective][errors]") {
  int n = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (n == 1) return;
  mpi_group g = world_group(60s);
  std::vector<float> v(4096, 1.0f);
  codec::fp32 c;
  topology::automatic a;
  if (me == 1) setenv("LOCKSTEP_TOPOLOGY", "Ring", 1);
  const auto t0 = transport::clock::now();
  const error e = caught([&] { all_reduce(g, std::span<float>(v), a, c); });
  if (me == 1) unsetenv("LOCKSTEP_TOPOLOGY");
  CHECK(transport::clock::now() - t0 < 10s);
  if (me == 1) {
    CHECK(e.code() == errc::invalid_argument);
  } else {
    CHECK(e.code() == errc::aborted);
    CHECK(e.peer() == 1);
  }
  CHECK_THAT(e.what(), Catch::Contains("LOCKSTEP_TOPOLOGY=Ring"));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a rank that never calls makes the others time out over mpi, naming it", "[mpi][collective][errors]") {
  int n = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (n == 1) return;  // nobody to wait for
  mpi_group g = world_group(1s);
  std::vector<float> v(4096, 1.0f);
  if (me != n - 1) {
    codec::int8 c;
    const auto t0 = transport::clock::now();
    const error e = caught([&] { all_reduce(g, std::span<float>(v), topology::ring{}, c); });
    const auto took = transport::clock::now() - t0;
    CHECK(is_or_relays(e, errc::timeout, ""));
    if (e.code() == errc::timeout) CHECK(took >= 900ms);  // nobody gives up before its timeout
    CHECK(took < 6s);
    if (me == 0 && e.code() == errc::timeout) {  // rank 0 receives from rank n-1 first
      CHECK(e.peer() == n - 1);
      CHECK_THAT(e.what(), Catch::Contains("it has not entered this collective"));
    }
    // The failed group stays failed: the next call says so at once instead of waiting again.
    CHECK(caught([&] { all_reduce(g, std::span<float>(v), topology::ring{}, c); }).code() == errc::aborted);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
