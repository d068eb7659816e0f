// samples/common/image_folder.hpp: the ImageNet input pipeline of the sample trainers (Ying et al.
// 2018, sec. 3): a JPEG folder, sharded, shuffled, cached, decoded-and-cropped in one pass by a
// pool of threads a few batches ahead of the training step.
//
// Folder: DIR/train/<class>/**/*.{jpg,jpeg} and DIR/val/<class>/**/*.{jpg,jpeg} (any case), as
// torchvision's ImageFolder reads it: classes are the sub-folders sorted by name (byte order, which
// for UTF-8 is Python's code-point order), label = index; files sorted by folder then name,
// symbolic links followed. A class without files is an error, as in ImageFolder. val/ takes its
// class list from train/ when train/ exists, so a class missing from val/ cannot shift labels.
//
// Sharding (as samples/common/pipeline.hpp): every replica computes the same permutation of the
// epoch from (seed, epoch); it is cut into global batches of replicas * batch files and replica r
// takes slice r of each. Augmentation draws from a generator keyed by (seed, epoch, position in the
// permutation), so a batch does not depend on thread timing nor on how many replicas share a step.
//   train: the last partial global batch is dropped; steps_per_epoch = files / (replicas * batch).
//   val:   no shuffle (file order), the last partial global batch is kept and padded: padding
//          entries have label -1 and all-zero images; steps_per_epoch = ceil(files / (replicas * batch)).
//
// Augmentation: train = torchvision's RandomResizedCrop(size, scale (0.08, 1), ratio (3/4, 4/3))
// (same algorithm: 10 tries, then the centre crop of clamped ratio) and a flip with probability
// 1/2; val = resize the shorter side to size / crop_pct, centre crop size (that is: the centre
// square of crop_pct of the shorter side, exactly centred; crop_pct 7/8 is torchvision's
// Resize(256) + CenterCrop(224), timm's crop_pct). Both then go through jpeg_decoder's fused
// decode-crop-resize (samples/common/jpeg.hpp: DCT scaling, bilinear, no antialias).
//
// Bad files: a corrupt, truncated, empty or non-JPEG file is a data_error naming the file, thrown
// by next() for the batch that holds it. With skip_bad it is counted once (skipped()) and replaced:
// the image at position p is taken from the first of the files at positions p + 1, p + 2, ... (mod
// files) of the same permutation that decodes, with its own label and an augmentation keyed by
// (seed, epoch, p, attempt); which file replaces which depends only on the files, never on timing.
// A file found bad is remembered and not read again.
//
// Cache: with cache, each file's compressed bytes are kept in memory after the first read, shared
// by every pipeline of the process that reads the same split folder (replicas as threads).
//
// Synthetic: no files; `synthetic_images` images of `synthetic_classes` classes; the images come
// from a fixed pool of `batch` random images (uniform bytes, normalised) made once, labels are
// uniform and keyed like the augmentation; next() only copies (next_view() not even that), so a
// synthetic run measures the step, not a decoder.
//
// Shapes: images (batch, 3, size, size) fp32, NCHW, normalised (or (batch, size, size, 3) with
// channels_last); labels (batch) int32.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "data_error.hpp"
#include "jpeg.hpp"
#include "pipeline.hpp"  // rng, key_of, epoch_permutation

