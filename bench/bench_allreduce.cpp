// lockstep-bench-allreduce: time all_reduce for each topology x codec x size, nccl-tests style.
//
//   lockstep-bench-allreduce --transport inproc --ranks 4 --codec fp32,bf16 --sizes 4K,1M,64M
//   mpirun -np 4 lockstep-bench-allreduce --transport mpi --json
//
// Per size, each rank first checks one sum against an fp64 reference (max_rel_err =
// max_i |y_i - ref_i| / max_i |ref_i|, the largest error relative to the largest reduced value),
// then times --iters in-place sums. Every iteration reduces a different buffer of a rotating set
// larger than twice the last-level cache, so no iteration starts with its data in cache; the
// time is the slowest rank's mean (--stat median: of its rounds' median). All topology x codec cases of a size (and MPI_Allreduce) are
// timed in interleaved rounds, each round starting with the next contender, so that a neighbour's load on a shared machine skews none of them. algbw = bytes / time, busbw = algbw * 2 (N - 1) / N (the bytes
// each rank's link carries in a bandwidth-optimal all-reduce, as nccl-tests defines it). bytes
// are the fp32 input's, whatever the codec puts on the wire.
//
// Under mpirun (--transport mpi) the same buffers are then reduced by MPI_Allreduce in the same
// run, reported as topology "mpi_allreduce", so the two read side by side. The inproc transport
// runs ranks as threads of this process and needs no MPI; bench/allreduce-compare sets both
// against each other.
#include <lockstep/lockstep.hpp>
#if LOCKSTEP_HAVE_MPI
#include <lockstep/transport/mpi.hpp>
#endif
#include "cli.hpp"  // split_list, with or without MPI

#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace lockstep;
using bench_clock = std::chrono::steady_clock;

struct options {
  std::string transport;  // "" = mpi under mpirun, inproc otherwise
  std::vector<std::string> topologies{"ring"};
  std::vector<std::string> codecs{"fp32"};
  int ranks = 0;  // inproc: 0 = 4; mpi: the job's
  std::vector<std::size_t> sizes;
  int iters = 0;  // 0: about 512 MiB of input per size, 5..1000 iterations
  std::size_t segment_bytes = 0;
  bool json = false;
  bool mpi_peer = true;
  bool check = false;  // exit 1 when an error exceeds its codec's sanity bound
  bool median = false;  // --stat median: the median of the rounds' per-call times, not the mean
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "lockstep-bench-allreduce: %s\n"
               "usage: lockstep-bench-allreduce [--transport inproc|mpi] [--topology ring|torus2d|halving_doubling|recursive_doubling|direct|automatic[,..]]\n"
               "         [--codec fp32|bf16|int8|dyntree8[,..]] [--ranks N] [--sizes 4K,1M,64M]\n"
               "         [--iters N] [--segment-bytes B] [--stat mean|median] [--no-mpi-allreduce] [--json] [--check]\n",
               why);
  std::exit(2);
}

std::size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) usage(("not a size: " + s).c_str());
  std::size_t mul = 1;
  switch (*end) {
    case '\0': break;
    case 'k': case 'K': mul = std::size_t{1} << 10; ++end; break;
    case 'm': case 'M': mul = std::size_t{1} << 20; ++end; break;
    case 'g': case 'G': mul = std::size_t{1} << 30; ++end; break;
    default: usage(("not a size: " + s).c_str());
  }
  if (*end == 'i' || *end == 'B') ++end;
  if (*end == 'B') ++end;
  if (*end != '\0') usage(("not a size: " + s).c_str());
  return static_cast<std::size_t>(v) * mul;
}

