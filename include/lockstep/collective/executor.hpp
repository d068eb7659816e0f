// lockstep/collective/executor.hpp: the one piece of code that walks a schedule, on every transport
// and in every execution space (host threads, a CPU stream, a CUDA stream).
//
// For one rank, schedule_run takes the schedule its topology produced, a buffer of fp32 values, a
// codec and a group, and moves chunks as the steps say. The element work (encode, decode-add, copy,
// divide) goes through the group's execution space (core/space.hpp): done at once on the host,
// enqueued on a stream elsewhere; the messages go through the transport's small interface, read
// with consume() wherever the transport holds them. Nothing here branches on a transport or a space
// except through three stated properties: the segment size (a stream-ordered transport sends a
// chunk as one message), how many sends run ahead of the receives (collective/pipeline.hpp), and
// whether headers are exchanged (not on a stream: reading one needs the peer's stream to have run).
//
// Values are summed in fp32 only; a lossy codec quantises each partial sum once, when it is sent,
// and the final value once, when its owner sends it to the all-gather. The wire bytes of a chunk
// are kept in the group's scratch and forwarded unchanged by later all-gather steps, so no value is
// quantised twice in that phase, and the owner replaces its own values by their decoded wire image,
// so every rank ends bitwise equal. An exchange step (topology::is_exchange: recursive doubling)
// sends a copy of the span, encoded for a lossy codec, and replaces the rank's own values by that
// image before it adds the peer's, so both ends hold the same bits; values an exchange left equal
// on two ranks are encoded without the error-feedback residual, which differs from rank to rank.
//
// Each rank sends every peer it will send to a header (op, count, codec, topology, root, segment
// size, call number) and checks the header of every peer it will receive from (a broadcast: and
// of every peer it sends to, as its root receives nothing) before it posts a
// receive, reads, encodes or finalises anything: a mismatch between ranks is an error naming both
// sides, never a truncation or a hang, and a failing call leaves this rank's buffer and its
// error-feedback residuals untouched. Only the first step's fp32 sends go out beside the headers
// (they change nothing here, and the peer reads them only after checking our header), which saves
// the round the headers would otherwise take on their own (docs/design.md says what was tried) --
// except over a transport whose sends wait for the peer's receive (T::sends_wait_for_receives:
// c10d over Gloo, whose receive sends the sender a notice over the same connection as our own data
// to that peer). There an early send saves nothing, and when the peer is also the one we receive
// from (a torus's rows and columns) our receives' notices queue behind our own data: one
// direction would wait for the other to finish. Its first step posts receives first, as every
// other step does.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../codec/concept.hpp"
#include "../core/error.hpp"
#include "../core/space.hpp"
#include "../topology/concept.hpp"
#include "../topology/direct.hpp"
#include "../topology/halving_doubling.hpp"
#include "../topology/recursive_doubling.hpp"
#include "../topology/ring.hpp"
#include "../topology/torus2d.hpp"
#include "../transport/concept.hpp"
#include "group.hpp"
#include "pipeline.hpp"

namespace lockstep {

enum class reduce_op : std::uint32_t { sum = 0, average = 1 };

// Called with (first, count) for every element range that is final on this rank. On a
// stream-ordered group it is called when the range's last work has been enqueued, and enqueues its
// own work on the group's stream.
struct no_epilogue {
  constexpr void operator()(std::size_t, std::size_t) const noexcept {}
};

namespace detail {
// Whether an epilogue does nothing (blocking calls hand the executor a reference to theirs).
template <class E>
inline constexpr bool is_no_epilogue = std::is_same_v<std::remove_cvref_t<E>, no_epilogue>;
template <class E>
inline constexpr bool is_no_epilogue<std::reference_wrapper<E>> = is_no_epilogue<E>;
}  // namespace detail

// [first, last) of chunk c when n elements are cut into `chunks` pieces.
constexpr std::pair<std::size_t, std::size_t> chunk_range(std::size_t n, std::size_t chunks, std::size_t c) noexcept {
  using wide = unsigned __int128;
  return {static_cast<std::size_t>(wide(n) * c / chunks), static_cast<std::size_t>(wide(n) * (c + 1) / chunks)};
}

namespace detail {

enum class op_kind : std::uint32_t { all_reduce = 1, reduce_scatter, all_gather, broadcast, barrier };

constexpr const char* to_string(op_kind k) noexcept {
  switch (k) {
    case op_kind::all_reduce: return "all_reduce";
    case op_kind::reduce_scatter: return "reduce_scatter";
    case op_kind::all_gather: return "all_gather";
    case op_kind::broadcast: return "broadcast";
    case op_kind::barrier: return "barrier";
  }
  return "collective";
}

// Counts beyond this are rejected: chunk arithmetic and wire sizes stay far from overflow.
inline constexpr std::size_t max_count = std::size_t{1} << 48;

struct wire_header {
  std::uint32_t magic = 0x4c4b5354;  // "LKST"
  std::uint32_t kind = 0;
  std::uint32_t codec_id = 0;
  std::uint32_t topology_id = 0;
  std::uint32_t rop = 0;
  std::int32_t root = -1;
  std::uint64_t count = 0;
  std::uint64_t segment = 0;
  std::uint64_t seq = 0;
  std::uint64_t layout = 0;  // 0: equal chunks; else the fingerprint of the per-rank counts
};

// Per-rank counts (MPI's allgatherv / reduce_scatter): chunk c is counts[c] elements long and
// starts after the chunks before it. The offsets are what the executor walks; the fingerprint is
// what the header carries, so ranks that were handed different counts fail with a mismatch.
struct chunk_layout {
  std::vector<std::size_t> offsets;  // (chunk + 1); empty: n elements cut into equal chunks
  std::uint64_t id = 0;