namespace sample {

struct image_pipeline_options {
  std::string dir;                 // ImageNet layout root (dir/train/<class>/*.JPEG, dir/val/<class>/*.JPEG); unused with synthetic
  bool train = true;               // train/: random-resized crop + flip; val/: resize shorter side (size / crop_pct) + centre crop
  int size = 224;                  // output side
  int batch = 32;                  // images per replica per step
  int rank = 0, replicas = 1;      // this replica's shard
  std::uint64_t seed = 1;
  bool cache = false;              // keep the compressed files in memory after the first read
  int threads = 1;                 // decode threads of this replica
  int prefetch = 2;                // batches prepared ahead
  bool skip_bad = false;           // count and skip corrupt files instead of throwing
  bool synthetic = false;          // random images and labels, no files
  int synthetic_classes = 1000;
  std::size_t synthetic_images = 1281167;
  std::array<float, 3> mean{0.485f, 0.456f, 0.406f}, stddev{0.229f, 0.224f, 0.225f};
  // Added members (not in the issue's interface):
  double scale_min = 0.08, scale_max = 1.0;             // RandomResizedCrop's area range
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // and its aspect-ratio range
  double crop_pct = 0.875;                              // val: the centre square's share of the shorter side
  bool channels_last = false;      // images as (batch, size, size, 3), NHWC, instead of NCHW
  unsigned scales = simd_scales;   // DCT scales the decoder may choose (jpeg.hpp: 1/8, 2/8, 4/8, 8/8; all_scales for all n/8)
  double timeout_s = 600;          // next() and start_epoch() give up (std::runtime_error) after waiting this long
};

// torchvision.transforms.RandomResizedCrop.get_params with our generator: integer crop (i, j, h, w).
inline crop_rect random_resized_crop(int width, int height, rng& g, double scale_min = 0.08, double scale_max = 1.0,
                                     double ratio_min = 3.0 / 4.0, double ratio_max = 4.0 / 3.0) {
  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(ratio_min), log_hi = std::log(ratio_max);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale_min + (scale_max - scale_min) * g.uniform());
    const double aspect = std::exp(log_lo + (log_hi - log_lo) * g.uniform());
    // Python's round(): halves to even, which nearbyint does in the default rounding mode.
    const long long w = std::llrint(std::sqrt(target * aspect));
    const long long h = std::llrint(std::sqrt(target / aspect));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int y = g.below(static_cast<int>(height - h + 1));
      const int x = g.below(static_cast<int>(width - w + 1));
      return {static_cast<double>(x), static_cast<double>(y), static_cast<double>(w), static_cast<double>(h)};
    }
  }
  const double in_ratio = static_cast<double>(width) / height;
  long long w = width, h = height;
  if (in_ratio < ratio_min) h = std::llrint(w / ratio_min);
  else if (in_ratio > ratio_max) w = std::llrint(h * ratio_max);
  w = std::clamp<long long>(w, 1, width);
  h = std::clamp<long long>(h, 1, height);
  return {static_cast<double>((width - w) / 2), static_cast<double>((height - h) / 2), static_cast<double>(w),
          static_cast<double>(h)};
}

// Validation: the centre square of crop_pct of the shorter side (Resize(size / crop_pct) +
// CenterCrop(size)); 7/8 by default, as torchvision's ImageNet evaluation. Images whose subject fills
// the frame (Fashion-MNIST's garments) lose their edges to it: crop_pct 1 keeps the whole square.
inline crop_rect centre_crop(int width, int height, double crop_pct = 0.875) {
  const double side = std::min(width, height) * crop_pct;
  return {(width - side) / 2, (height - side) / 2, side, side};
}

// One listed file.
struct image_file {
  std::string path;
  int label = 0;
};

// An ImageFolder listing: class names sorted, files sorted by (folder, name), labels by class.
struct image_listing {
  std::vector<std::string> classes;
  std::vector<image_file> files;
};

inline bool has_jpeg_extension(const std::filesystem::path& p) {
  std::string e = p.extension().string();
  for (char& c : e) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return e == ".jpg" || e == ".jpeg";
}

inline std::vector<std::string> class_folders(const std::string& split_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(split_dir, ec))
    throw data_error(split_dir + ": missing (expected the ImageNet layout DIR/train/<class>/*.JPEG, DIR/val/<class>/*.JPEG)");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(split_dir, fs::directory_options::follow_directory_symlink, ec))
    if (e.is_directory(ec)) names.push_back(e.path().filename().string());
  if (ec) throw data_error(split_dir + ": cannot list (" + ec.message() + ")");
  std::sort(names.begin(), names.end());
  if (names.empty()) throw data_error(split_dir + ": no class folders");
  return names;
}

