// lockstep/parallel/batch.hpp: what every rank of a model-parallel layer must know before rows
// move — how many rows each rank holds in this call — and the check that all ranks configured the
// layer alike.
//
// Each forward call all-gathers one small descriptor per rank (layer kind, scheme, codec, shape,
// rows); on a stream-ordered group the host waits for it (the row counts size the collectives). Every rank then holds the same table, so a disagreement (a rank with another scheme,
// codec or shape) makes every rank throw the same errc::mismatch naming the two ranks and both
// values, instead of some ranks entering collectives the others never call. (Every rank that gets
// that far: where the first rank to throw aborts the group, as run_inproc does when a rank's body
// throws, a rank still inside the descriptors' all-gather fails with errc::aborted instead, its
// message carrying the aborting rank's mismatch.) Row counts may differ
// (a last partial batch): they become the per-rank counts of the layer's collectives.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../codec/fp32.hpp"
#include "../collective/collectives.hpp"
#include "../core/error.hpp"
#include "scheme.hpp"

namespace lockstep::parallel {

// This call's rows: rank k holds rows [first[k], first[k] + rows[k]) of the whole batch, whose
// order is rank-major (rank 0's rows, then rank 1's, ...).
struct batch {
  std::vector<std::size_t> rows;   // (rank)
  std::vector<std::size_t> first;  // (rank + 1); first.back() is the whole batch
  std::size_t total() const noexcept { return first.empty() ? 0 : first.back(); }
};

enum class layer_kind : std::uint32_t { column_split = 1, row_split = 2 };

struct layer_config {
  layer_kind kind;
  std::uint32_t scheme;
  std::uint32_t codec_id;
  std::string codec_name;
  std::size_t in, out;
  std::string label;  // "column_linear(by_rank, int8)"
};

namespace detail {

// The descriptor, as fp32 bit patterns (the fp32 all-gather copies bits exactly).
enum : std::size_t { d_magic, d_kind, d_scheme, d_codec, d_in_lo, d_in_hi, d_out_lo, d_out_hi, d_rows_lo, d_rows_hi, d_fields };

inline std::uint32_t lo32(std::size_t v) { return static_cast<std::uint32_t>(v); }
inline std::uint32_t hi32(std::size_t v) { return static_cast<std::uint32_t>(static_cast<std::uint64_t>(v) >> 32); }

template <class G, class T>
batch exchange_batch(G& g, const T& topo, const layer_config& cfg, std::size_t my_rows) {
  const auto K = static_cast<std::size_t>(g.size());
  std::uint32_t mine[d_fields] = {0x4c4b504c /* "LKPL" */, static_cast<std::uint32_t>(cfg.kind), cfg.scheme, cfg.codec_id,
                                  lo32(cfg.in), hi32(cfg.in), lo32(cfg.out), hi32(cfg.out), lo32(my_rows), hi32(my_rows)};
  std::vector<float> all(K * d_fields);
  std::vector<float> own(d_fields);
  for (std::size_t f = 0; f < d_fields; ++f) own[f] = std::bit_cast<float>(mine[f]);
  codec::fp32 c;
  if constexpr (G::ordered) {
    // The table goes through the group's space (device memory on a GPU) and comes back to the
    // host: a host synchronisation with the group's stream per layer call. The gather is waited
    // for first, with the group's deadline: a copy to pageable host memory (`all`) returns only
    // once it is done, so queued behind a gather that a missing peer never completes it would
    // block this thread with no timeout.
    auto& sp = g.space();
    auto mem = sp.allocate(all.size() * sizeof(float));
    float* table = reinterpret_cast<float*>(mem.data());  // (rank, field)
    sp.copy(table + static_cast<std::size_t>(g.rank()) * d_fields, own.data(), d_fields * sizeof(float));
    request gathered = all_gather_inplace_async(g, std::span<float>(table, all.size()), topo, c);
    try {
      gathered.wait();
      request back = g.submit([&] { sp.copy(all.data(), table, all.size() * sizeof(float)); }, cfg.label + ": layer descriptors");
      back.wait();
    } catch (...) {
      sp.drain(g.deadline());  // nothing queued may still write `all` once it is gone
      throw;
    }
  } else {
    all_gather(g, std::span<const float>(own), std::span<float>(all), topo, c);
  }
  auto field = [&](std::size_t rank, std::size_t f) { return std::bit_cast<std::uint32_t>(all[rank * d_fields + f]); };
  auto wide = [&](std::size_t rank, std::size_t f) { return std::size_t{field(rank, f)} | std::size_t{field(rank, f + 1)} << 32; };

  // Compare every rank with rank 0, in field order, so every rank reports the same disagreement.
  for (std::size_t k = 1; k < K; ++k) {
    // The pair that disagrees is (0, k): from rank k the peer is rank 0.
    const int peer = g.rank() == static_cast<int>(k) ? 0 : static_cast<int>(k);
    auto fail = [&](const std::string& what, const std::string& here, const std::string& there, const std::string& note = {}) {
      throw error(errc::mismatch, cfg.label, g.rank(), peer,
                  "ranks configured the layer differently: " + what + " " + here + " on rank 0, " + there + " on rank " +
                      std::to_string(k) + note);
    };
    if (field(k, d_magic) != field(0, d_magic)) fail("descriptor", "valid", "not a layer descriptor");
    if (field(k, d_kind) != field(0, d_kind))
      fail("layer", field(0, d_kind) == 1 ? "column-split" : "row-split", field(k, d_kind) == 1 ? "column-split" : "row-split");
    if (field(k, d_scheme) != field(0, d_scheme)) fail("scheme", scheme_name(field(0, d_scheme)), scheme_name(field(k, d_scheme)));
    if (field(k, d_codec) != field(0, d_codec))
      // The descriptor carries the codec's fingerprint only: this rank names its own codec.
      fail("activation codec", "fingerprint " + std::to_string(field(0, d_codec)), "fingerprint " + std::to_string(field(k, d_codec)),
           "; this rank (" + std::to_string(g.rank()) + ") uses " + cfg.codec_name);
    if (wide(k, d_in_lo) != wide(0, d_in_lo) || wide(k, d_out_lo) != wide(0, d_out_lo))
      fail("shape (in x out)", std::to_string(wide(0, d_in_lo)) + " x " + std::to_string(wide(0, d_out_lo)),
           std::to_string(wide(k, d_in_lo)) + " x " + std::to_string(wide(k, d_out_lo)));
  }
  batch b;
  b.rows.resize(K);
  b.first.assign(K + 1, 0);
  for (std::size_t k = 0; k < K; ++k) {
    b.rows[k] = wide(k, d_rows_lo);
    if (b.rows[k] > lockstep::detail::max_count / (cfg.in + cfg.out + 1) || b.first[k] > lockstep::detail::max_count / (cfg.in + cfg.out + 1))
      throw error(errc::invalid_argument, cfg.label, g.rank(), static_cast<int>(k),
                  std::to_string(b.rows[k]) + " rows on rank " + std::to_string(k) + " overflow the wire format");
    b.first[k + 1] = b.first[k] + b.rows[k];
  }
  return b;
}

}  // namespace detail
}  // namespace lockstep::parallel
