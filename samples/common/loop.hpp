// samples/common/loop.hpp: the pieces of a synchronous data-parallel training loop that the sample
// trainers share: the policy types named by the flags, the batch-norm group of a replica, the
// error-feedback residuals gathered for a checkpoint, and the checks of the parallelism flags.
//
// The flags are read from any options struct with the members used here (topology, codec,
// codec_block, error_feedback, optimizer, momentum, weight_decay, lars_trust; ranks, batch,
// bn_group), so each trainer keeps its own options and help text.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/optim/lars.hpp>
#include <lockstep/optim/sgd.hpp>

#include "batch_norm.hpp"

namespace sample {

// Picks the policy types named by the flags and calls f(topology, codec&, optimizer) with them.
// LARS takes momentum, weight decay and trust from the flags, its other fields (ε 0, the TF/MLPerf
// denominator and learning-rate placement) from lockstep::optim::lars.
template <class Options, class F>
void with_policies(const Options& o, F&& f) {
  using namespace lockstep;
  auto with_optimizer = [&](auto topo, auto& codec) {
    if (o.optimizer == "sgd") {
      f(topo, codec, optim::sgd{o.momentum, o.weight_decay, false, true});
    } else {
      optim::lars opt;
      opt.momentum = o.momentum;
      opt.weight_decay = o.weight_decay;
      opt.trust = o.lars_trust;
      f(topo, codec, opt);
    }
  };
  auto with_codec = [&](auto topo) {
    auto go = [&](auto inner) {
      if (o.error_feedback) {
        codec::error_feedback<decltype(inner)> c(inner);
        with_optimizer(topo, c);
      } else {
        with_optimizer(topo, inner);
      }
    };
    if (o.codec == "fp32") {
      codec::fp32 c;
      with_optimizer(topo, c);  // lossless: error feedback would keep a residual of zeros
    } else if (o.codec == "bf16") {
      go(codec::bf16{});
    } else if (o.codec == "int8") {
      go(codec::int8{o.codec_block});
    } else {
      go(codec::dyntree8{o.codec_block});
    }
  };
  if (o.topology == "ring") {
    with_codec(topology::ring{});
  } else {
    int r = 0, c = 0;
    if (o.topology.size() > 8) std::sscanf(o.topology.c_str() + 8, "%dx%d", &r, &c);  // "torus2d:RxC"
    with_codec(topology::torus2d{r, c});
  }
}

// The batch-norm group of this replica: consecutive ranks of `world`, G at a time, and the
// bn_group that gathers and sums over it. Holds the split group, so it stays where it was made.
template <class Group>
struct replica_bn_group {
  Group group;
  bn_group bn;

  replica_bn_group(Group& world, int G) : group(world.split(world.rank() / G, world.rank())) {
    bn.size = group.size();
    bn.all_gather = [this](std::span<const float> mine, std::span<float> all) {
      lockstep::codec::fp32 c32;
      lockstep::all_gather(group, mine, all, lockstep::topology::ring{}, c32);
    };
    bn.sum = [this](std::span<float> v) { lockstep::all_reduce(group, v); };
  }
  replica_bn_group(const replica_bn_group&) = delete;
  replica_bn_group& operator=(const replica_bn_group&) = delete;
};

// Every replica's `mine` (its error-feedback residuals), in rank order, for rank 0's checkpoint.
template <class Group>
std::vector<float> gather_all(Group& world, std::span<const float> mine) {
  std::vector<float> all(mine.size() * static_cast<std::size_t>(world.size()));
  lockstep::codec::fp32 c32;
  lockstep::all_gather(world, mine, std::span<float>(all), lockstep::topology::ring{}, c32);
  return all;
}

// Ranks started with different flags (one --parallel data, another hybrid; other --fc, another
// seed) would meet in collectives that do not match, and over NCCL, which carries no headers,
// hang or compute wrong numbers. So before anything else each rank's fingerprint of every flag
// that shapes the run is gathered over the host group, and every rank throws, naming the first
// flag and rank that differ from rank 0's. `flags`: (what, fingerprint) pairs, "--parallel" say.
template <class Group>
void check_same_flags(Group& world, const std::vector<std::pair<std::string, std::uint64_t>>& flags) {
  std::vector<float> mine(2 * flags.size());  // each 64-bit fingerprint as two fp32 bit patterns
  for (std::size_t i = 0; i < flags.size(); ++i) std::memcpy(&mine[2 * i], &flags[i].second, sizeof(std::uint64_t));
  const std::vector<float> all = gather_all(world, std::span<const float>(mine));  // fp32: the bits as sent
  for (int r = 1; r < world.size(); ++r)
    for (std::size_t i = 0; i < flags.size(); ++i)
      if (std::memcmp(&all[static_cast<std::size_t>(r) * mine.size() + 2 * i], &all[2 * i], sizeof(std::uint64_t)) != 0)
        throw std::invalid_argument("rank " + std::to_string(r) + " was started with other " + flags[i].first +
                                    " than rank 0: start every rank with the same flags");
}

// This rank's error-feedback residuals in a checkpoint (2 x params floats: per bucket, phase 0
// then phase 1), or a clear error when the checkpoint has none for this many replicas.
inline const float* checkpoint_residuals(const std::vector<float>& residuals, std::size_t params, int rank, int R,
                                         const std::string& path) {
  const std::size_t per_rank = 2 * params;
  if (residuals.size() != per_rank * static_cast<std::size_t>(R))
    throw std::runtime_error(path + ": holds no error-feedback residuals for " + std::to_string(R) + " replicas");
  return residuals.data() + per_rank * static_cast<std::size_t>(rank);
}

// The checks of the data-parallelism flags that a replica cannot make alone; throws
// std::invalid_argument naming the flag.
template <class Options>
void validate_parallel_flags(const Options& o) {
  auto bad = [](const std::string& s) { throw std::invalid_argument(s); };
  if (o.ranks < 1) bad("--ranks must be at least 1");
  if (o.batch < o.ranks || o.batch % o.ranks != 0)
    bad("--batch " + std::to_string(o.batch) + " must be a multiple of --ranks " + std::to_string(o.ranks));
  if (o.bn_group < 1 || o.ranks % o.bn_group != 0)
    bad("--bn-group " + std::to_string(o.bn_group) + " must divide --ranks " + std::to_string(o.ranks));
  // torus2d:RxC whole: a shape sscanf cannot read (torus2d:foo, torus2d:2x2junk, torus2dxyz) once
  // ran as the most square grid while the banner showed it.
  bool topology_ok = o.topology == "ring" || o.topology == "torus2d";
  if (!topology_ok && o.topology.rfind("torus2d:", 0) == 0) {
    int r = 0, c = 0, used = 0;
    topology_ok = std::sscanf(o.topology.c_str() + 8, "%dx%d%n", &r, &c, &used) == 2 && r > 0 && c > 0 &&
                  static_cast<std::size_t>(used) == o.topology.size() - 8 && o.topology[8] != '+' && o.topology[8] != ' ';
  }
  if (!topology_ok) bad("--topology must be ring, torus2d or torus2d:RxC (R and C positive), not '" + o.topology + "'");
  if (o.codec != "fp32" && o.codec != "bf16" && o.codec != "int8" && o.codec != "dyntree8")
    bad("--codec must be fp32, bf16, int8 or dyntree8");
  if (o.optimizer != "sgd" && o.optimizer != "lars") bad("--optimizer must be sgd or lars");
}

}  // namespace sample