// Lists DIR/<split>/; `classes`, when not empty, fixes the class list (and so the labels).
inline image_listing list_image_folder(const std::string& split_dir, std::vector<std::string> classes = {}) {
  namespace fs = std::filesystem;
  image_listing l;
  const std::vector<std::string> present = class_folders(split_dir);
  if (classes.empty()) classes = present;
  for (const std::string& c : present)
    if (!std::binary_search(classes.begin(), classes.end(), c))
      throw data_error(split_dir + "/" + c + ": a class folder that train/ does not have");
  l.classes = classes;
  for (std::size_t k = 0; k < classes.size(); ++k) {
    const std::string cdir = split_dir + "/" + classes[k];
    std::error_code ec;
    if (!fs::is_directory(cdir, ec)) continue;  // a class of train/ that val/ lacks: no files of it
    std::vector<std::pair<std::string, std::string>> found;  // (folder, name)
    // Links to folders are followed (a class assembled from links is common), but not a link back
    // to a folder it is inside of: that loop would list the same files again at every turn until
    // the path grew too long. `inside[d]` is the real path of the folder whose entries are at depth
    // d. A .jpg link to nothing is listed, so that reading it fails naming it (or --skip-bad-images
    // skips it, saying so), as torchvision's ImageFolder does.
    std::vector<fs::path> inside{fs::canonical(cdir, ec)};
    for (auto it = fs::recursive_directory_iterator(cdir, fs::directory_options::follow_directory_symlink, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code e2;
      if (it->is_directory(e2)) {
        fs::path real = fs::canonical(it->path(), ec);
        if (ec) break;
        inside.resize(static_cast<std::size_t>(it.depth()) + 1);
        if (std::find(inside.begin(), inside.end(), real) != inside.end()) {
          it.disable_recursion_pending();
          std::fprintf(stderr, "note: %s: a link to a folder it is inside of (%s), not followed\n", it->path().c_str(), real.c_str());
        } else {
          inside.push_back(std::move(real));
        }
        continue;
      }
      if (!has_jpeg_extension(it->path())) continue;
      const bool dangling = it->is_symlink(e2) && !fs::exists(it->path(), e2);
      if (it->is_regular_file(e2) || dangling)
        found.emplace_back(it->path().parent_path().string(), it->path().filename().string());
    }
    if (ec) throw data_error(cdir + ": cannot list (" + ec.message() + ")");
    if (found.empty() && std::binary_search(present.begin(), present.end(), classes[k]))
      throw data_error(cdir + ": no .jpg or .jpeg files (torchvision's ImageFolder refuses an empty class too)");
    std::sort(found.begin(), found.end());
    for (auto& [folder, name] : found) l.files.push_back({folder + "/" + name, static_cast<int>(k)});
  }
  if (l.files.empty()) throw data_error(split_dir + ": no .jpg or .jpeg files");
  return l;
}

// Reads a whole file into `out` (its capacity reused) or throws data_error naming it.
inline void read_file(const std::string& path, std::vector<std::uint8_t>& out) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw data_error(path + ": cannot open (" + std::strerror(errno) + ")");
  struct closer {
    std::FILE* f;
    ~closer() { std::fclose(f); }
  } close_on_exit{f};
  // The size from the end offset, then one read; a file that grows meanwhile is read in pieces.
  long size = -1;
  if (std::fseek(f, 0, SEEK_END) == 0) size = std::ftell(f);
  if (size < 0 || std::fseek(f, 0, SEEK_SET) != 0) throw data_error(path + ": cannot seek (" + std::strerror(errno) + ")");
  out.resize(static_cast<std::size_t>(size));
  std::size_t got = size > 0 ? std::fread(out.data(), 1, out.size(), f) : 0;
  out.resize(got);
  std::uint8_t buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.insert(out.end(), buf, buf + n);
  if (std::ferror(f)) throw data_error(path + ": read error (" + std::strerror(errno) + ")");
}