bool under_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage((a + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "--transport") o.transport = value();
    else if (a == "--topology") o.topologies = lockstep::bench::split_list(value());
    else if (a == "--codec") o.codecs = lockstep::bench::split_list(value());
    else if (a == "--ranks") o.ranks = std::atoi(value().c_str());
    else if (a == "--sizes") {
      o.sizes.clear();
      for (const auto& s : lockstep::bench::split_list(value())) o.sizes.push_back(parse_bytes(s));
    } else if (a == "--iters") o.iters = std::atoi(value().c_str());
    else if (a == "--segment-bytes") o.segment_bytes = parse_bytes(value());
    else if (a == "--no-mpi-allreduce") o.mpi_peer = false;
    else if (a == "--json") o.json = true;
    else if (a == "--check") o.check = true;
    else if (a == "--stat") {
      const std::string v = value();
      if (v != "mean" && v != "median") usage(("--stat " + v + ": mean or median").c_str());
      o.median = v == "median";
    }
    else if (a == "--help" || a == "-h") usage("time all_reduce");
    else usage(("unknown flag " + a).c_str());
  }
  if (o.transport.empty()) o.transport = under_mpirun() ? "mpi" : "inproc";
  if (o.transport != "inproc" && o.transport != "mpi") usage(("unknown transport " + o.transport).c_str());
  for (const auto& t : o.topologies)
    if (t != "ring" && t != "torus2d" && t != "halving_doubling" && t != "recursive_doubling" && t != "direct" &&
        t != "automatic")
      usage(("unknown topology " + t).c_str());
  for (const auto& c : o.codecs)
    if (c != "fp32" && c != "bf16" && c != "int8" && c != "dyntree8") usage(("unknown codec " + c).c_str());
  if (o.sizes.empty())
    for (std::size_t s = std::size_t{4} << 10; s <= (std::size_t{64} << 20); s *= 4) o.sizes.push_back(s);
  for (std::size_t s : o.sizes)
    if (s % sizeof(float)) usage("sizes must be multiples of 4 bytes (fp32 elements)");
  if (o.ranks < 0 || o.iters < 0) usage("--ranks and --iters must be positive");
  return o;
}

// Bytes of the last-level cache, for the rotation; 32 MiB when the system does not say.
std::size_t llc_bytes() {
  long v = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (v <= 0) v = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  return v > 0 ? static_cast<std::size_t>(v) : std::size_t{32} << 20;
}

// Rank r's input value i: uniform in [-1, 1), reproducible anywhere from (r, i) alone, so every
// rank can build the fp64 reference without receiving the others' data.
inline float input(int rank, std::size_t i) {
  std::uint64_t z = i * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank + 1) * 0xd1b54a32d192ed03ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) * (2.0 / 16777216.0) - 1.0);
}

void fill(float* x, std::size_t n, int rank) {
  for (std::size_t i = 0; i < n; ++i) x[i] = input(rank, i);
}

double max_rel_error(const float* y, std::size_t n, int ranks) {
  double err = 0, ref_max = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double ref = 0;
    for (int r = 0; r < ranks; ++r) ref += input(r, i);
    err = std::max(err, std::abs(static_cast<double>(y[i]) - ref));
    ref_max = std::max(ref_max, std::abs(ref));
  }
  if (std::isnan(err)) return NAN;
  return ref_max > 0 ? err / ref_max : err;
}

// What the ranks need from each other outside the timed region: a barrier and a max.
struct rank_sync {
  std::function<void()> barrier;
  std::function<double(double)> max;
};

struct row {
  std::string topology, codec, transport;
  int ranks;
  std::size_t bytes;
  double time_us, max_rel_err;
  std::string choice;  // automatic: what it ran, "name/segment" (0: the group's segment)
};

void print_header(const options& o, int ranks, const std::string& transport) {
  if (o.json) return;
  std::printf("# lockstep-bench-allreduce: all_reduce (sum, in place), %d ranks, transport %s\n", ranks, transport.c_str());
  std::printf("# time: slowest rank's %s; busbw = algbw * 2(N-1)/N; max_rel_err vs fp64, relative to max |result|\n",
              o.median ? "median over rounds" : "mean");
  std::printf("#%13s %12s %-18s %-9s %11s %12s %12s %12s\n", "bytes", "count", "topology", "codec", "time(us)",
              "algbw(GB/s)", "busbw(GB/s)", "max_rel_err");
  std::fflush(stdout);
}

