// lockstep/optim/param_set.hpp: many tensors over one flat buffer, and how a sweep cuts them.
//
// All of a model's parameters live in one fp32 buffer of weights and one of gradients (backward
// writes gradients into one flat buffer, the all-reduce moves it in one call). A param_set names
// the tensors inside: offset, size and whether the tensor is exempt (biases and batch-norm γ/β,
// which LARS leaves without trust ratio and weight decay). ResNet-50 has 161 tensors.
//
//   buffer  | t0 ...... | t1 .. |pad| t2 ............................ | ...      // (element)
//   blocks  | b0 | b1 |b2| b3  |    | b4 | b5 | b6 | b7 | b8 | b9 |b10|          // (tensor, block)
//
// Each tensor is cut into blocks of policy.block elements, counted from the tensor's start. A
// block is the unit of a sum of squares: its sum is always taken over the same elements in the
// same order, so every rank computes bit-identical norms whatever order the reduced ranges arrive
// in, and LARS weights stay equal across ranks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../core/error.hpp"

namespace lockstep::optim {

struct tensor_desc {
  std::size_t offset = 0;  // first element in the flat buffers
  std::size_t size = 0;    // elements
  bool exempt = false;     // bias or batch-norm parameter: no trust ratio, no weight decay
};

// How a sweep cuts memory. Plain values; docs/optim.md has the measurements behind them.
struct sweep_policy {
  // Elements per sum-of-squares block (16 KiB of fp32). Changing it changes the rounding of the
  // norms (and the device kernels use one CUDA block per param_set block).
  std::size_t block = 4096;
  // Elements per parallel task: 64 Ki x 20 B = 1.25 MiB moved, about 0.1 ms at 10 GB/s, so a
  // task's claim (one atomic add) is noise and 25.6 M parameters make ~400 tasks to balance.
  std::size_t task = 1 << 16;
  // Elements per LARS wave: 256 Ki x 8 B = 2 MiB of w and g, read by the norm pass and read
  // again by the update about one wave later. On the 2-core EPYC VM of docs/benchmarks.md
  // (32 MiB L3 shared with other tenants) 128 Ki .. 512 Ki were within noise of each other and
  // whole-model waves (no reuse) ~10 % slower; a smaller wave only adds tasks.
  std::size_t wave = 1 << 18;
};

class param_set {
 public:
  // Tensors in ascending offset order, non-empty and non-overlapping; gaps are allowed (and are
  // left alone by every update).
  explicit param_set(std::vector<tensor_desc> tensors, sweep_policy policy = {})
      : tensors_(std::move(tensors)), policy_(policy) {
    auto bad = [](const std::string& why) { return error(errc::invalid_argument, "param_set", -1, -1, why); };
    if (policy_.block == 0 || policy_.task == 0 || policy_.wave == 0) throw bad("sweep_policy sizes must be positive");
    first_block_.reserve(tensors_.size() + 1);
    std::size_t end = 0, blocks = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const tensor_desc& t = tensors_[i];
      if (t.size == 0) throw bad("tensor " + std::to_string(i) + " is empty");
      if (t.offset < end)
        throw bad("tensor " + std::to_string(i) + " at offset " + std::to_string(t.offset) +
                  " overlaps or precedes the tensor before it (which ends at " + std::to_string(end) +
                  "); tensors must be in ascending offset order");
      end = t.offset + t.size;
      params_ += t.size;
      first_block_.push_back(blocks);
      blocks += (t.size + policy_.block - 1) / policy_.block;
    }
    first_block_.push_back(blocks);
    size_ = end;
  }

  // Tensors of the given sizes laid out back to back, each offset rounded up to `align` elements
  // (16 floats = one 64-byte cache line, so every tensor starts on a line).
  static param_set packed(std::span<const std::size_t> sizes, const std::vector<bool>& exempt = {},
                          std::size_t align = 16, sweep_policy policy = {}) {
    if (!exempt.empty() && exempt.size() != sizes.size())
      throw error(errc::invalid_argument, "param_set::packed", -1, -1,
                  std::to_string(sizes.size()) + " sizes but " + std::to_string(exempt.size()) + " exempt flags");
    align = std::max<std::size_t>(align, 1);
    std::vector<tensor_desc> ts;
    ts.reserve(sizes.size());
    std::size_t at = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      at = (at + align - 1) / align * align;
      ts.push_back({at, sizes[i], !exempt.empty() && exempt[i]});
      at += sizes[i];
    }
    return param_set(std::move(ts), policy);
  }

  std::size_t size() const noexcept { return size_; }      // elements the flat buffers must hold
  std::size_t params() const noexcept { return params_; }  // elements inside tensors
  std::size_t tensor_count() const noexcept { return tensors_.size(); }
  std::span<const tensor_desc> tensors() const noexcept { return tensors_; }
  const tensor_desc& operator[](std::size_t i) const noexcept { return tensors_[i]; }
  const sweep_policy& policy() const noexcept { return policy_; }

  std::size_t block_count() const noexcept { return first_block_.back(); }
  std::size_t first_block(std::size_t t) const noexcept { return first_block_[t]; }
  std::size_t block_count(std::size_t t) const noexcept { return first_block_[t + 1] - first_block_[t]; }
  // Elements [first, last) of block b of tensor t, as buffer positions.
  std::pair<std::size_t, std::size_t> block_range(std::size_t t, std::size_t b) const noexcept {
    const std::size_t lo = tensors_[t].offset + b * policy_.block;
    return {lo, std::min(lo + policy_.block, tensors_[t].offset + tensors_[t].size)};
  }

  // The tensors that overlap buffer elements [lo, hi), as an index range [first, last).
  std::pair<std::size_t, std::size_t> tensors_in(std::size_t lo, std::size_t hi) const noexcept {
    // First tensor whose end lies beyond lo, then every one that starts before hi.
    auto a = std::partition_point(tensors_.begin(), tensors_.end(),
                                  [&](const tensor_desc& t) { return t.offset + t.size <= lo; });
    auto b = std::partition_point(a, tensors_.end(), [&](const tensor_desc& t) { return t.offset < hi; });
    return {static_cast<std::size_t>(a - tensors_.begin()), static_cast<std::size_t>(b - tensors_.begin())};
  }

 private:
  std::vector<tensor_desc> tensors_;
  sweep_policy policy_;
  std::vector<std::size_t> first_block_;  // (tensor + 1): prefix sums of blocks per tensor
  std::size_t size_ = 0, params_ = 0;
};

// Whether optimizer `opt` asks for per-tensor sums (norms, LARS) of any tensor of ps. Without them
// an update is one sweep over the buffer with nothing to reduce first (plain SGD), which every
// update and step path (host and device) uses to skip the norm pass.
template <class O>
bool needs_any_sums(const O& opt, const param_set& ps) {
  for (std::size_t t = 0; t < ps.tensor_count(); ++t)
    if (opt.sums(ps[t].exempt).any()) return true;
  return false;
}

}  // namespace lockstep::optim