// Compressed files kept in memory, shared by every pipeline of the process over one split folder.
class file_cache {
 public:
  explicit file_cache(std::size_t files) : entries_(files) {}

  // The bytes of file i, reading it (once) if it is not cached yet.
  std::shared_ptr<const std::vector<std::uint8_t>> get(std::size_t i, const std::string& path) {
    {
      std::lock_guard lk(mu_);
      if (entries_[i]) return entries_[i];
    }
    auto bytes = std::make_shared<std::vector<std::uint8_t>>();
    read_file(path, *bytes);
    std::lock_guard lk(mu_);
    if (!entries_[i]) {
      entries_[i] = bytes;
      bytes_ += bytes->size();
    }
    return entries_[i];
  }
  std::size_t bytes() const {
    std::lock_guard lk(mu_);
    return bytes_;
  }

  // The cache of `split_dir` with `files` files: shared while any pipeline holds it.
  static std::shared_ptr<file_cache> of(const std::string& split_dir, std::size_t files) {
    static std::mutex mu;
    static std::map<std::string, std::weak_ptr<file_cache>> caches;
    std::lock_guard lk(mu);
    std::error_code ec;
    const std::string key = std::filesystem::weakly_canonical(split_dir, ec).string() + "#" + std::to_string(files);
    if (auto c = caches[key].lock()) return c;
    auto c = std::make_shared<file_cache>(files);
    caches[key] = c;
    return c;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<const std::vector<std::uint8_t>>> entries_;
  std::size_t bytes_ = 0;
};

class image_pipeline {
 public:
  explicit image_pipeline(image_pipeline_options o) : o_(std::move(o)), norm_(normaliser::of(o_.mean, o_.stddev)) {
    if (o_.size < 1 || o_.batch < 1 || o_.replicas < 1 || o_.rank < 0 || o_.rank >= o_.replicas || o_.threads < 1 ||
        o_.prefetch < 1)
      throw std::invalid_argument("image_pipeline: size " + std::to_string(o_.size) + ", batch " + std::to_string(o_.batch) +
                                  ", rank " + std::to_string(o_.rank) + " of " + std::to_string(o_.replicas) + ", threads " +
                                  std::to_string(o_.threads) + ", prefetch " + std::to_string(o_.prefetch) +
                                  ": each must be >= 1 and rank < replicas");
    if (!(o_.crop_pct > 0 && o_.crop_pct <= 1))
      throw std::invalid_argument("image_pipeline: crop_pct " + std::to_string(o_.crop_pct) + " must be in (0, 1]");
    if (o_.synthetic) {
      if (o_.synthetic_classes < 1 || o_.synthetic_images < 1)
        throw std::invalid_argument("image_pipeline: synthetic mode needs classes and images >= 1");
      for (int k = 0; k < o_.synthetic_classes; ++k) {
        char name[32];
        std::snprintf(name, sizeof name, "synthetic_%04d", k);
        listing_.classes.push_back(name);
      }
      make_synthetic_pool();
    } else {
      const std::string split = o_.dir + (o_.train ? "/train" : "/val");
      std::vector<std::string> classes;
      std::error_code ec;
      if (!o_.train && std::filesystem::is_directory(o_.dir + "/train", ec)) classes = class_folders(o_.dir + "/train");
      listing_ = list_image_folder(split, classes);
      if (o_.cache) cache_ = file_cache::of(split, listing_.files.size());
      bad_ = std::make_unique<std::atomic<bool>[]>(listing_.files.size());
      for (std::size_t i = 0; i < listing_.files.size(); ++i) bad_[i] = false;
    }
    if (steps_per_epoch() < 1)
      throw data_error((o_.synthetic ? std::string("synthetic set") : o_.dir) + ": " + std::to_string(images()) +
                       " images are fewer than one global batch of " + std::to_string(o_.replicas) + " x " +
                       std::to_string(o_.batch));
    if (!o_.synthetic) {
      const std::size_t per_image = 3 * static_cast<std::size_t>(o_.size) * o_.size;
      slots_.resize(static_cast<std::size_t>(o_.prefetch));
      for (slot& s : slots_) {
        s.images.resize(static_cast<std::size_t>(o_.batch) * per_image);
        s.labels.resize(static_cast<std::size_t>(o_.batch));
      }
      for (int t = 0; t < o_.threads; ++t) workers_.emplace_back([this] { work(); });
    }
  }