  static chunk_layout from_counts(std::span<const std::size_t> counts) {
    chunk_layout l;
    l.offsets.assign(counts.size() + 1, 0);
    std::uint64_t h = 0xcbf29ce484222325ull ^ counts.size();  // FNV-1a over the counts' values
    for (std::size_t i = 0; i < counts.size(); ++i) {
      l.offsets[i + 1] = l.offsets[i] + counts[i];
      for (int b = 0; b < 64; b += 8) h = (h ^ ((counts[i] >> b) & 0xff)) * 0x100000001b3ull;
    }
    l.id = h | 1;  // never 0, which means equal chunks
    return l;
  }
  bool equal_chunks() const noexcept { return offsets.empty(); }
  std::string str() const {
    std::string s = "[";
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i) {
      if (i == 16) return s + ", ... (" + std::to_string(offsets.size() - 1) + " ranks)]";
      s += (i ? ", " : "") + std::to_string(offsets[i + 1] - offsets[i]);
    }
    return s + "]";
  }
};

struct op_desc {
  op_kind kind;
  reduce_op rop = reduce_op::sum;
  int root = -1;
  std::uint32_t topology_id = 0;
  std::string label;  // "all_reduce(ring, bf16)"
  std::size_t segment_bytes = 0;  // this call's segment (topology::automatic); 0: the group's
  chunk_layout layout{};  // per-rank counts of all_gather_v / reduce_scatter_v; else equal chunks
  // Error feedback keys its residuals by this instead of the buffer (null): an out-of-place call
  // reduces a working copy made afresh each time, and its residuals belong to the caller's input.
  const void* residual_key = nullptr;
};

// What a header carries for the topology: a fingerprint of its name and, where it has one, its
// shape for this group size (torus2d's rows x cols).
template <topology::topology T>
std::uint32_t topology_fingerprint(const T& topo, int size) {
  std::string s = topo.name();
  if constexpr (requires { topo.shape(size); }) {
    auto [r, c] = topo.shape(size);
    s += ":" + std::to_string(r) + "x" + std::to_string(c);
  }
  return codec::fingerprint(s, 0);
}

// The library's topology whose fingerprint `id` is at this group size ("torus2d 2x4"), or the
// fingerprint in hex where none is (a topology of the user's).
inline std::string topology_named_by(std::uint32_t id, int size) {
  if (size >= 1) {
    if (id == topology_fingerprint(topology::ring{}, size)) return "ring";
    if (id == topology_fingerprint(topology::halving_doubling{}, size)) return "halving_doubling";
    if (id == topology_fingerprint(topology::recursive_doubling{}, size)) return "recursive_doubling";
    if (id == topology_fingerprint(topology::direct{}, size)) return "direct";
    for (int r = 1; r <= size; ++r)
      if (size % r == 0 && id == topology_fingerprint(topology::torus2d{r, size / r}, size))
        return "torus2d " + std::to_string(r) + "x" + std::to_string(size / r);
  }
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08x", static_cast<unsigned>(id));
  return std::string("a topology of fingerprint ") + hex;
}

inline std::string describe_mismatch(const wire_header& mine, const wire_header& theirs, int size = 0) {
  auto field = [](const char* what, auto a, auto b) {
    return std::string(what) + " " + std::to_string(a) + " here, " + std::to_string(b) + " on the peer";
  };
  if (theirs.magic != mine.magic) return "the peer sent something that is not a lockstep header";
  if (theirs.seq != mine.seq) return field("call number", mine.seq, theirs.seq) + " (ranks issued different numbers of collectives)";
  if (theirs.kind != mine.kind)
    return std::string("operation ") + to_string(static_cast<op_kind>(mine.kind)) + " here, " +
           to_string(static_cast<op_kind>(theirs.kind)) + " on the peer";
  if (theirs.layout != mine.layout) {
    if (!mine.layout || !theirs.layout)
      return std::string("per-rank counts ") + (mine.layout ? "given" : "equal (not given)") + " here, " +
             (theirs.layout ? "given" : "equal (not given)") + " on the peer";
    return "per-rank counts differ (the ranks were handed different count vectors" +
           (theirs.count != mine.count ? ", " + field("total", mine.count, theirs.count) : std::string()) + ")";
  }
  if (theirs.count != mine.count) return field("element count", mine.count, theirs.count);
  if (theirs.codec_id != mine.codec_id) return "codecs differ (format or block size)";
  if (theirs.topology_id != mine.topology_id)
    return "topologies differ: " + topology_named_by(mine.topology_id, size) + " here, " +
           topology_named_by(theirs.topology_id, size) + " on the peer";
  if (theirs.rop != mine.rop) return "reduction ops differ (sum vs average)";
  if (theirs.root != mine.root) return field("root", mine.root, theirs.root);
  if (theirs.segment != mine.segment)
    return field("segment of", mine.segment, theirs.segment) + " (values per message; topology::automatic chose differently, "
           "or the groups' segment_bytes differ)";
  return {};
}

template <transport::transport T, codec::codec C, class Epilogue>
class schedule_run {
  using space_type = transport::space_of<T>;
  static constexpr bool identity = C::identity;
  // On a stream nothing can be read on the host before the stream has run: no headers (see above).
  static constexpr bool exchanges_headers = !space_type::ordered;
  // fp32's first-step sends wait for the headers and the receives too (see above).
  static constexpr bool receives_first = requires { requires T::sends_wait_for_receives; };
  // Whether a wait may time out and be tried again (check_headers' slices): not over Gloo.
  static constexpr bool waits_may_lapse = !requires { requires T::waits_end_the_transport; };
  // Whether the space writes final copies its own way (space::host: streaming stores); where it
  // has no copy_final (CUDA) the executor does not look for them.
  static constexpr bool streams_final_copies =
      requires(space_type& sp, void* d, const void* src, std::size_t b) { sp.copy_final(d, src, b); };
  // Whether a reduce step's sums can go straight to the next step's send (mark_forwards): fp32, a
  // transport that lets a send's payload be written in its own buffer (the mpi transport to a peer
  // on its node), and a space that adds into a third place (the host).
  static constexpr bool fills_sends =
      identity &&
      requires(T& t, std::uint32_t tag, std::size_t b) { t.try_isend_fill(0, tag, b, [](std::byte*) {}); } &&
      requires(const space_type& sp, float* d, const std::byte* w, std::size_t n, const float* a) { sp.sum_into(d, w, n, a); };

