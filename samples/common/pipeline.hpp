// samples/common/pipeline.hpp: the input pipeline of the sample trainers (Ying et al. 2018, sec. 3).
//
// Purpose: hand each replica its next batch of normalised, augmented images without the training
// step waiting for it. The decoded set is cached in memory once (image_set, shared by every replica
// of a process); a background thread per replica prepares the next batches while the current step
// runs, fusing byte -> float conversion with the crop and the flip.
//
// Sharding: every replica computes the same permutation of the epoch from (seed, epoch). The
// permutation is cut into global batches of replicas * batch images; replica r's shard is slice r
// of every global batch. So the images of global step s do not depend on how many replicas share
// them, which is what lets one replica with batch B and four with B/4 train the same model.
// Augmentation draws from a generator keyed by (seed, epoch, position in the permutation), not by
// thread timing: a run is reproducible, and resuming at an epoch boundary continues bit-for-bit.
//
// Limits: single-channel images (MNIST-style); the last incomplete global batch of an epoch is
// dropped so every step has the same shape on every replica.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "idx.hpp"

namespace sample {

// splitmix64: a tiny generator whose output depends only on its key, the same on every platform
// (std::shuffle and std::uniform_int_distribution are not specified bit-for-bit).
struct rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n small: the modulo bias is below 2^-40 for n < 2^24.
  int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }
  // Uniform in [0, 1) with 24 random bits.
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
};

inline std::uint64_t key_of(std::uint64_t seed, std::uint64_t a, std::uint64_t b = 0) {
  rng r{seed ^ (a * 0xD1B54A32D192ED03ull) ^ (b * 0x8CB92BA72F3D8DD7ull)};
  return r.next();
}

// The visiting order of one epoch: a Fisher-Yates shuffle keyed by (seed, epoch).
inline std::vector<int> epoch_permutation(int n, std::uint64_t seed, int epoch) {
  std::vector<int> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = i;
  rng r{key_of(seed, 0x5045524Dull, static_cast<std::uint64_t>(epoch))};
  for (int i = n - 1; i > 0; --i) std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(r.below(i + 1))]);
  return p;
}

// Fashion-MNIST's pixel mean and standard deviation over the training set (pixels / 255).
inline constexpr float pixel_mean = 0.2860f;
inline constexpr float pixel_std = 0.3530f;

// How a training image is perturbed: shifted by up to `pad` pixels each way (a random crop of the
// image padded with `pad` zero pixels) and mirrored left-right with probability 1/2.
struct augment_options {
  bool enabled = true;
  int pad = 2;
  bool flip = true;
};

// out (rows, cols) <- normalised image i of the set, cropped and flipped as `key` decides.
inline void prepare_image(float* out, const image_set& set, int i, const augment_options& aug, std::uint64_t key) {
  const int H = set.rows, W = set.cols;
  const std::uint8_t* img = set.pixels.data() + static_cast<std::size_t>(i) * H * W;
  int dy = 0, dx = 0;
  bool flip = false;
  if (aug.enabled) {
    rng r{key};
    dy = r.below(2 * aug.pad + 1) - aug.pad;
    dx = r.below(2 * aug.pad + 1) - aug.pad;
    flip = aug.flip && (r.next() & 1);
  }
  const float scale = 1.0f / (255.0f * pixel_std), shift = -pixel_mean / pixel_std;
  for (int y = 0; y < H; ++y) {
    const int sy = y + dy;
    for (int x = 0; x < W; ++x) {
      const int sx = (flip ? W - 1 - x : x) + dx;
      const bool inside = sy >= 0 && sy < H && sx >= 0 && sx < W;
      out[y * W + x] = inside ? img[sy * W + sx] * scale + shift : shift;  // padding is black
    }
  }
}

// One replica's batch of one step.
struct batch {
  int epoch = 0, step = 0;
  std::vector<float> images;  // (B, 1, rows, cols), normalised
  std::vector<int> labels;    // (B)
};

// Prepares, in a background thread, replica `rank`'s batches in order: epoch first_epoch step 0,
// step 1, ..., then the next epoch, for as long as the loader lives.
class batch_loader {
 public:
  batch_loader(const image_set& set, int batch_size, int rank, int replicas, std::uint64_t seed,
               augment_options aug, int first_epoch, int depth = 3)
      : set_(set), B_(batch_size), rank_(rank), R_(replicas), seed_(seed), aug_(aug),
        slots_(static_cast<std::size_t>(depth)) {
    if (steps_per_epoch() < 1)
      throw data_error("batch_loader: " + std::to_string(set.n) + " images are fewer than one global batch of " +
                       std::to_string(replicas) + " x " + std::to_string(batch_size));
    thread_ = std::thread([this, first_epoch] { produce(first_epoch); });
  }
  ~batch_loader() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  batch_loader(const batch_loader&) = delete;
  batch_loader& operator=(const batch_loader&) = delete;

  int steps_per_epoch() const { return set_.n / (B_ * R_); }

  // The next batch; valid until the next call. Blocks only if the thread has fallen behind.
  const batch& next() {
    std::unique_lock lk(mu_);
    if (taken_ > released_) {  // the caller is done with the batch it held
      released_ = taken_;
      cv_.notify_all();
    }
    cv_.wait(lk, [&] { return produced_ > taken_ || error_; });
    if (error_) std::rethrow_exception(error_);
    return slots_[static_cast<std::size_t>(taken_++ % slots_.size())];
  }

 private:
  void produce(int epoch) {
    try {
      for (;; ++epoch) {
        const std::vector<int> perm = epoch_permutation(set_.n, seed_, epoch);
        for (int step = 0; step < steps_per_epoch(); ++step) {
          std::size_t slot;
          {
            std::unique_lock lk(mu_);
            cv_.wait(lk, [&] { return stop_ || produced_ - released_ < static_cast<long long>(slots_.size()); });
            if (stop_) return;
            slot = static_cast<std::size_t>(produced_ % slots_.size());
          }
          fill(slots_[slot], perm, epoch, step);
          {
            std::lock_guard lk(mu_);
            ++produced_;
          }
          cv_.notify_all();
        }
      }
    } catch (...) {
      std::lock_guard lk(mu_);
      error_ = std::current_exception();
      cv_.notify_all();
    }
  }

  void fill(batch& b, const std::vector<int>& perm, int epoch, int step) {
    const int HW = set_.rows * set_.cols;
    b.epoch = epoch;
    b.step = step;
    b.images.resize(static_cast<std::size_t>(B_) * HW);
    b.labels.resize(static_cast<std::size_t>(B_));
    const long long first = (static_cast<long long>(step) * R_ + rank_) * B_;  // position in the permutation
    for (int k = 0; k < B_; ++k) {
      const long long pos = first + k;
      const int i = perm[static_cast<std::size_t>(pos)];
      prepare_image(b.images.data() + static_cast<std::size_t>(k) * HW, set_, i, aug_,
                    key_of(seed_, static_cast<std::uint64_t>(epoch) + 1, static_cast<std::uint64_t>(pos)));
      b.labels[static_cast<std::size_t>(k)] = set_.labels[static_cast<std::size_t>(i)];
    }
  }

  const image_set& set_;
  const int B_, rank_, R_;
  const std::uint64_t seed_;
  const augment_options aug_;
  std::vector<batch> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  long long produced_ = 0, taken_ = 0, released_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace sample
