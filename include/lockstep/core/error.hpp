// lockstep/core/error.hpp: the one exception type, naming the operation, the rank and the peer.
//
// A collective that fails must say where: "all_reduce(ring, dyntree8) on rank 2: timed out after
// 5 s waiting for peer 1 (step 3)". Every throw in the library goes through lockstep::error so that
// callers can catch one type and read the fields, and users can read the message alone.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace lockstep {

enum class errc {
  invalid_argument,  // bad input on this rank: null buffer, overflowing count, wrong shape
  mismatch,          // ranks disagree about the call: count, codec, op, root, segment size
  timeout,           // a blocking wait ran past the group's timeout
  aborted,           // another rank of the group failed first; its message is included
  transport,         // the transport itself reported a failure (MPI error, NCCL error)
};

constexpr std::string_view to_string(errc e) noexcept {
  switch (e) {
    case errc::invalid_argument: return "invalid argument";
    case errc::mismatch: return "mismatch between ranks";
    case errc::timeout: return "timeout";
    case errc::aborted: return "aborted";
    case errc::transport: return "transport error";
  }
  return "error";
}

class error : public std::runtime_error {
 public:
  // rank or peer is -1 where it does not apply.
  error(errc code, std::string op, int rank, int peer, const std::string& detail)
      : std::runtime_error(format(code, op, rank, peer, detail)),
        code_(code), op_(std::move(op)), rank_(rank), peer_(peer), detail_(detail) {}

  errc code() const noexcept { return code_; }
  const std::string& op() const noexcept { return op_; }
  int rank() const noexcept { return rank_; }
  int peer() const noexcept { return peer_; }
  const std::string& detail() const noexcept { return detail_; }

 private:
  static std::string format(errc code, const std::string& op, int rank, int peer,
                            const std::string& detail) {
    std::string s = "lockstep: ";
    s += op.empty() ? std::string("call") : op;
    if (rank >= 0) s += " on rank " + std::to_string(rank);
    if (peer >= 0) s += " (peer " + std::to_string(peer) + ")";
    s += ": ";
    s += to_string(code);
    if (!detail.empty()) s += ": " + detail;
    return s;
  }

  errc code_;
  std::string op_;
  int rank_;
  int peer_;
  std::string detail_;
};

}  // namespace lockstep
