// python/lockstep_torch/csrc/policies.hpp: what both of lockstep_torch's engines share, with no
// torch in it — lockstep's policies chosen by name (codec, topology, op), and the table of DDP
// buckets whose error-feedback residuals the engine keeps.
//
// The host engine (module.cpp, over c10d_transport) and the stream engine (stream_engine.hpp:
// NCCL for CUDA buckets, and the CPU's stream-ordered twin in the suite) run every bucket through
// bucket_table::reduce, so how residuals are kept, moved with a bucket and refused on a resize is
// written once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <lockstep/codec.hpp>
#include <lockstep/collective.hpp>
#include <lockstep/topology.hpp>

namespace lockstep_torch {

namespace ls = lockstep;

// ---- names -> policies ---------------------------------------------------------------------------

enum class codec_kind { fp32, bf16, int8, dyntree8 };

inline codec_kind parse_codec(const std::string& name, int rank) {
  if (name == "fp32") return codec_kind::fp32;
  if (name == "bf16") return codec_kind::bf16;
  if (name == "int8") return codec_kind::int8;
  if (name == "dyntree8") return codec_kind::dyntree8;
  throw ls::error(ls::errc::invalid_argument, "lockstep_torch", rank, -1,
                  "unknown codec '" + name + "' (fp32, bf16, int8, dyntree8)");
}

// "ring", "torus2d" (the most square shape) or "torus2d:RxC".
struct topology_spec {
  bool torus = false;
  int rows = 0, cols = 0;
};

inline topology_spec parse_topology(const std::string& name, int rank, int size) {
  if (name == "ring") return {};
  if (name == "torus2d") return {true, 0, 0};
  int r = 0, c = 0;
  char x = 0, end = 0;
  if (name.rfind("torus2d:", 0) == 0 && std::sscanf(name.c_str() + 8, "%d%c%d%c", &r, &x, &c, &end) == 3 && x == 'x') {
    ls::topology::torus2d{r, c}.validate(size, rank);  // a shape that does not fit the group throws here
    return {true, r, c};
  }
  throw ls::error(ls::errc::invalid_argument, "lockstep_torch", rank, -1,
                  "unknown topology '" + name + "' (ring, torus2d, torus2d:RxC)");
}

inline ls::reduce_op parse_op(const std::string& op, int rank) {
  if (op == "sum") return ls::reduce_op::sum;
  if (op == "average" || op == "avg" || op == "mean") return ls::reduce_op::average;
  throw ls::error(ls::errc::invalid_argument, "lockstep_torch", rank, -1, "unknown op '" + op + "' (sum, average)");
}

// Seconds (> 0, inf allowed) as milliseconds, held at lockstep::longest_wait (a century: no
// limit, as asked; float("inf") and timedelta.max would overflow the count), where the group's
// deadline holds them too (core/deadline.hpp).
inline std::chrono::milliseconds timeout_ms(double timeout_s) {
  const double most_ms = std::chrono::duration<double, std::milli>(ls::longest_wait).count();
  // At least 1 ms: a positive timeout under half a millisecond would round to 0, fail the first
  // wait at once, and a Gloo timeout closes the user's whole process group (docs/torch.md, Waits).
  return std::chrono::milliseconds(static_cast<long long>(std::min(std::max(timeout_s * 1000.0 + 0.5, 1.0), most_ms)));
}

// A group's options from lockstep_torch's settings: the timeout in seconds, the segment (0: the
// transport's).
inline ls::group_options group_options_for(double timeout_s, std::size_t segment_bytes = 0) {
  if (!(timeout_s > 0))
    throw ls::error(ls::errc::invalid_argument, "lockstep_torch", -1, -1,
                    "timeout must be a positive number of seconds, not " + std::to_string(timeout_s));
  ls::group_options o;
  o.timeout = timeout_ms(timeout_s);
  o.segment_bytes = segment_bytes;
  return o;
}

template <class F>
void with_topology(const topology_spec& t, F&& f) {
  if (t.torus) f(ls::topology::torus2d{t.rows, t.cols});
  else f(ls::topology::ring{});
}

// One object of each codec, for the life of an engine: a stream-ordered call enqueues work that
// refers to its codec after the call has returned, so the codec may not be a temporary.
struct codecs {
  ls::codec::fp32 fp32;
  ls::codec::bf16 bf16;
  ls::codec::int8 int8;
  ls::codec::dyntree8 dyntree8;