  // A piece of a chunk that travels as one message.
  struct segment {
    std::size_t lo, len;  // elements [lo, lo + len) of the buffer
    std::byte* wire;      // where its wire image lives in scratch
    std::uint32_t chunk;
    bool last;            // last segment of its chunk
  };

 public:
  schedule_run(group<T>& g, const topology::schedule& s, std::span<float> buf, C& codec, const op_desc& op, Epilogue& ep)
      : g_(g), t_(g.transport()), sp_(g.space()), s_(s), x_(buf.data()), n_(buf.size()), codec_(codec), op_(op), ep_(ep),
        rank_(g.rank()), size_(g.size()) {}

  // The algorithm. Every rank walks its schedule; per step it posts the step's receives, sends each
  // segment of its send span (reduce-scatter: encoded from the running partial sums; all-gather and
  // scatter: wire bytes forwarded unchanged), and, `ahead` segments behind, reads each received
  // segment: a reduce step adds it into the partial sum, a copy step puts the final value in place
  // and hands each completed chunk to the epilogue. Before the first step that is not part of the
  // reduce-scatter, this rank's own chunk is final: finalize_owned averages it, replaces it by its
  // wire image (so every rank ends with the same bits) and hands it to the epilogue.
  void run() {
    validate();
    seq_ = g_.next_sequence();
    // From here on the peers count this call as begun: whatever stops this rank, a failed scratch
    // allocation in the set-up included, must reach them (an abort), or they wait out the timeout.
    // What failed, for a failure that is not lockstep's own error (told to the peers below).
    const char* stage = "the set-up failed";
    try {
      lay_out_wire();
      mark_final_copies();
      mark_forwards();
      stage = "posting the headers failed";
      post_headers();
      stage = "the epilogue threw";
      if (op_.kind == op_kind::broadcast && rank_ == op_.root) finalize_broadcast_root();
      const std::size_t final_at = owns() ? pipeline::finalize_step(s_) : s_.steps.size() + 1;
      for (std::size_t si = 0; si < s_.steps.size(); ++si) {
        if (si == final_at) finalize_owned();
        if (const std::size_t end = fan_in_end(si); end > si + 1) {
          run_fan_in(si, end);
          si = end - 1;
        } else {
          run_step(si);
        }
      }
      if (final_at == s_.steps.size()) finalize_owned();
      check_headers();  // a rank that only sends: a mismatch is reported, not waited out
      wait_header_sends();
    } catch (const error& e) {
      // Tell the others (every rank of the group, at once: transport/concept.hpp) and say where
      // we were. Sends still pending are settled by their requests' destructors on the way out.
      t_.abort(e.what());
      if (e.op() == op_.label) throw;
      throw error(e.code(), op_.label, rank_, e.peer(), e.detail());
    } catch (const std::exception& e) {
      // The epilogue's own failure (an optimizer's check, the user's callback), or the set-up's
      // (std::bad_alloc for the scratch): the peers are told the same way, and the exception goes
      // on unchanged.
      t_.abort(op_.label + " on rank " + std::to_string(rank_) + ": " + stage + ": " + e.what());
      throw;
    } catch (...) {
      t_.abort(op_.label + " on rank " + std::to_string(rank_) + ": " + stage);
      throw;
    }
  }

 private:
  // ---- set-up ----------------------------------------------------------------------------------

  void validate() const {
    if (!x_ && n_) throw fail(errc::invalid_argument, -1, "null buffer with " + std::to_string(n_) + " elements");
    if (n_ > max_count) throw fail(errc::invalid_argument, -1, "count " + std::to_string(n_) + " overflows the wire format");
    const auto& off = op_.layout.offsets;
    if (!off.empty() && (off.size() != std::size_t{s_.chunks} + 1 || off.back() != n_))
      throw fail(errc::invalid_argument, -1,
                 "per-rank counts " + op_.layout.str() + " do not cut a buffer of " + std::to_string(n_) +
                     " elements into the schedule's " + std::to_string(s_.chunks) + " chunks");
  }

  // Wire layout in scratch: chunk c's segments back to back, each encoded on its own.  // (chunk)
  // An exchange needs a second image of the same layout: what arrives cannot land where what this
  // rank sends still lies.                                                            // (chunk)
  void lay_out_wire() {
    const std::size_t seg_bytes = op_.segment_bytes && !space_type::ordered ? op_.segment_bytes : g_.segment_bytes();
    seg_ = pipeline::segment_elems(codec_.block(), seg_bytes);
    wire_off_.assign(s_.chunks + 1, 0);
    for (std::uint32_t c = 0; c < s_.chunks; ++c) {
      const auto [lo, hi] = chunk(c);
      const std::size_t len = hi - lo, full = len / seg_;
      wire_off_[c + 1] = wire_off_[c] + (full ? full * codec_.wire_bytes(seg_) : 0) + codec_.wire_bytes(len % seg_);
    }
    const bool exchanges = std::any_of(s_.steps.begin(), s_.steps.end(), [](const topology::step& st) { return topology::is_exchange(st); });
    landing_off_ = exchanges ? wire_off_[s_.chunks] : 0;
    // A fan-in's second and later peers land past that (the first lands in the chunk's own slot).
    fan_off_ = wire_off_[s_.chunks] * (exchanges ? 2 : 1);
    std::size_t fan_bytes = 0;
    for (std::size_t si = 0, end; si < s_.steps.size(); si = end) {
      end = fan_in_end(si);
      const topology::chunk_span r = s_.steps[si].recv;
      if (end > si + 1) fan_bytes = std::max(fan_bytes, (end - si - 1) * (wire_off_[r.end()] - wire_off_[r.first]));
    }
    wire_ = g_.scratch(fan_off_ + fan_bytes);
    replicated_.assign(exchanges ? s_.chunks : 0, false);
  }

