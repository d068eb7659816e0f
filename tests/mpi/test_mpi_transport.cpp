// The mpi transport under mpirun -np 1..4: point to point in order, size mismatches as errors,
// deadlines, abandoned requests, split and abort. Ranks talk in a ring (rank -> rank + 1), which
// with one rank is a message to itself.
#include <lockstep/transport/mpi.hpp>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <numeric>
#include <vector>

using namespace lockstep;
using transport::mpi;
using namespace std::chrono_literals;

namespace {

auto soon(std::chrono::milliseconds d = 20000ms) { return transport::clock::now() + d; }

struct ring_peers {
  int rank, size, next, prev;
  explicit ring_peers(const mpi& t)
      : rank(t.rank()), size(t.size()), next((t.rank() + 1) % t.size()), prev((t.rank() + t.size() - 1) % t.size()) {}
};

std::vector<std::uint8_t> pattern(int rank, std::size_t n, int salt = 0) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 31 + static_cast<std::size_t>(rank) * 7 + static_cast<std::size_t>(salt));
  return v;
}

// The error a call throws, or a default one with an impossible code when it throws none.
template <class F>
error caught(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e;
  }
  return error(errc::transport, "nothing thrown", -1, -1, "");
}

}  // namespace

TEST_CASE("mpi moves bytes to the next rank, in order per (peer, tag)", "[mpi][transport]") {
  mpi t(MPI_COMM_WORLD);
  const ring_peers p(t);
  CHECK(t.name() == "mpi");
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  CHECK(t.size() == world);
  // 0 bytes, eager sizes, and sizes that take MPI's rendezvous path.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4093}, std::size_t{1} << 20, std::size_t{9} << 20}) {
    INFO(n << " bytes");
    const auto out = pattern(p.rank, n);
    std::vector<std::uint8_t> in(n, 0xee);
    auto r = t.irecv(p.prev, 5, in.data(), n);
    auto s = t.isend(p.next, 5, out.data(), n);
    REQUIRE(t.wait(r, soon()));
    REQUIRE(t.wait(s, soon()));
    CHECK(in == pattern(p.prev, n));
    CHECK(t.wait(r, soon()));  // a finished request stays finished
  }
  // Three messages on one tag arrive in the order they were sent.
  std::vector<std::vector<std::uint8_t>> out, in(3, std::vector<std::uint8_t>(1000));
  std::vector<mpi::request> reqs;
  for (int k = 0; k < 3; ++k) out.push_back(pattern(p.rank, 1000, k));
  for (int k = 0; k < 3; ++k) reqs.push_back(t.isend(p.next, 6, out[static_cast<std::size_t>(k)].data(), 1000));
  for (int k = 0; k < 3; ++k) reqs.push_back(t.irecv(p.prev, 6, in[static_cast<std::size_t>(k)].data(), 1000));
  for (auto& r : reqs) REQUIRE(t.wait(r, soon()));
  for (int k = 0; k < 3; ++k) CHECK(in[static_cast<std::size_t>(k)] == pattern(p.prev, 1000, k));

  // Waiting for a large send before the receive still completes both: the posted receive is
  // matched while this rank waits for its send, as MPI_Irecv's would be.
  const auto big_out = pattern(p.rank, std::size_t{4} << 20);
  std::vector<std::uint8_t> big_in(big_out.size());
  auto r = t.irecv(p.prev, 11, big_in.data(), big_in.size());
  auto s = t.isend(p.next, 11, big_out.data(), big_out.size());
  REQUIRE(t.wait(s, soon()));
  REQUIRE(t.wait(r, soon()));
  CHECK(big_in == pattern(p.prev, big_in.size()));
}

TEST_CASE("mpi reports a message of another size as a mismatch naming the peer", "[mpi][transport]") {
  mpi t(MPI_COMM_WORLD);
  const ring_peers p(t);
  SECTION("longer than expected, eager and rendezvous") {
    for (std::size_t n : {std::size_t{8}, std::size_t{1} << 20}) {
      INFO(n << " bytes expected");
      std::vector<std::uint8_t> out(2 * n), in(n);
      auto s = t.isend(p.next, 9, out.data(), out.size());
      auto r = t.irecv(p.prev, 9, in.data(), in.size());
      const error e = caught([&] { t.wait(r, soon()); });
      CHECK(e.code() == errc::mismatch);
      CHECK(e.peer() == p.prev);
      CHECK(e.op() == "recv");
      CHECK_THAT(e.what(), Catch::Contains("expected a message of " + std::to_string(n) + " bytes, the peer sent " + std::to_string(2 * n)));
      CHECK(t.wait(s, soon()));  // the sender is released even so
    }
  }
  SECTION("shorter than expected") {
    std::uint32_t out = 7;
    std::uint64_t in = 0;
    auto s = t.isend(p.next, 10, &out, sizeof out);
    auto r = t.irecv(p.prev, 10, &in, sizeof in);
    const error e = caught([&] { t.wait(r, soon()); });
    CHECK(e.code() == errc::mismatch);
    CHECK(e.peer() == p.prev);
    CHECK_THAT(e.what(), Catch::Contains("expected a message of 8 bytes, the peer sent 4"));
    CHECK(t.wait(s, soon()));
  }
}