// --check: a loose ceiling per codec that any working reduction stays far below (a lost or doubled
// contribution gives errors of order 1); the tight bounds are the tests' (tests/test_collective.cpp).
double sanity_bound(const std::string& codec) {
  if (codec == "fp32") return 1e-5;
  if (codec == "bf16") return 0.03;
  return 0.1;
}
bool check_failed = false;
// Keys every lockstep row of this run carries besides the standard ones (over mpi: "shm_peers",
// how many peers the shared-memory path reached, and "shm_by_reference").
std::string extra_keys;

// segment: the transport's pipelining unit these rows ran with (recorded on lockstep's rows, so
// that lockstep-sim --fit models each line with its own).
void print_row(const options& o, const row& r, std::size_t segment) {
  if (o.check && !(r.max_rel_err <= sanity_bound(r.codec))) {
    std::fprintf(stderr, "lockstep-bench-allreduce: %s %s %zu bytes: max_rel_err %.3e above %.1e\n", r.topology.c_str(),
                 r.codec.c_str(), r.bytes, r.max_rel_err, sanity_bound(r.codec));
    check_failed = true;
  }
  const double algbw = static_cast<double>(r.bytes) / (r.time_us * 1e-6) / 1e9;
  const double busbw = r.ranks > 1 ? algbw * 2.0 * (r.ranks - 1) / r.ranks : 0.0;
  if (o.json) {
    std::printf(
        "{\"op\":\"all_reduce\",\"topology\":\"%s\",\"codec\":\"%s\",\"transport\":\"%s\",\"ranks\":%d,"
        "\"bytes\":%zu,\"time_us\":%.3f,\"stat\":\"%s\",\"algbw_gbs\":%.4f,\"busbw_gbs\":%.4f,\"max_rel_err\":%.3e%s}\n",
        r.topology.c_str(), r.codec.c_str(), r.transport.c_str(), r.ranks, r.bytes, r.time_us,
        o.median ? "median" : "mean", algbw, busbw,
        r.max_rel_err,
        r.topology == "mpi_allreduce" ? ""
                                      : (",\"segment_bytes\":" + std::to_string(segment) + extra_keys +
                                         (r.choice.empty() ? "" : ",\"choice\":\"" + r.choice + "\""))
                                            .c_str());
  } else {
    std::printf(" %13zu %12zu %-18s %-9s %11.1f %12.3f %12.3f %12.2e%s%s\n", r.bytes, r.bytes / sizeof(float),
                r.topology.c_str(), r.codec.c_str(), r.time_us, algbw, busbw, r.max_rel_err, r.choice.empty() ? "" : "  ",
                r.choice.c_str());
  }
  std::fflush(stdout);
}

// The rotating set for one size: `count` buffers of n floats, each 64-byte aligned, together more
// than twice the last-level cache (at least two).
struct rotation {
  std::size_t n, stride, count;
  std::unique_ptr<float[]> arena;
  rotation(std::size_t elems, std::size_t llc) : n(elems), stride((elems + 15) / 16 * 16) {
    const std::size_t bytes = std::max<std::size_t>(stride * sizeof(float), 64);
    count = std::max<std::size_t>(2, (2 * llc + bytes - 1) / bytes);
    arena.reset(new float[stride * count + 16]);
  }
  float* at(std::size_t k) {
    auto p = reinterpret_cast<std::uintptr_t>(arena.get());
    float* base = arena.get() + ((64 - (p & 63)) & 63) / sizeof(float);
    return base + (k % count) * stride;
  }
  void fill_all(int rank) {
    for (std::size_t k = 0; k < count; ++k) fill(at(k), n, rank);
  }
};

int default_iters(std::size_t bytes) {
  return static_cast<int>(std::clamp<std::size_t>((std::size_t{512} << 20) / std::max<std::size_t>(bytes, 1), 5, 1000));
}

// One thing timed at a size: lockstep's all_reduce for one topology and codec, or MPI_Allreduce.
struct contender {
  std::string topology, codec;
  std::function<void(float*, std::size_t)> reduce;  // in place, sum
  std::function<std::string(std::size_t)> choice;   // automatic: what it runs for n values
};

template <codec::codec C, topology::topology_policy T, transport::transport Tr>
contender lockstep_contender(group<Tr>& g, const T& topo, const std::string& topo_name) {
  return {topo_name, std::string(C{}.name()),
          [&g, topo, c = C{}](float* x, std::size_t n) mutable { all_reduce(g, std::span<float>(x, n), topo, c); },
          {}};
}