  // The copy steps whose values this rank receives and never sends on (a direct all-gather's every
  // step, halving-doubling's last): nothing reads them again in this call, so they are written
  // around the cache (space::copy_final). Values a later step forwards must stay in cache, as must
  // values an epilogue reads at once, and a lossy codec's wire bytes, which are decoded at once.
  // Only where such copies are at least half of what the rank receives in copy steps: at 4 ranks
  // on machine C (inproc, docs/benchmarks.md) direct gained 15-20% and halving-doubling 9-17% at
  // 4-64 MiB, but a ring, whose last step alone is final (a third of its copies), lost 4-8% at 4
  // and 16 MiB, where the next call's reads find in memory what would still have been in cache.
  // Rings of 2 and 3 ranks (all and half their copies final) gained 3-15%.
  void mark_final_copies() {
    final_copy_.clear();
    if constexpr (streams_final_copies && identity && is_no_epilogue<std::remove_cv_t<Epilogue>>) {
      final_copy_.assign(s_.steps.size(), false);
      std::vector<bool> sent_later(s_.chunks, false);
      std::size_t copied = 0, final_copied = 0;  // elements
      for (std::size_t si = s_.steps.size(); si-- > 0;) {
        const topology::step& st = s_.steps[si];
        if (st.recv_peer >= 0 && st.act == topology::action::copy && !st.recv.empty()) {
          bool forwarded = false;
          for (std::uint32_t c = st.recv.first; c < st.recv.end(); ++c) forwarded = forwarded || sent_later[c];
          final_copy_[si] = !forwarded;
          const std::size_t len = chunk(st.recv.end() - 1).second - chunk(st.recv.first).first;
          copied += len;
          if (!forwarded) final_copied += len;
        }
        if (st.send_peer >= 0)
          for (std::uint32_t c = st.send.first; c < st.send.end(); ++c) sent_later[c] = true;
      }
      if (2 * final_copied < copied) final_copy_.clear();
    }
  }

  // The reduce steps whose received partial sums the next step sends on and this rank never reads
  // again: a ring's reduce-scatter but its last step, halving-doubling's halves. Their sums go
  // straight into the next step's message where the transport can take it (fills_sends), rather
  // than into the buffer and then, copied, into the message: one write and one read of each value
  // fewer (NCCL's recvReduceSend). What the buffer then holds there is not a result: the all-gather
  // overwrites it, and a reduce_scatter's other chunks are not meant to be read.
  void mark_forwards() {
    forward_.clear();
    if constexpr (fills_sends) {
      const auto& steps = s_.steps;
      forward_.assign(steps.size(), false);
      for (std::size_t si = 0; si + 1 < steps.size(); ++si) {
        const topology::step& st = steps[si];
        const topology::step& nx = steps[si + 1];
        auto plain_reduce = [](const topology::step& x) {
          return x.phase == topology::phase::reduce_scatter && x.act == topology::action::reduce && !topology::is_exchange(x);
        };
        if (st.recv_peer < 0 || !plain_reduce(st) || fan_in_end(si) != si + 1) continue;
        if (nx.send_peer < 0 || nx.phase != topology::phase::reduce_scatter || topology::is_exchange(nx) ||
            fan_in_end(si + 1) != si + 2 || nx.send.empty() || nx.send.first < st.recv.first || nx.send.end() > st.recv.end())
          continue;
        if (owns() && nx.send.overlaps(s_.owned)) continue;
        // Every chunk sent on must be overwritten (a copy step) before anything reads it again.
        bool unread = true;
        for (std::uint32_t c = nx.send.first; c < nx.send.end() && unread; ++c) {
          const topology::chunk_span one{c, 1};
          for (std::size_t j = si + 2; j < steps.size(); ++j) {
            const topology::step& later = steps[j];
            if (later.send_peer >= 0 && later.send.overlaps(one)) {
              unread = false;
              break;
            }
            if (later.recv_peer >= 0 && later.recv.overlaps(one)) {
              if (later.act != topology::action::copy || topology::is_exchange(later)) unread = false;
              break;
            }
          }
        }
        forward_[si] = unread;
      }
    }
  }

