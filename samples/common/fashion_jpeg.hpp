// samples/common/fashion_jpeg.hpp: writes Fashion-MNIST as an ImageNet-layout JPEG folder.
//
// Purpose: real JPEG files of a known task for the ImageNet input pipeline (image_folder.hpp) and
// the ResNet-50 sample, on a machine without ImageNet:
//   OUT/train/<k>_<name>/fashion_train_<index>.JPEG   (from train-*-idx*-ubyte.gz, 60,000 images)
//   OUT/val/<k>_<name>/fashion_val_<index>.JPEG       (from t10k-*, 10,000 images)
// Class folders are "0_tshirt_top" ... "9_ankle_boot", so sorting them by name (ImageFolder's rule)
// gives back Fashion-MNIST's labels. Each 28x28 gray image is upscaled (bilinear between pixel
// centres) to width x height and written as a 3-component (RGB, R = G = B) JPEG at `quality`, so a
// decoder does the colour work of a real photograph; `limit` keeps the first N images of each
// class per split.
// Limits: the upscaled images are smooth, so their files are smaller (6-17 KB, 10 KB on average at
// 400x350, quality 90) than ImageNet's photographs (about 110 KB) and their entropy decoding is cheaper.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "data_error.hpp"
#include "idx.hpp"
#include "jpeg_encode.hpp"

namespace sample {

inline constexpr std::array<const char*, 10> fashion_class_folders = {
    "0_tshirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat",
    "5_sandal",     "6_shirt",   "7_sneaker",  "8_bag",   "9_ankle_boot"};

struct fashion_jpeg_options {
  std::string source = default_fashion_mnist_dir;  // the IDX files
  std::string out;                                 // the folder to write (created; must be empty or new)
  int width = 400, height = 350;
  int quality = 90;
  int limit = 0;        // images per class and split (0: all)
  int threads = 1;
  bool progressive = false;
  bool overwrite = false;  // allow a non-empty `out`
};

// (height, width, 3) bytes: the 28x28 gray image upscaled, gray replicated into R, G, B.
inline void upscale_gray(const std::uint8_t* img, int rows, int cols, int width, int height, std::uint8_t* rgb) {
  for (int y = 0; y < height; ++y) {
    const double sy = std::clamp((y + 0.5) * rows / height - 0.5, 0.0, rows - 1.0);
    const int y0 = static_cast<int>(sy), y1 = std::min(y0 + 1, rows - 1);
    const double fy = sy - y0;
    for (int x = 0; x < width; ++x) {
      const double sx = std::clamp((x + 0.5) * cols / width - 0.5, 0.0, cols - 1.0);
      const int x0 = static_cast<int>(sx), x1 = std::min(x0 + 1, cols - 1);
      const double fx = sx - x0;
      const double top = img[y0 * cols + x0] + fx * (img[y0 * cols + x1] - img[y0 * cols + x0]);
      const double bot = img[y1 * cols + x0] + fx * (img[y1 * cols + x1] - img[y1 * cols + x0]);
      const auto v = static_cast<std::uint8_t>(std::lround(top + fy * (bot - top)));
      std::uint8_t* p = rgb + (static_cast<std::size_t>(y) * width + x) * 3;
      p[0] = p[1] = p[2] = v;
    }
  }
}

// Writes the folder; returns the number of files written (train + val).
inline std::size_t write_fashion_jpeg_folder(const fashion_jpeg_options& o) {
  namespace fs = std::filesystem;
  if (o.out.empty()) throw std::invalid_argument("write_fashion_jpeg_folder: no output folder");
  if (o.width < 1 || o.height < 1 || o.quality < 1 || o.quality > 100 || o.limit < 0 || o.threads < 1)
    throw std::invalid_argument("write_fashion_jpeg_folder: size " + std::to_string(o.width) + "x" + std::to_string(o.height) +
                                ", quality " + std::to_string(o.quality) + " (1..100), limit " + std::to_string(o.limit) +
                                ", threads " + std::to_string(o.threads));
  std::error_code ec;
  if (fs::exists(o.out, ec) && !fs::is_empty(o.out, ec) && !o.overwrite)
    throw data_error(o.out + ": exists and is not empty (lockstep-fashion-to-jpeg --overwrite writes into it)");
  std::size_t written = 0;
  for (const auto& [prefix, split] : {std::pair{"train", "train"}, std::pair{"t10k", "val"}}) {
    const image_set set = load_idx_pair(o.source, prefix, 10);
    std::vector<int> chosen;
    std::array<int, 10> per_class{};
    for (int i = 0; i < set.n; ++i) {
      const int c = set.labels[static_cast<std::size_t>(i)];
      if (o.limit == 0 || per_class[static_cast<std::size_t>(c)] < o.limit) {
        ++per_class[static_cast<std::size_t>(c)];
        chosen.push_back(i);
      }
    }
    for (const char* c : fashion_class_folders) {
      fs::create_directories(fs::path(o.out) / split / c, ec);
      if (ec) throw data_error(o.out + ": cannot create " + split + "/" + c + " (" + ec.message() + ")");
    }
    std::atomic<std::size_t> next{0};
    std::vector<std::string> errors(static_cast<std::size_t>(o.threads));
    auto work = [&](int t) {
      std::vector<std::uint8_t> rgb(static_cast<std::size_t>(o.width) * o.height * 3);
      jpeg_encode_options e;
      e.quality = o.quality;
      e.progressive = o.progressive;
      try {
        for (std::size_t j; (j = next++) < chosen.size();) {
          const int i = chosen[j];
          upscale_gray(set.pixels.data() + static_cast<std::size_t>(i) * set.rows * set.cols, set.rows, set.cols, o.width,
                       o.height, rgb.data());
          const std::vector<std::uint8_t> jpg = encode_jpeg(rgb.data(), o.width, o.height, 3, e);
          char name[64];
          std::snprintf(name, sizeof name, "fashion_%s_%05d.JPEG", split, i);
          const fs::path path = fs::path(o.out) / split / fashion_class_folders[set.labels[static_cast<std::size_t>(i)]] / name;
          std::FILE* f = std::fopen(path.c_str(), "wb");
          if (!f || std::fwrite(jpg.data(), 1, jpg.size(), f) != jpg.size() || std::fclose(f) != 0)
            throw data_error(path.string() + ": cannot write");
        }
      } catch (const std::exception& x) {
        errors[static_cast<std::size_t>(t)] = x.what();
        next = chosen.size();
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < o.threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto& t : pool) t.join();
    for (const auto& e : errors)
      if (!e.empty()) throw data_error(e);
    written += chosen.size();
  }
  return written;
}

}  // namespace sample