// automatic: what it chooses for n values of codec C on this group, "name" or "name/segment".
template <codec::codec C, transport::transport Tr>
std::function<std::string(std::size_t)> choice_of(group<Tr>& g, const topology::automatic& a) {
  return [&g, a](std::size_t n) {
    const auto pick = a.choose(topology::operation::all_reduce, g.size(), n, C{}, g.segment_bytes());
    return std::string(pick.name()) + (pick.segment_bytes ? "/" + std::to_string(pick.segment_bytes) : "");
  };
}

template <transport::transport Tr>
std::vector<contender> lockstep_contenders(group<Tr>& g, const options& o) {
  std::vector<contender> out;
  // automatic's link is measured here, once, on this group (every rank takes part).
  std::optional<topology::automatic> autom;
  if (std::find(o.topologies.begin(), o.topologies.end(), "automatic") != o.topologies.end()) {
    autom = calibrate_automatic(g);
    if (g.rank() == 0) {
      // The calibration, as the command that shows the comparisons automatic makes with it (every
      // figure to the last bit: a rounded one could flip a choice near a crossover); with --json,
      // a line of its own, so that a grid's choices can be recomputed from the jobs' files.
      std::string args = "--ranks " + std::to_string(g.size());
      auto add = [&args](const char* fmt, auto... v) {
        char b[256];
        std::snprintf(b, sizeof b, fmt, v...);
        args += b;
      };
      add(" --latency-us %.17g --gbit %.17g --exchange-efficiency %.17g --overhead-us %.17g --segment-bytes %zu",
          autom->link.latency_s * 1e6, autom->link.bandwidth_Bps * 8 / 1e9, autom->link.exchange_efficiency,
          autom->link.overhead_s * 1e6, g.segment_bytes());
      args += " --segment-choices ";
      if (autom->segment_choices.empty()) args += "none";
      for (std::size_t i = 0; i < autom->segment_choices.size(); ++i) add("%s%zu", i ? "," : "", autom->segment_choices[i]);
      for (std::size_t i = 0; i < autom->direct_sizes.size(); ++i)
        add("%s%zu", i ? "," : " --direct-sizes ", autom->direct_sizes[i]);
      for (const auto& [name, r] : autom->rates)
        add(" --gamma-ns %s:%.17g,%.17g,%.17g", name.c_str(), r.encode_s * 1e9, r.decode_s * 1e9, r.decode_add_s * 1e9);
      if (autom->cache_bytes) {
        add(" --cache-bytes %zu --cache-latency-us %.17g --cache-gbit %.17g", autom->cache_bytes,
            autom->cache_link.latency_s * 1e6, autom->cache_link.bandwidth_Bps * 8 / 1e9);
        for (const auto& [name, r] : autom->cache_rates)
          add(" --cache-gamma-ns %s:%.17g,%.17g,%.17g", name.c_str(), r.encode_s * 1e9, r.decode_s * 1e9, r.decode_add_s * 1e9);
      }
      if (autom->bulk_bytes)
        add(" --bulk-bytes %zu --bulk-exchange-efficiency %.17g", autom->bulk_bytes, autom->bulk_exchange_efficiency);
      if (o.json)
        std::printf("{\"kind\":\"calibration\",\"ranks\":%d,\"explain\":\"%s\"}\n", g.size(), args.c_str());
      else
        std::printf("# automatic: calibrated alpha %.2f us, bandwidth %.3f GB/s, eta %.3f, overhead %.2f us; its choices: "
                    "lockstep-sim --explain %s --codec ... --bytes ...\n",
                    autom->link.latency_s * 1e6, autom->link.bandwidth_Bps / 1e9, autom->link.exchange_efficiency,
                    autom->link.overhead_s * 1e6, args.c_str());
    }
  }
  for (const auto& tn : o.topologies)
    for (const auto& cn : o.codecs) {
      auto add = [&](const auto& topo) {
        if (cn == "fp32") out.push_back(lockstep_contender<codec::fp32>(g, topo, tn));
        else if (cn == "bf16") out.push_back(lockstep_contender<codec::bf16>(g, topo, tn));
        else if (cn == "int8") out.push_back(lockstep_contender<codec::int8>(g, topo, tn));
        else out.push_back(lockstep_contender<codec::dyntree8>(g, topo, tn));
        if constexpr (topology::per_call<std::decay_t<decltype(topo)>>) {
          if (cn == "fp32") out.back().choice = choice_of<codec::fp32>(g, topo);
          else if (cn == "bf16") out.back().choice = choice_of<codec::bf16>(g, topo);
          else if (cn == "int8") out.back().choice = choice_of<codec::int8>(g, topo);
          else out.back().choice = choice_of<codec::dyntree8>(g, topo);
        }
      };
      if (tn == "automatic") add(*autom);
      else if (tn == "ring") add(topology::ring{});
      else if (tn == "halving_doubling") add(topology::halving_doubling{});
      else if (tn == "recursive_doubling") add(topology::recursive_doubling{});
      else if (tn == "direct") add(topology::direct{});
      else add(topology::torus2d{});
    }
  return out;
}