  // Headers to every peer we send to, from every peer we receive from; checked before anything of
  // ours changes (check_headers).
  void post_headers() {
    if constexpr (exchanges_headers) {
      mine_.kind = static_cast<std::uint32_t>(op_.kind);
      mine_.codec_id = codec_.id();
      mine_.topology_id = op_.topology_id;
      mine_.rop = static_cast<std::uint32_t>(op_.rop);
      mine_.root = op_.root;
      mine_.count = n_;
      mine_.segment = seg_;
      mine_.seq = seq_;
      mine_.layout = op_.layout.id;
      auto add = [](std::vector<int>& to, int p) {
        if (p >= 0 && std::find(to.begin(), to.end(), p) == to.end()) to.push_back(p);
      };
      // Headers go along the schedule's edges, from sender to receiver. A broadcast's tree
      // (recursive doubling's binomial one) has a root that receives nothing, and ranks that
      // disagree on the root build trees that need not meet: two self-declared roots would each
      // send and return, with different data and no error. So a broadcast's headers go both ways
      // along every edge: each rank compares its root with every peer it sends to or receives from.
      const bool both_ways = op_.kind == op_kind::broadcast;
      for (const auto& st : s_.steps) {
        add(to_, st.send_peer), add(from_, st.recv_peer);
        if (both_ways) add(from_, st.send_peer), add(to_, st.recv_peer);
      }
      // Even so, two trees with different roots can share no edge, and then each side waits for
      // a header the other never sends (a review found 4 ranks with roots 0 1 0 0 at the
      // timeout, and 5 with 1 2 2 2 2 where rank 1 returned). So a broadcast's headers also go
      // both ways to the ring neighbours, edges that no root changes: wherever the roots are
      // not all equal, two neighbours differ and fail at once, and the group's abort stops the rest.
      if (both_ways && size_ > 1)
        for (int p : {(rank_ + 1) % size_, (rank_ + size_ - 1) % size_})
          if (p != rank_) add(to_, p), add(from_, p);
      const std::uint32_t header_tag = (1u << 24) | tag();
      for (int p : to_) header_sends_.push_back(t_.isend(p, header_tag, &mine_, sizeof mine_));
      theirs_.resize(from_.size());
      for (std::size_t i = 0; i < from_.size(); ++i)
        header_recvs_.push_back(t_.irecv(from_[i], header_tag, &theirs_[i], sizeof(wire_header)));
    }
    headers_checked_ = !exchanges_headers;
  }

  // A peer that runs another schedule (a different topology, root or size) may never send to this
  // rank, while the header that says why is already in from another peer: waiting for the headers
  // one at a time, in order, would sit out the whole timeout on the silent one and then blame it.
  // So the wait for each is cut into slices, and between slices whatever has come in from the
  // others is read. Headers that arrive in time cost nothing more than before. A transport whose
  // timed-out wait ends it (c10d over Gloo) waits for each header once, up to the deadline.
  static constexpr std::chrono::milliseconds header_slice{10};
  void check_headers() {
    if (headers_checked_) return;
    headers_checked_ = true;
    seen_.assign(from_.size(), 0);
    auto check = [&](std::size_t i) {
      seen_[i] = 1;
      std::string why = describe_mismatch(mine_, theirs_[i], g_.size());
      if (!why.empty() && theirs_[i].layout != mine_.layout && mine_.layout) why += "; this rank's: " + op_.layout.str();
      if (!why.empty()) throw fail(errc::mismatch, from_[i], why);
    };
    const auto until = g_.deadline();
    auto timed_out = [&](std::size_t i) {
      return fail(errc::timeout, from_[i], timeout_text("header from the peer: it has not entered this collective", 0, from_[i]));
    };
    for (std::size_t i = 0; i < from_.size(); ++i) {
      if (seen_[i]) continue;
      if constexpr (!waits_may_lapse) {
        if (!t_.wait(header_recvs_[i], until)) throw timed_out(i);
      } else {
        while (!t_.wait(header_recvs_[i], std::min(until, transport::clock::now() + header_slice))) {
          for (std::size_t j = i + 1; j < from_.size(); ++j)
            if (!seen_[j] && t_.wait(header_recvs_[j], transport::clock::now())) check(j);
          if (transport::clock::now() >= until) throw timed_out(i);
        }
      }
      check(i);
    }
  }

  void wait_header_sends() {
    for (std::size_t i = 0; i < header_sends_.size(); ++i)
      if (!t_.wait(header_sends_[i], g_.deadline()))
        throw fail(errc::timeout, to_[i], timeout_text("receipt of the header by the peer", s_.steps.size(), to_[i]));
  }

  // ---- one step --------------------------------------------------------------------------------

  void run_step(std::size_t si) {
    const topology::step& st = s_.steps[si];
    sends_.clear();
    recvs_.clear();
    if (st.send_peer >= 0) cut(st.send, sends_);
    if (st.recv_peer >= 0) cut(st.recv, recvs_);
    send_reqs_.clear();
    recv_reqs_.clear();
    posted_ = false;
    // The first sends of this step may have gone out already, filled by the previous step's adds.
    const std::size_t sent_before = forwarded_.size();
    for (auto& r : forwarded_) send_reqs_.push_back(std::move(r));
    forwarded_.clear();
    forward_open_ = false;
    open_group group(*this);
    if (headers_checked_) post_receives(st);
    const std::size_t ahead = pipeline::sends_ahead(identity, sends_.size(), space_type::ordered);
    std::size_t received = 0;
    for (std::size_t k = 0; k < sends_.size(); ++k) {
      if (k >= sent_before) send_segment(st, sends_[k]);
      while (received < recvs_.size() && received + ahead <= k) receive(st, si, received++);
    }
    group.close();
    // Only now, with every send of this step posted: the next step's messages to the same peer
    // must follow them. They go as a prefix of its sends, in order; the first that does not fit
    // closes the run.
    forward_open_ = !forward_.empty() && forward_[si];
    while (received < recvs_.size()) receive(st, si, received++);
    check_headers();
    wait_sends(st, si);
    if (topology::is_exchange(st))
      for (std::uint32_t c = st.recv.first; c < st.recv.end(); ++c) replicated_[c] = true;
  }

  // Headers checked, then this step's receives posted: at the top of the step, or in the first
  // step just before the first encode or receive. MPI starts copying a matched message into the
  // buffer while it waits for anything, so nothing is posted before the headers are known good.
  void post_receives(const topology::step& st) {
    check_headers();
    if (posted_) return;
    posted_ = true;
    const bool reduce = st.act == topology::action::reduce;
    const std::size_t off = topology::is_exchange(st) ? landing_off_ : 0;
    for (const segment& sg : recvs_)
      recv_reqs_.push_back(t_.irecv(st.recv_peer, tag(), static_cast<std::byte*>(landing(sg, reduce)) + off, msg_bytes(sg.len)));
  }