  ~image_pipeline() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  image_pipeline(const image_pipeline&) = delete;
  image_pipeline& operator=(const image_pipeline&) = delete;

  int classes() const { return static_cast<int>(listing_.classes.size()); }
  const std::vector<std::string>& class_names() const { return listing_.classes; }
  std::size_t images() const { return o_.synthetic ? o_.synthetic_images : listing_.files.size(); }
  const std::vector<image_file>& files() const { return listing_.files; }

  // Global batches per epoch: train drops the last partial one, val pads it (label -1).
  std::size_t steps_per_epoch() const {
    const std::size_t global = static_cast<std::size_t>(o_.replicas) * static_cast<std::size_t>(o_.batch);
    return o_.train || o_.synthetic ? images() / global : (images() + global - 1) / global;
  }

  // Begins epoch `epoch`: its permutation (identity for val), and the workers start on its first
  // `prefetch` batches. May be called at any time; batches of the previous epoch not taken are dropped.
  void start_epoch(int epoch) {
    std::unique_lock lk(mu_);
    holding_ = false;
    active_ = false;  // workers take no new image while the state below changes
    if (!done_cv_.wait_for(lk, std::chrono::duration<double>(o_.timeout_s), [&] { return in_flight_ == 0; }))
      throw std::runtime_error("image_pipeline::start_epoch: " + std::to_string(in_flight_) + " images still being read after " +
                               std::to_string(o_.timeout_s) + " s (a file read stuck?)");
    epoch_ = epoch;
    taken_ = fill_step_ = 0;
    fill_k_ = 0;
    for (slot& s : slots_) {
      s.step = -1;
      s.done = 0;
      s.error = nullptr;
      s.error_k = o_.batch;
    }
    if (!o_.synthetic) {
      const int n = static_cast<int>(listing_.files.size());
      if (o_.train) perm_ = epoch_permutation(n, o_.seed, epoch);
      else if (perm_.size() != static_cast<std::size_t>(n)) {
        perm_.resize(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i) perm_[static_cast<std::size_t>(i)] = i;
      }
    }
    active_ = true;
    lk.unlock();
    work_cv_.notify_all();
  }

  // Fills images (batch, 3, size, size) (NHWC with channels_last) and labels (batch) with this
  // replica's next batch of the epoch. Returns false when the epoch is over. Rethrows a data_error
  // of a file in this batch.
  bool next(float* images, std::int32_t* labels) {
    batch_view v;
    if (!next_view(v)) return false;
    const std::size_t n = static_cast<std::size_t>(o_.batch) * 3 * o_.size * o_.size;
    std::memcpy(images, v.images, n * sizeof(float));
    std::memcpy(labels, v.labels, static_cast<std::size_t>(o_.batch) * sizeof(std::int32_t));
    release();  // the copy is made: the workers may refill the slot now
    return true;
  }