  template <class F>
  void with(codec_kind k, F&& f) {
    switch (k) {
      case codec_kind::fp32: f(fp32); return;
      case codec_kind::bf16: f(bf16); return;
      case codec_kind::int8: f(int8); return;
      case codec_kind::dyntree8: f(dyntree8); return;
    }
  }
};

// ---- DDP buckets and their residuals --------------------------------------------------------------

// The error-feedback state of one DDP bucket: the codec object that holds its residuals.
using feedback = std::variant<std::monostate, ls::codec::error_feedback<ls::codec::bf16>,
                              ls::codec::error_feedback<ls::codec::int8>, ls::codec::error_feedback<ls::codec::dyntree8>>;

inline feedback make_feedback(codec_kind k) {
  switch (k) {
    case codec_kind::fp32: return std::monostate{};  // lossless: nothing to feed back
    case codec_kind::bf16: return ls::codec::error_feedback<ls::codec::bf16>{};
    case codec_kind::int8: return ls::codec::error_feedback<ls::codec::int8>{};
    case codec_kind::dyntree8: return ls::codec::error_feedback<ls::codec::dyntree8>{};
  }
  return std::monostate{};
}

struct bucket_state {
  std::size_t count = 0;
  const float* address = nullptr;  // where its residuals are keyed
  codec_kind codec = codec_kind::fp32;
  feedback ef;
};

// The buckets of one engine by DDP bucket index. Residuals are kept per bucket index; a bucket
// that moved in memory keeps them (carried to the new address), a bucket whose size changed is an
// error, since its residuals no longer line up. Entries are never erased while calls may run
// (clear() only after the engine has synchronised), so a bucket_state* stays valid.
class bucket_table {
 public:
  // The state of bucket `index`, made on first use; its size may not change afterwards.
  bucket_state* bucket(int index, codec_kind ck, std::size_t count, int rank) {
    std::lock_guard lk(m_);
    auto [it, fresh] = buckets_.try_emplace(index);
    bucket_state& b = it->second;
    if (fresh) {
      b.count = count;
      b.codec = ck;
      b.ef = make_feedback(ck);
    } else if (b.count != count) {
      throw ls::error(ls::errc::invalid_argument, "allreduce_hook", rank, -1,
                      "bucket " + std::to_string(index) + " held " + std::to_string(b.count) + " elements and now holds " +
                          std::to_string(count) +
                          ": its error-feedback residuals no longer line up (buckets may only be rebuilt before "
                          "error feedback starts, i.e. in DDP's first iteration; call state.reset() after changing them)");
    } else if (b.codec != ck) {
      b.codec = ck;
      b.ef = make_feedback(ck);
      b.address = nullptr;
    }
    return &b;
  }

  std::map<int, std::size_t> counts() {
    std::lock_guard lk(m_);
    std::map<int, std::size_t> out;
    for (const auto& [k, b] : buckets_) out[k] = b.count;
    return out;
  }
  void clear() {
    std::lock_guard lk(m_);
    buckets_.clear();
  }

  // Calls f(ef) with bucket `b`'s error-feedback codec for a collective on `buf` in g's space
  // (the host's, or a stream's, where the copies below are only enqueued). A bucket that moved in
  // memory carries its residuals to its new address first (they are keyed by address), through
  // scratch memory of that space.
  template <class Group, class F>
  static void with_feedback(Group& g, bucket_state& b, std::span<float> buf, F&& f) {
    std::visit(
        [&](auto& ef) {
          if constexpr (!std::is_same_v<std::decay_t<decltype(ef)>, std::monostate>) {
            auto& sp = g.space();
            if (b.address && b.address != buf.data()) {
              auto saved = sp.allocate(ef.state_floats(buf.size()) * sizeof(float));
              float* s = reinterpret_cast<float*>(saved.data());
              ef.save(std::span<const float>(b.address, buf.size()), s, sp);
              ef.forget(b.address);
              ef.load(std::span<const float>(buf.data(), buf.size()), s, sp);
            }
            b.address = buf.data();
            f(ef);
          }
        },
        b.ef);
  }

 private:
  std::mutex m_;
  std::map<int, bucket_state> buckets_;  // (DDP bucket index)
};

}  // namespace lockstep_torch