  // Reduce-scatter: encode the running partial sum (error feedback: through its residual), then
  // send. Other phases forward the wire bytes as they are. fp32 sends the values themselves.
  void send_segment(const topology::step& st, const segment& sg) {
    const void* src = x_ + sg.lo;
    if constexpr (identity && receives_first) post_receives(st);
    if constexpr (!identity) {
      post_receives(st);
      if (st.phase == topology::phase::reduce_scatter) encode(sg, 0);
      src = sg.wire;
    }
    if (topology::is_exchange(st)) {
      // What the peer reads must not change as we add its values into ours: a copy (fp32), or
      // the wire image, which then replaces our own values so that both ends add the same two.
      if constexpr (identity) sp_.copy(sg.wire, x_ + sg.lo, msg_bytes(sg.len));
      else sp_.decode(codec_, sg.wire, sg.len, x_ + sg.lo);
      src = sg.wire;
    }
    // A copy step's bytes (final values, or wire bytes being forwarded) are not written again in
    // this call, and the receiver copies them: a transport that can let it read them here is told so.
    const bool reduce = st.act == topology::action::reduce;
    send_reqs_.push_back([&] {
      if constexpr (requires { t_.isend_in_place(st.send_peer, tag(), src, msg_bytes(sg.len)); })
        if (!reduce) return t_.isend_in_place(st.send_peer, tag(), src, msg_bytes(sg.len));
      return t_.isend(st.send_peer, tag(), src, msg_bytes(sg.len));
    }());
  }

  void receive(const topology::step& st, std::size_t si, std::size_t k) {
    post_receives(st);
    if (st.act == topology::action::reduce) recv_reduce(st, si, k);
    else recv_copy(st, si, k);
  }

  // The peer's partial sum, added into ours where the transport holds it, or, where the next step
  // sends it on (mark_forwards), straight into that message.
  // In an exchange both ends add the same two values, and must add them in the same order: a + b
  // and b + a are the same number but not the same NaN (x86 keeps the first operand's payload and
  // sign), so the higher rank puts the lower rank's values first.
  void recv_reduce(const topology::step& st, std::size_t si, std::size_t k) {
    const segment& sg = recvs_[k];
    const bool peer_first = topology::is_exchange(st) && st.recv_peer < g_.rank();
    if (!t_.consume(recv_reqs_[k], g_.deadline(), [&](const std::byte* data) {
          if (peer_first) {
            sp_.decode(codec_, data, sg.len, x_ + sg.lo);
            sp_.decode_add(codec_, sg.wire, sg.len, x_ + sg.lo);  // our own values, as sent
          } else if (!forward_sum(si, sg, data)) {
            sp_.decode_add(codec_, data, sg.len, x_ + sg.lo);
          }
        }))
      throw fail(errc::timeout, st.recv_peer, timeout_text("data from the peer", si, st.recv_peer));
  }

  // Our values plus the peer's, written as the next step's message for this segment; false where
  // that step does not send it, or the transport cannot take it whole now (sent the usual way then).
  bool forward_sum(std::size_t si, const segment& sg, const std::byte* data) {
    if constexpr (fills_sends) {
      if (!forward_open_) return false;
      const topology::step& nx = s_.steps[si + 1];
      if (sg.chunk < nx.send.first || sg.chunk >= nx.send.end()) return false;
      auto q = t_.try_isend_fill(nx.send_peer, tag(), msg_bytes(sg.len),
                                 [&](std::byte* dst) { sp_.sum_into(reinterpret_cast<float*>(dst), data, sg.len, x_ + sg.lo); });
      if (!q) {
        forward_open_ = false;
        return false;
      }
      forwarded_.push_back(std::move(*q));
      return true;
    } else {
      (void)si, (void)sg, (void)data;
      return false;
    }
  }

  // Final values: copied into place (where a plain receive would have put them) unless they are
  // there already, and decoded; the wire bytes stay in scratch for a later step to forward.
  void recv_copy(const topology::step& st, std::size_t si, std::size_t k) {
    const segment& sg = recvs_[k];
    void* const dst = landing(sg, false);
    const bool got = t_.consume(recv_reqs_[k], g_.deadline(), [&](const std::byte* data) {
      if (static_cast<const void*>(data) != dst) {
        if (!final_copy_.empty() && final_copy_[si]) space::copy_final(sp_, dst, data, msg_bytes(sg.len));
        else sp_.copy(dst, data, msg_bytes(sg.len));
      }
      if constexpr (!identity) sp_.decode(codec_, sg.wire, sg.len, x_ + sg.lo);
    });
    if (!got) throw fail(errc::timeout, st.recv_peer, timeout_text("data from the peer", si, st.recv_peer));
    if (sg.last) {
      const auto [lo, hi] = chunk(sg.chunk);
      ep_(lo, hi - lo);
    }
  }

  void wait_sends(const topology::step& st, std::size_t si) {
    for (auto& r : send_reqs_) wait_send(r, st, si);
  }
  void wait_send(typename T::request& r, const topology::step& st, std::size_t si) {
    if (!t_.wait(r, g_.deadline())) {
      // Where the transport tells (inproc: a send completes when the peer takes it), say whether
      // the peer ever took our header, i.e. entered this collective at all. Over MPI a small send
      // completes on its own (eager protocol), which tells nothing.
      const char* what = "receipt of sent data by the peer";
      if constexpr (requires { requires T::send_completion_means_taken; }) {
        const auto i = static_cast<std::size_t>(std::find(to_.begin(), to_.end(), st.send_peer) - to_.begin());
        if (i < header_sends_.size() && !t_.wait(header_sends_[i], transport::clock::now()))
          what = "receipt of sent data by the peer: it has not entered this collective (it has not taken this rank's header)";
      }
      throw fail(errc::timeout, st.send_peer, timeout_text(what, si, st.send_peer));
    }
  }