  // The next batch without the copy: `v` points into the pipeline's buffers and stays valid until
  // the next call of next(), next_view() or start_epoch() (its slot is not refilled before).
  struct batch_view {
    const float* images = nullptr;         // (batch, 3, size, size), or (batch, size, size, 3) with channels_last
    const std::int32_t* labels = nullptr;  // (batch)
  };
  bool next_view(batch_view& v) {
    release();
    std::unique_lock lk(mu_);
    if (!active_) throw std::logic_error("image_pipeline::next: call start_epoch first");
    if (taken_ >= static_cast<long long>(steps_per_epoch())) return false;
    if (o_.synthetic) {
      fill_synthetic_labels(taken_);
      v = {pool_.data(), synthetic_labels_.data()};
      holding_ = true;
      return true;
    }
    slot& s = slots_[static_cast<std::size_t>(taken_ % o_.prefetch)];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o_.timeout_s);
    if (!done_cv_.wait_until(lk, deadline, [&] { return s.step == taken_ && s.done == o_.batch; }))
      throw std::runtime_error("image_pipeline: no batch after " + std::to_string(o_.timeout_s) + " s (step " +
                               std::to_string(taken_) + " of epoch " + std::to_string(epoch_) + "; a file read stuck?)");
    if (s.error) std::rethrow_exception(s.error);
    v = {s.images.data(), s.labels.data()};
    holding_ = true;
    return true;
  }

  std::size_t skipped() const { return skipped_.load(); }
  // Bytes held by the cache (0 without one).
  std::size_t cached_bytes() const { return cache_ ? cache_->bytes() : 0; }

 private:
  struct slot {
    std::vector<float> images;         // (batch, 3, size, size)
    std::vector<std::int32_t> labels;  // (batch)
    long long step = -1;               // the step it holds (or is being filled with)
    int done = 0;                      // images finished
    std::exception_ptr error;          // the error of the lowest image index that failed
    int error_k = 0;
  };