TEST_CASE("mpi wait stops at its deadline, and abandoned requests do not block", "[mpi][transport]") {
  mpi t(MPI_COMM_WORLD);
  const ring_peers p(t);
  std::vector<std::uint8_t> big(std::size_t{8} << 20), small(64);
  const auto t0 = transport::clock::now();
  {
    // Nobody sends on tag 77.
    auto r = t.irecv(p.prev, 77, small.data(), small.size());
    CHECK_FALSE(t.wait(r, soon(100ms)));
    CHECK(transport::clock::now() - t0 >= 100ms);
  }  // destroyed unfinished here
  MPI_Barrier(MPI_COMM_WORLD);
  {
    // Nobody receives on tag 78, or anything else meanwhile: MPI's rendezvous waits for a
    // receive, a shared-memory ring (2 MiB) fills up.
    auto s = t.isend(p.next, 78, big.data(), big.size());
    CHECK_FALSE(t.wait(s, soon(100ms)));
  }  // destroyed unfinished: the rest of the message goes as zeros, marked withdrawn
  CHECK(transport::clock::now() - t0 < 3s);
  // The endpoint still works: a later message on the abandoned receive's tag reaches a new one.
  MPI_Barrier(MPI_COMM_WORLD);
  std::uint8_t x = static_cast<std::uint8_t>(p.rank), y = 0xff;
  auto r = t.irecv(p.prev, 77, &y, 1);
  auto s = t.isend(p.next, 77, &x, 1);
  REQUIRE(t.wait(r, soon()));
  REQUIRE(t.wait(s, soon()));
  CHECK(y == static_cast<std::uint8_t>(p.prev));
}

TEST_CASE("mpi split makes a communicator per colour, ranked by key", "[mpi][transport]") {
  mpi t(MPI_COMM_WORLD);
  const ring_peers p(t);
  // Colour by parity; key = -rank reverses the order inside each colour.
  mpi sub = t.split(p.rank % 2, -p.rank, soon());
  std::vector<int> members;
  for (int r = p.size - 1; r >= 0; --r)
    if (r % 2 == p.rank % 2) members.push_back(r);
  REQUIRE(sub.size() == static_cast<int>(members.size()));
  CHECK(members[static_cast<std::size_t>(sub.rank())] == p.rank);
  CHECK(sub.comm() != t.comm());

  // The same tag on parent and child: each message stays on its own communicator.
  const int sub_next = (sub.rank() + 1) % sub.size(), sub_prev = (sub.rank() + sub.size() - 1) % sub.size();
  int on_sub = -1, on_parent = -1;
  const int mine = p.rank;
  auto rs = sub.irecv(sub_prev, 3, &on_sub, sizeof(int));
  auto rp = t.irecv(p.prev, 3, &on_parent, sizeof(int));
  auto ss = sub.isend(sub_next, 3, &mine, sizeof(int));
  auto sp = t.isend(p.next, 3, &mine, sizeof(int));
  REQUIRE(t.wait(rp, soon()));
  REQUIRE(sub.wait(rs, soon()));
  REQUIRE(t.wait(sp, soon()));
  REQUIRE(sub.wait(ss, soon()));
  CHECK(on_parent == p.prev);
  CHECK(on_sub == members[static_cast<std::size_t>(sub_prev)]);

  // Copies share the communicator; a split of a split works like any other.
  const mpi copy = sub;
  CHECK(copy.comm() == sub.comm());
  mpi single = sub.split(sub.rank(), 0, soon());
  CHECK(single.size() == 1);
  CHECK(single.rank() == 0);

  CHECK(caught([&] { t.split(-1, 0, soon()); }).code() == errc::invalid_argument);
}

TEST_CASE("mpi split that a rank never enters times out on the others", "[mpi][transport]") {
  mpi t(MPI_COMM_WORLD);
  const ring_peers p(t);
  if (p.size == 1) return;  // nobody to wait for
  if (p.rank != p.size - 1) {
    const auto t0 = transport::clock::now();
    const error e = caught([&] { t.split(0, 0, soon(300ms)); });
    CHECK(e.code() == errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("not every rank of the group called split"));
    CHECK(transport::clock::now() - t0 < 3s);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi abort marks the endpoint and every copy; bad arguments are errors", "[mpi][transport]") {
  mpi t(MPI_COMM_WORLD);
  const ring_peers p(t);
  int x = 0;
  CHECK(caught([&] { t.isend(p.size, 0, &x, sizeof x); }).code() == errc::invalid_argument);
  CHECK(caught([&] { t.irecv(-1, 0, &x, sizeof x); }).code() == errc::invalid_argument);
  CHECK(caught([] { mpi{}.isend(0, 0, nullptr, 0); }).code() == errc::invalid_argument);

  mpi copy = t;
  CHECK_FALSE(copy.aborted());
  t.abort("rank gave up");
  CHECK(copy.aborted());
  const error e = caught([&] { copy.isend(p.next, 1, &x, sizeof x); });
  CHECK(e.code() == errc::aborted);
  CHECK_THAT(e.what(), Catch::Contains("rank gave up"));
  CHECK(caught([&] { copy.split(0, 0, soon()); }).code() == errc::aborted);
}

TEST_CASE("mpi_session joins an MPI that is already running and leaves it running", "[mpi][transport]") {
  {
    transport::mpi_session again;
    CHECK(again.thread_level() >= MPI_THREAD_SERIALIZED);
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  CHECK(finalized == 0);
}