// Checks, then times, every contender at one size. The timed iterations run in rounds, each
// contender taking its turn within a round, so that load which comes and goes on a shared machine
// falls on all of them alike; and one cursor walks the rotation for all of them, so every timed
// reduction starts from a buffer that was last touched more than 2 x LLC bytes ago.
std::vector<row> measure(std::vector<contender>& cs, std::size_t bytes, int rank, int ranks, int iters,
                         const rank_sync& sync, const std::string& transport_name, bool median) {
  const std::size_t n = bytes / sizeof(float);
  rotation rot(n, llc_bytes());
  std::vector<row> rows;
  // The checked sum doubles as the warm-up: scratch memory, connections, page faults.
  for (auto& c : cs) {
    fill(rot.at(0), n, rank);
    c.reduce(rot.at(0), n);
    rows.push_back({c.topology, c.codec, transport_name, ranks, bytes, 0.0, sync.max(max_rel_error(rot.at(0), n, ranks)),
                    c.choice ? c.choice(n) : std::string()});
  }
  // Sums grow by a factor N per reduction: refill (untimed) long before fp32 overflows.
  const std::size_t reuse_limit =
      ranks > 1 ? static_cast<std::size_t>(60.0 / std::log2(static_cast<double>(ranks))) * rot.count : SIZE_MAX / 2;
  rot.fill_all(rank);
  std::size_t cursor = 0, filled_at = 0;
  std::vector<double> total(cs.size(), 0.0);
  const int rounds = std::min(iters, 16);
  std::vector<std::vector<double>> per_round(cs.size());  // each round's time per call
  for (int r = 0; r < rounds; ++r) {
    const int batch = iters * (r + 1) / rounds - iters * r / rounds;
    // Each round starts with the next contender: the first after the barrier runs slower on a
    // loaded machine (4 KiB: up to 1.5x), and that penalty is shared out instead of falling on one.
    for (std::size_t turn = 0; turn < cs.size(); ++turn) {
      const std::size_t i = (turn + static_cast<std::size_t>(r)) % cs.size();
      const double before = total[i];
      std::size_t left = static_cast<std::size_t>(batch);
      while (left > 0) {
        if (cursor - filled_at >= reuse_limit) {
          rot.fill_all(rank);
          filled_at = cursor;
        }
        const std::size_t k = std::min(left, reuse_limit - (cursor - filled_at));
        sync.barrier();
        const auto t0 = bench_clock::now();
        for (std::size_t j = 0; j < k; ++j) cs[i].reduce(rot.at(cursor++), n);
        total[i] += std::chrono::duration<double, std::micro>(bench_clock::now() - t0).count();
        left -= k;
      }
      per_round[i].push_back((total[i] - before) / batch);
    }
  }
  // The mean; or the median of the rounds, which a burst of a neighbour's load in one round
  // leaves alone (what a comparison of close contenders wants).
  for (std::size_t i = 0; i < cs.size(); ++i) {
    double t = total[i] / iters;
    if (median) {
      std::vector<double>& v = per_round[i];
      std::sort(v.begin(), v.end());
      t = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    }
    rows[i].time_us = sync.max(t);
  }
  return rows;
}

