// lockstep/optim/completion.hpp: which tensors an all-reduce's epilogue call completes.
//
//   optim::completion done(ps);                        // every tensor waiting for all its elements
//   auto [a, b] = done.report(first, last, rank);     // tensors [a, b) are final now
//   done.check_all_reported(rank);                     // at the end of the all-reduce
//
// A fused step updates a tensor whose update needs its norms (LARS) once all of its elements are
// final, i.e. in the epilogue call that delivers its last range. The tensors one call completes
// are always consecutive: of the tensors a range [first, last) touches (consecutive, the buffer
// holds them in order), the inner ones lie wholly inside it and the two at the ends may or may
// not have been finished by earlier calls. The host step (optim/step.hpp) and the device step
// (device/step.hpp) share this bookkeeping; the device step turns [a, b) into one launch of each
// kernel. Reporting an element twice, or not at all, is an error that names the tensor: it would
// mean the all-reduce's epilogue contract is broken.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "param_set.hpp"

namespace lockstep::optim {

class completion {
 public:
  explicit completion(const param_set& ps, const char* op = "optim::step") : ps_(&ps), op_(op) { reset(); }

  // Every tensor waits for all of its elements again (a new step).
  void reset() {
    remaining_.resize(ps_->tensor_count());
    for (std::size_t t = 0; t < remaining_.size(); ++t) remaining_[t] = (*ps_)[t].size;
  }

  // Marks [first, last) final; returns the tensors that became complete, as [a, b).
  std::pair<std::size_t, std::size_t> report(std::size_t first, std::size_t last, int rank) {
    if (last > ps_->size() || first > last)
      throw error(errc::invalid_argument, op_, rank, -1,
                  "the all-reduce reported [" + std::to_string(first) + ", " + std::to_string(last) +
                      ") final, outside the " + std::to_string(ps_->size()) + " elements of the parameters");
    if (first == last) return {0, 0};  // an empty range completes nothing
    auto [a, b] = ps_->tensors_in(first, last);
    std::size_t done_lo = b, done_hi = b;
    for (std::size_t t = a; t < b; ++t) {
      const auto& d = (*ps_)[t];
      const std::size_t lo = std::max(d.offset, first), hi = std::min(d.offset + d.size, last);
      if (hi - lo > remaining_[t])
        throw error(errc::invalid_argument, op_, rank, -1,
                    "the all-reduce reported elements of tensor " + std::to_string(t) + " final twice");
      remaining_[t] -= hi - lo;
      if (remaining_[t] != 0) continue;
      if (done_lo == b) done_lo = t;
      else if (done_hi != t)  // cannot happen for a range (see the header); a guard, not a branch
        throw error(errc::invalid_argument, op_, rank, -1, "tensors completed by one range are not consecutive");
      done_hi = t + 1;
    }
    return done_lo == b ? std::pair<std::size_t, std::size_t>{b, b} : std::pair<std::size_t, std::size_t>{done_lo, done_hi};
  }

  void check_all_reported(int rank) const {
    for (std::size_t t = 0; t < remaining_.size(); ++t)
      if (remaining_[t] != 0)
        throw error(errc::invalid_argument, op_, rank, -1,
                    "the all-reduce left " + std::to_string(remaining_[t]) + " elements of tensor " +
                        std::to_string(t) + " unreported");
  }

 private:
  const param_set* ps_;
  const char* op_;
  std::vector<std::size_t> remaining_;  // (tensor): elements not yet final in this step
};

}  // namespace lockstep::optim