  // A worker: takes the next image of the earliest step not yet handed out, within `prefetch`
  // steps of the one next() waits for, and prepares it into its slot.
  void work() {
    jpeg_decoder dec;
    dec.scales = o_.scales;
    dec.channels_last = o_.channels_last;
    std::vector<std::uint8_t> buf;
    const std::size_t per_image = 3 * static_cast<std::size_t>(o_.size) * o_.size;
    std::unique_lock lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] {
        return stop_ || (active_ && fill_step_ < static_cast<long long>(steps_per_epoch()) && fill_step_ < taken_ + o_.prefetch);
      });
      if (stop_) return;
      const long long step = fill_step_;
      const int k = fill_k_;
      slot& s = slots_[static_cast<std::size_t>(step % o_.prefetch)];
      if (k == 0) {  // the slot's previous step was taken (fill_step_ < taken_ + prefetch)
        s.step = step;
        s.done = 0;
        s.error = nullptr;
        s.error_k = o_.batch;
      }
      if (++fill_k_ == o_.batch) {
        fill_k_ = 0;
        ++fill_step_;
      }
      ++in_flight_;
      const int epoch = epoch_;
      lk.unlock();
      std::exception_ptr err;
      try {
        prepare(epoch, step, k, s.images.data() + static_cast<std::size_t>(k) * per_image, &s.labels[static_cast<std::size_t>(k)],
                dec, buf);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      --in_flight_;
      if (err && k < s.error_k) {
        s.error = err;
        s.error_k = k;
      }
      if (++s.done == o_.batch || in_flight_ == 0) done_cv_.notify_all();
    }
  }

  // Image k of this replica's batch `step`: position p of the permutation.
  void prepare(int epoch, long long step, int k, float* out, std::int32_t* label, jpeg_decoder& dec,
               std::vector<std::uint8_t>& buf) {
    const std::size_t n = listing_.files.size();
    const std::size_t p = static_cast<std::size_t>((step * o_.replicas + o_.rank) * o_.batch + k);
    if (p >= n) {  // val padding
      std::fill(out, out + 3 * static_cast<std::size_t>(o_.size) * o_.size, 0.0f);
      *label = -1;
      return;
    }
    const std::uint64_t key = key_of(o_.seed, static_cast<std::uint64_t>(epoch) + 1, p);
    for (std::size_t attempt = 0; attempt < n; ++attempt) {
      const std::size_t i = static_cast<std::size_t>(perm_[(p + attempt) % n]);
      if (bad_[i]) continue;  // only ever set with skip_bad
      try {
        decode_file(i, attempt == 0 ? key : key_of(key, attempt), dec, buf, out);
        *label = listing_.files[i].label;
        return;
      } catch (const data_error& e) {
        if (!o_.skip_bad) throw;
        if (!bad_[i].exchange(true)) {
          ++skipped_;
          std::fprintf(stderr, "skipped (--skip-bad-images): %s\n", e.what());  // once a file, naming it
        }
      }
    }
    throw data_error(o_.dir + (o_.train ? "/train" : "/val") + ": every file is bad (" + std::to_string(skipped()) + " skipped)");
  }

  void decode_file(std::size_t i, std::uint64_t key, jpeg_decoder& dec, std::vector<std::uint8_t>& buf, float* out) {
    const std::string& path = listing_.files[i].path;
    std::shared_ptr<const std::vector<std::uint8_t>> cached;
    const std::vector<std::uint8_t>* bytes = &buf;
    if (cache_) {
      cached = cache_->get(i, path);
      bytes = cached.get();
    } else {
      read_file(path, buf);
    }
    const bool train = o_.train;
    const image_pipeline_options& o = o_;
    dec.decode(bytes->data(), bytes->size(), path,
               [&](const jpeg_header& h) {
                 crop_plan plan;
                 if (train) {
                   rng g{key};
                   plan.rect = random_resized_crop(h.width, h.height, g, o.scale_min, o.scale_max, o.ratio_min, o.ratio_max);
                   plan.flip = (g.next() & 1) != 0;
                 } else {
                   plan.rect = centre_crop(h.width, h.height, o.crop_pct);
                 }
                 return plan;
               },
               o_.size, norm_, out);
  }

  void make_synthetic_pool() {
    const std::size_t per_image = 3 * static_cast<std::size_t>(o_.size) * o_.size;
    pool_.resize(static_cast<std::size_t>(o_.batch) * per_image);
    rng g{key_of(o_.seed, 0x53594E54ull)};
    const std::size_t plane = per_image / 3;
    for (std::size_t j = 0; j < pool_.size(); ++j) {
      const std::size_t c = o_.channels_last ? j % 3 : (j / plane) % 3;
      pool_[j] = static_cast<float>(g.next() & 255) * norm_.mul[c] + norm_.add[c];
    }
  }

  void fill_synthetic_labels(long long step) {
    synthetic_labels_.resize(static_cast<std::size_t>(o_.batch));
    for (int k = 0; k < o_.batch; ++k) {
      const std::size_t p = static_cast<std::size_t>((step * o_.replicas + o_.rank) * o_.batch + k);
      rng g{key_of(o_.seed, static_cast<std::uint64_t>(epoch_) + 1, p)};
      synthetic_labels_[static_cast<std::size_t>(k)] = g.below(o_.synthetic_classes);
    }
  }

  // The batch handed out last is done with: its slot may be refilled.
  void release() {
    {
      std::lock_guard lk(mu_);
      if (!holding_) return;
      holding_ = false;
      ++taken_;
    }
    work_cv_.notify_all();
  }

  const image_pipeline_options o_;
  const normaliser norm_;
  image_listing listing_;
  std::shared_ptr<file_cache> cache_;
  std::unique_ptr<std::atomic<bool>[]> bad_;
  std::atomic<std::size_t> skipped_{0};
  std::vector<float> pool_;  // synthetic images (batch, 3, size, size)
  std::vector<std::int32_t> synthetic_labels_;  // (batch)

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<int> perm_;
  std::vector<slot> slots_;
  int epoch_ = 0;
  bool active_ = false, stop_ = false;
  long long taken_ = 0;      // steps next() has handed out and released in this epoch
  bool holding_ = false;     // step taken_ is handed out (a view) and not yet released
  long long fill_step_ = 0;  // the step whose images workers take now
  int fill_k_ = 0;           // and its next image
  int in_flight_ = 0;        // images being prepared
  std::vector<std::thread> workers_;
};

}  // namespace sample