int run_inproc_bench(const options& o) {
  const int n = o.ranks ? o.ranks : 4;
  print_header(o, n, "inproc");
  std::barrier<> bar(n);
  std::vector<double> vals(static_cast<std::size_t>(n));
  group_options opt;
  opt.segment_bytes = o.segment_bytes;
  run_inproc(
      n,
      [&](group<transport::inproc>& g) {
        rank_sync sync;
        sync.barrier = [&] { bar.arrive_and_wait(); };
        sync.max = [&, r = static_cast<std::size_t>(g.rank())](double v) {
          vals[r] = v;
          bar.arrive_and_wait();
          double mx = vals[0];
          for (double x : vals) mx = (std::isnan(x) || x > mx) ? x : mx;
          bar.arrive_and_wait();  // nobody overwrites vals before everyone has read them
          return mx;
        };
        auto cs = lockstep_contenders(g, o);
        for (std::size_t bytes : o.sizes)
          for (const row& r : measure(cs, bytes, g.rank(), g.size(), o.iters ? o.iters : default_iters(bytes), sync, "inproc", o.median))
            if (g.rank() == 0) print_row(o, r, g.segment_bytes());
      },
      opt);
  return check_failed ? 1 : 0;
}

#if LOCKSTEP_HAVE_MPI
int run_mpi_bench(const options& o, int* argc, char*** argv) {
  transport::mpi_session session(argc, argv);
  group_options opt;
  opt.segment_bytes = o.segment_bytes;
  group<transport::mpi> g(transport::mpi(MPI_COMM_WORLD), opt);
  // MPI_Allreduce runs on a communicator of its own, so its traffic never meets lockstep's.
  const transport::mpi peer(MPI_COMM_WORLD, transport::mpi_options{false, 0});
  const MPI_Comm comm = peer.comm();
  const int shm_peers = g.transport().shared_memory_peers();
  extra_keys = ",\"shm_peers\":" + std::to_string(shm_peers) + ",\"shm_by_reference\":" + (g.transport().by_reference() ? "true" : "false");
  if (o.ranks && o.ranks != g.size()) {
    if (g.rank() == 0)
      std::fprintf(stderr, "lockstep-bench-allreduce: --ranks %d, but the MPI job has %d ranks\n", o.ranks, g.size());
    return 2;
  }
  if (g.rank() == 0)
    print_header(o, g.size(), shm_peers ? "mpi (" + std::to_string(shm_peers) + " peers of rank 0 through shared memory" +
                                              (g.transport().by_reference() ? ", by reference from 64 KiB)" : ")")
                                        : "mpi (shared memory " + g.transport().shared_memory_note() + ")");
  rank_sync sync;
  sync.barrier = [comm] { MPI_Barrier(comm); };
  sync.max = [comm](double v) {
    double out = 0;
    MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, comm);
    return out;
  };
  auto cs = lockstep_contenders(g, o);
  if (o.mpi_peer)
    cs.push_back({"mpi_allreduce", "fp32", [comm](float* x, std::size_t n) {
                    MPI_Allreduce(MPI_IN_PLACE, x, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm);
                  },
                  {}});
  try {
    for (std::size_t bytes : o.sizes)
      for (const row& r : measure(cs, bytes, g.rank(), g.size(), o.iters ? o.iters : default_iters(bytes), sync, "mpi", o.median))
        if (g.rank() == 0) print_row(o, r, g.segment_bytes());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-bench-allreduce: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks are stuck in a collective this one left
  }
  return check_failed ? 1 : 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    if (o.transport == "inproc") {
      if (under_mpirun() && std::getenv("OMPI_COMM_WORLD_SIZE") && std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")) > 1)
        usage("--transport inproc runs its ranks as threads: start it without mpirun");
      return run_inproc_bench(o);
    }
#if LOCKSTEP_HAVE_MPI
    return run_mpi_bench(o, &argc, &argv);
#else
    usage("built without MPI: only --transport inproc is available");
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-bench-allreduce: %s\n", e.what());
    return 1;
  }
}
