// What the Fashion trainer's tests (test_fashion_train.cpp, test_fashion_hybrid.cpp) share: a
// synthetic data set written as gzipped IDX files, the checkpoint a run left, and the comparisons
// of its arrays. A class is a bright bar at a class-dependent place, plus noise, so small models
// learn it in a few steps and no test depends on the installed Fashion-MNIST.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "../samples/fashion_cnn/trainer.hpp"

namespace fashion_test {

inline void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb1");
  REQUIRE(f);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  gzclose(f);
}

inline std::vector<unsigned char> idx_header(std::uint32_t magic, std::vector<std::uint32_t> dims) {
  std::vector<unsigned char> b;
  auto put = [&](std::uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<unsigned char>(v >> s));
  };
  put(magic);
  for (auto d : dims) put(d);
  return b;
}

// n images of 28x28: class c is a horizontal bar (c even) or vertical bar (c odd) at offset 4 + 2c/2.
inline void write_synthetic(const std::string& dir, const std::string& prefix, int n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_int_distribution<int> noise(0, 60);
  auto img = idx_header(0x803, {static_cast<std::uint32_t>(n), 28, 28});
  auto lbl = idx_header(0x801, {static_cast<std::uint32_t>(n)});
  for (int i = 0; i < n; ++i) {
    const int c = static_cast<int>(g() % 10), at = 4 + 4 * (c / 2);
    for (int y = 0; y < 28; ++y)
      for (int x = 0; x < 28; ++x) {
        const bool bar = (c % 2 == 0) ? (y >= at && y < at + 3) : (x >= at && x < at + 3);
        img.push_back(static_cast<unsigned char>(std::min(255, noise(g) + (bar ? 180 : 0))));
      }
    lbl.push_back(static_cast<unsigned char>(c));
  }
  write_gz(dir + "/" + prefix + "-images-idx3-ubyte.gz", img);
  write_gz(dir + "/" + prefix + "-labels-idx1-ubyte.gz", lbl);
}

// A temporary directory with `train` training and `test` test images, removed at exit. `name`
// keeps the test programs' directories apart when they run at once.
struct synthetic_data {
  std::string dir;
  synthetic_data(const std::string& name, int train, int test) {
    dir = (std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir);
    write_synthetic(dir, "train", train, 1);
    write_synthetic(dir, "t10k", test, 2);
  }
  ~synthetic_data() { std::filesystem::remove_all(dir); }
  synthetic_data(const synthetic_data&) = delete;
  synthetic_data& operator=(const synthetic_data&) = delete;
};

// The checkpoint a run with these flags left in its --out.
inline fashion::checkpoint final_state(const fashion::options& o) {
  return fashion::load_checkpoint(o.out + "/checkpoint.bin", o);
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}
inline double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float v : a) m = std::max(m, static_cast<double>(std::fabs(v)));
  return m;
}
inline double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

}  // namespace fashion_test