  // ---- a fan-in: many peers' copies of one span, added in one pass ------------------------------

  // The end of the fan-in that starts at step si (pipeline::fan_in_end); si + 1 on a stream,
  // which adds on the device, one message after the other.
  std::size_t fan_in_end(std::size_t si) const {
    if constexpr (space_type::ordered) return si + 1;
    else return pipeline::fan_in_end(s_, si);
  }

  // Steps [first, last) as one: every receive posted, every send posted at once (encoded from
  // chunks no receive touches), then each segment of the span is read from all m peers together
  // (in place, where the transport holds the bytes) and their copies added in step order. The
  // result has the bits of walking the steps one by one; the running sum is read and written
  // once instead of m times (fp32: tile by tile, so it stays in L1 while each copy streams past).
  void run_fan_in(std::size_t first, std::size_t last) {
    const std::size_t m = last - first;
    check_headers();
    const topology::chunk_span span = s_.steps[first].recv;
    const std::size_t span_bytes = wire_off_[span.end()] - wire_off_[span.first];
    cut(span, recvs_);
    recv_reqs_.clear();
    for (std::size_t i = 0; i < m; ++i)
      for (const segment& sg : recvs_) {
        // Peer i > 0 lands in the span's wire layout again, i - 1 spans into the fan-in area.
        void* at = i ? wire_ + fan_off_ + (i - 1) * span_bytes + (sg.wire - (wire_ + wire_off_[span.first])) : landing(sg, true);
        recv_reqs_.push_back(t_.irecv(s_.steps[first + i].recv_peer, tag(), at, msg_bytes(sg.len)));
      }
    fan_sends_.clear();
    for (std::size_t si = first; si < last; ++si) {
      cut(s_.steps[si].send, sends_);
      for (const segment& sg : sends_) {
        const void* src = x_ + sg.lo;
        if constexpr (!identity) {
          encode(sg, 0);
          src = sg.wire;
        }
        fan_sends_.emplace_back(si, t_.isend(s_.steps[si].send_peer, tag(), src, msg_bytes(sg.len)));
      }
    }
    copies_.assign(m, nullptr);
    for (std::size_t k = 0; k < recvs_.size(); ++k) read_fan_in(first, k, 0);
    for (auto& [si, r] : fan_sends_) wait_send(r, s_.steps[si], si);
  }

  // Segment k of the fan-in from its i-th peer on: each copy is held while the next is awaited,
  // and with all of them in hand they are added.
  void read_fan_in(std::size_t first, std::size_t k, std::size_t i) {
    if (i == copies_.size()) return add_copies(recvs_[k]);
    const std::size_t si = first + i;
    const int peer = s_.steps[si].recv_peer;
    const bool got = t_.consume(recv_reqs_[i * recvs_.size() + k], g_.deadline(), [&](const std::byte* data) {
      copies_[i] = data;
      read_fan_in(first, k, i + 1);
    });
    if (!got) throw fail(errc::timeout, peer, timeout_text("data from the peer", si, peer));
  }

  void add_copies(const segment& sg) {
    // 16 KiB of fp32 sum per tile (tried: 4, 16, 64 KiB at 64 MiB on 4 inproc ranks, docs/benchmarks.md).
    // A lossy wire (scales before codes) is not cut by offset: its copies are added segment-wide.
    const std::size_t tile = identity ? fan_tile : sg.len;
    for (std::size_t off = 0; off < sg.len; off += tile) {
      const std::size_t len = std::min(tile, sg.len - off);
      for (const std::byte* c : copies_) sp_.decode_add(codec_, c + off * sizeof(float), len, x_ + sg.lo + off);
    }
  }

  // ---- what becomes final ----------------------------------------------------------------------

  bool gathers() const { return op_.kind == op_kind::all_reduce || op_.kind == op_kind::all_gather; }
  bool owns() const { return gathers() || op_.kind == op_kind::reduce_scatter; }

  // This rank's chunk after the reduce-scatter: averaged, replaced by its wire image (its wire
  // bytes are what the all-gather forwards), handed to the epilogue.
  void finalize_owned() {
    check_headers();
    if (s_.owned.empty()) return;  // a rank folded out of recursive doubling: it receives the result
    const std::size_t lo = chunk(s_.owned.first).first, hi = chunk(s_.owned.end() - 1).second;
    if (op_.rop == reduce_op::average && op_.kind != op_kind::all_gather && hi > lo)
      sp_.divide(x_ + lo, hi - lo, static_cast<float>(size_));
    if (gathers()) settle(s_.owned, 1);
    if (hi > lo) ep_(lo, hi - lo);
  }

  // A broadcast root holds the final values from the start: the whole buffer becomes its wire image.
  void finalize_broadcast_root() {
    check_headers();
    settle({0, s_.chunks}, 2);
    if (n_) ep_(0, n_);
  }

  void settle(topology::chunk_span span, int ef_phase) {
    if (identity || size_ < 2) return;
    cut(span, sends_);
    for (const segment& sg : sends_) {
      encode(sg, ef_phase);
      sp_.decode(codec_, sg.wire, sg.len, x_ + sg.lo);
    }
  }

  // ---- helpers ---------------------------------------------------------------------------------

  std::pair<std::size_t, std::size_t> chunk(std::uint32_t c) const {
    const auto& off = op_.layout.offsets;
    return off.empty() ? chunk_range(n_, s_.chunks, c) : std::pair{off[c], off[c + 1]};
  }

  void cut(topology::chunk_span span, std::vector<segment>& out) const {
    out.clear();
    for (std::uint32_t c = span.first; c < span.end(); ++c) {
      const auto [lo, hi] = chunk(c);
      std::byte* w = wire_ + wire_off_[c];
      for (std::size_t a = lo, len = 0; a < hi; a += len) {  // a += seg_ could wrap (whole_chunk)
        len = std::min(seg_, hi - a);
        out.push_back({a, len, w, c, a + len == hi});
        w += codec_.wire_bytes(len);
      }
    }
  }

  // The fp32 wire is the values themselves: messages carry exactly 4n bytes, unpadded.
  std::size_t msg_bytes(std::size_t len) const { return identity ? len * sizeof(float) : codec_.wire_bytes(len); }
  // Where a plain receive puts a segment: the values themselves for an fp32 copy, else its wire slot.
  void* landing(const segment& sg, bool reduce) const {
    return (identity && !reduce) ? static_cast<void*>(x_ + sg.lo) : static_cast<void*>(sg.wire);
  }

  void encode(const segment& sg, int ef_phase) {
    float* r = nullptr;
    if constexpr (codec::feedback_codec<C>) {
      if (replicated_.empty() || !replicated_[sg.chunk])
        r = codec_.residual(op_.residual_key ? op_.residual_key : static_cast<const void*>(x_), n_, ef_phase, sp_) + sg.lo;
    }
    sp_.encode(codec_, x_ + sg.lo, sg.len, sg.wire, r);
  }

  // Messages between two ranks are matched in send order (the schedule guarantees both sides agree
  // on it), so the tag only separates calls; a step number would differ between a broadcast root's
  // k-th send and its receiver's first step.
  std::uint32_t tag() const { return static_cast<std::uint32_t>(seq_ & 0x7fff) << 9; }

  // The transport's group (NCCL's ncclGroupStart / End) around a step's posts. Closed on the way
  // out too when a post throws (an aborted communicator, a residual's allocation that fails):
  // NCCL's group depth is per thread, and a group left open swallows every later NCCL call of this
  // thread, a new communicator's and torch's included, which then never launch.
  struct open_group {
    schedule_run& run;
    bool open = true;
    explicit open_group(schedule_run& r) : run(r) { run.group_begin(); }
    void close() {
      open = false;
      run.group_end();
    }
    ~open_group() {
      if (!open) return;
      try {
        run.group_end();
      } catch (...) {  // the post's error is the one to report
      }
    }
    open_group(const open_group&) = delete;
    open_group& operator=(const open_group&) = delete;
  };
  void group_begin() {
    if constexpr (requires { t_.group_begin(); }) t_.group_begin();
  }
  void group_end() {
    if constexpr (requires { t_.group_end(); }) t_.group_end();
  }

  error fail(errc code, int peer, const std::string& what) const { return error(code, op_.label, rank_, peer, what); }
  // "no data from the peer after 5000 ms at step 3 of 6 (call #41); peer 2 is process 1234 on
  // this node, stopped (SIGSTOP or SIGTSTP)": the peer's state where the transport can see it.
  std::string timeout_text(const char* waiting, std::size_t si, int peer) const {
    std::string s = std::string("no ") + waiting + " after " + std::to_string(g_.options().timeout.count()) + " ms at step " +
                    std::to_string(si) + " of " + std::to_string(s_.steps.size()) + " (call #" + std::to_string(seq_) + ")";
    if constexpr (requires { t_.describe_peer(peer); }) {
      const std::string d = t_.describe_peer(peer);
      if (!d.empty()) s += "; peer " + std::to_string(peer) + " is " + d;
    }
    return s;
  }

  group<T>& g_;
  T& t_;
  space_type& sp_;
  const topology::schedule& s_;
  float* const x_;
  const std::size_t n_;
  C& codec_;
  const op_desc& op_;
  Epilogue& ep_;
  const int rank_, size_;

  std::uint64_t seq_ = 0;
  std::size_t seg_ = 1;
  std::vector<std::size_t> wire_off_;  // (chunk + 1)
  std::byte* wire_ = nullptr;
  std::size_t landing_off_ = 0;    // where an exchange's received image lies, past wire_off_'s
  std::vector<bool> replicated_;   // (chunk) an exchange left it equal on two ranks: no residual
  std::vector<bool> final_copy_;   // (step) received values this rank never sends on; empty: none
  std::vector<bool> forward_;      // (step) its sums go straight into the next step's sends; empty: none
  bool forward_open_ = false;      // this step's adds may still fill the next step's sends
  std::size_t fan_off_ = 0;        // where a fan-in's second and later peers land
  static constexpr std::size_t fan_tile = 4096;

  // Header exchange. `mine_` outlives the requests that send it: a request that has not completed
  // when the call fails withdraws its message or waits for the peer reading it, and only then is
  // the header's storage gone (members are destroyed in reverse order).
  wire_header mine_;
  std::vector<int> to_, from_;
  std::vector<wire_header> theirs_;
  std::vector<char> seen_;  // check_headers: which of theirs_ have been compared
  std::vector<typename T::request> header_sends_, header_recvs_;
  bool headers_checked_ = false;

  std::vector<segment> sends_, recvs_;
  std::vector<typename T::request> send_reqs_, recv_reqs_;
  std::vector<typename T::request> forwarded_;  // the next step's first sends, already made
  bool posted_ = false;
  std::vector<std::pair<std::size_t, typename T::request>> fan_sends_;  // (step, its send)
  std::vector<const std::byte*> copies_;                                // (peer of the fan-in)
};

template <transport::transport T, codec::codec C, class Epilogue>
void run_schedule(group<T>& g, const topology::schedule& s, std::span<float> buf, C& codec, const op_desc& op,
                  Epilogue& ep) {
  schedule_run<T, C, Epilogue>(g, s, buf, codec, op, ep).run();
}

}  // namespace detail
}  // namespace lockstep
