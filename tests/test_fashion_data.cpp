// The sample trainers' data loading (samples/common): IDX files, good and broken, and the input
// pipeline's sharding, determinism and augmentation.
//
// Broken files are written here with zlib, one defect each, and every error must name the file
// and the defect, as samples/common/idx.hpp documents.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "../samples/common/pipeline.hpp"

namespace fs = std::filesystem;

namespace {

std::vector<unsigned char> be32(std::uint32_t v) {
  return {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16), static_cast<unsigned char>(v >> 8),
          static_cast<unsigned char>(v)};
}

// An IDX file as bytes: magic, dims, then `data_bytes` bytes of data (may disagree with dims).
std::vector<unsigned char> idx_bytes(std::uint32_t magic, std::vector<std::uint32_t> dims, std::size_t data_bytes,
                                     unsigned char fill = 0) {
  std::vector<unsigned char> b = be32(magic);
  for (auto d : dims) {
    auto e = be32(d);
    b.insert(b.end(), e.begin(), e.end());
  }
  for (std::size_t i = 0; i < data_bytes; ++i) b.push_back(static_cast<unsigned char>(fill + i % 7));
  return b;
}

void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  gzclose(f);
}

struct temp_dir {
  std::string path;
  temp_dir() {
    path = (fs::temp_directory_path() / ("lockstep-idx-" + std::to_string(::getpid()))).string();
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};

// A valid pair of n images of 4x4 with labels i % 10.
void write_pair(const std::string& dir, const std::string& prefix, std::uint32_t n) {
  write_gz(dir + "/" + prefix + "-images-idx3-ubyte.gz", idx_bytes(0x803, {n, 4, 4}, n * 16));
  std::vector<unsigned char> lbl = idx_bytes(0x801, {n}, 0);
  for (std::uint32_t i = 0; i < n; ++i) lbl.push_back(static_cast<unsigned char>(i % 10));
  write_gz(dir + "/" + prefix + "-labels-idx1-ubyte.gz", lbl);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const sample::data_error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("a valid IDX pair loads with the header's shape", "[data][idx]") {
  temp_dir t;
  write_pair(t.path, "train", 12);
  const sample::image_set s = sample::load_idx_pair(t.path, "train");
  CHECK(s.n == 12);
  CHECK(s.rows == 4);
  CHECK(s.cols == 4);
  CHECK(s.pixels.size() == 12 * 16);
  CHECK(s.labels[11] == 1);
  CHECK(s.pixels[8] == 8 % 7);
}

TEST_CASE("broken IDX files give errors naming the file and the defect", "[data][idx]") {
  temp_dir t;
  const std::string img = t.path + "/train-images-idx3-ubyte.gz", lbl = t.path + "/train-labels-idx1-ubyte.gz";
  auto load = [&] { sample::load_idx_pair(t.path, "train"); };

  SECTION("missing") {
    const std::string e = error_of(load);
    CHECK(e == img + ": missing (no such file)");
  }
  SECTION("bad magic") {
    write_pair(t.path, "train", 5);
    write_gz(img, idx_bytes(0x801, {5, 4, 4}, 80));  // a label file's magic
    const std::string e = error_of(load);
    CHECK(e.find(img) == 0);
    CHECK(e.find("bad magic 0x00000801, expected 0x00000803") != std::string::npos);
  }
  SECTION("truncated data") {
    write_pair(t.path, "train", 5);
    write_gz(img, idx_bytes(0x803, {5, 4, 4}, 70));
    const std::string e = error_of(load);
    CHECK(e == img + ": truncated: the header promises 80 data bytes, the file holds 70");
  }
  SECTION("truncated header") {
    write_pair(t.path, "train", 5);
    write_gz(img, {0, 0, 8, 3, 0, 0});
    CHECK(error_of(load) == img + ": truncated in the header (dimension sizes)");
  }
  SECTION("empty file") {
    write_pair(t.path, "train", 5);
    write_gz(img, {});
    CHECK(error_of(load) == img + ": truncated (shorter than the 4-byte IDX magic)");
  }
  SECTION("a gzip stream cut short") {
    write_pair(t.path, "train", 200);
    std::ifstream in(img, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    in.close();
    bytes.resize(bytes.size() / 2);
    std::ofstream(img, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    const std::string e = error_of(load);
    CHECK(e.find(img + ": ") == 0);
    CHECK((e.find("truncated") != std::string::npos || e.find("corrupt gzip") != std::string::npos));
  }
  SECTION("corrupt gzip data") {
    write_pair(t.path, "train", 200);
    std::fstream f(img, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(20);
    const char junk[16] = {'\x55', '\x12', '\x7f', '\x00', '\x33', '\x66', '\x10', '\x01',
                           '\x55', '\x12', '\x7f', '\x00', '\x33', '\x66', '\x10', '\x01'};
    f.write(junk, sizeof junk);
    f.close();
    const std::string e = error_of(load);
    CHECK(e.find(img + ": ") == 0);
    CHECK((e.find("corrupt gzip") != std::string::npos || e.find("truncated") != std::string::npos));
  }
  SECTION("trailing bytes") {
    write_pair(t.path, "train", 5);
    write_gz(img, idx_bytes(0x803, {5, 4, 4}, 81));
    CHECK(error_of(load) == img + ": trailing bytes after the 80 data bytes the header promises");
  }
  SECTION("count mismatch") {
    write_pair(t.path, "train", 5);
    write_gz(lbl, idx_bytes(0x801, {4}, 4));
    CHECK(error_of(load) == lbl + ": count mismatch: 4 labels for 5 images in " + img);
  }
  SECTION("label out of range") {
    write_pair(t.path, "train", 5);
    write_gz(lbl, {0, 0, 8, 1, 0, 0, 0, 5, 3, 10, 1, 2, 3});
    CHECK(error_of(load) == lbl + ": label 10 of item 1 is outside 0..9");
  }
}

TEST_CASE("Debian's Fashion-MNIST, where installed, has 60000 + 10000 images of 28x28", "[data][idx]") {
  if (!fs::exists(std::string(sample::default_fashion_mnist_dir) + "/train-images-idx3-ubyte.gz")) {
    WARN("dataset-fashion-mnist is not installed; run scripts/setup");
    return;
  }
  const auto train = sample::load_idx_pair(sample::default_fashion_mnist_dir, "train");
  const auto test = sample::load_idx_pair(sample::default_fashion_mnist_dir, "t10k");
  CHECK(train.n == 60000);
  CHECK(test.n == 10000);
  CHECK(train.rows == 28);
  CHECK(train.cols == 28);
}

namespace {
sample::image_set synthetic_set(int n) {
  sample::image_set s;
  s.n = n, s.rows = 6, s.cols = 5;
  s.pixels.resize(static_cast<std::size_t>(n) * 30);
  s.labels.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    for (int p = 0; p < 30; ++p) s.pixels[static_cast<std::size_t>(i) * 30 + p] = static_cast<std::uint8_t>((i * 31 + p * 7) % 256);
    s.labels[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i % 10);
  }
  return s;
}
}  // namespace

TEST_CASE("epoch permutations are permutations, differ by epoch, repeat by seed", "[data][pipeline]") {
  const auto a = sample::epoch_permutation(1000, 7, 0), b = sample::epoch_permutation(1000, 7, 1);
  CHECK(a == sample::epoch_permutation(1000, 7, 0));
  CHECK(a != b);
  std::vector<int> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 1000; ++i) REQUIRE(sorted[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("four replicas' shards of a step are the one replica's global batch", "[data][pipeline]") {
  const auto set = synthetic_set(103);  // 103 / 24 = 4 steps, 7 images dropped per epoch
  const sample::augment_options aug;     // augmented: the draws must follow the image, not the replica
  sample::batch_loader one(set, 24, 0, 1, 5, aug, 0);
  std::vector<std::unique_ptr<sample::batch_loader>> four;
  for (int r = 0; r < 4; ++r) four.push_back(std::make_unique<sample::batch_loader>(set, 6, r, 4, 5, aug, 0));
  CHECK(one.steps_per_epoch() == 4);
  for (int step = 0; step < 10; ++step) {  // across two epoch boundaries
    const sample::batch& g = one.next();
    for (int r = 0; r < 4; ++r) {
      const sample::batch& s = four[static_cast<std::size_t>(r)]->next();
      REQUIRE(s.epoch == g.epoch);
      REQUIRE(s.step == g.step);
      for (int k = 0; k < 6; ++k) REQUIRE(s.labels[static_cast<std::size_t>(k)] == g.labels[static_cast<std::size_t>(r * 6 + k)]);
      REQUIRE(std::equal(s.images.begin(), s.images.end(), g.images.begin() + r * 6 * 30));
    }
  }
}

TEST_CASE("a loader started at epoch e yields what an uninterrupted one yields there", "[data][pipeline]") {
  const auto set = synthetic_set(50);
  sample::batch_loader full(set, 10, 0, 1, 9, {}, 0);
  for (int i = 0; i < 5; ++i) full.next();  // epoch 0
  sample::batch_loader resumed(set, 10, 0, 1, 9, {}, 1);
  for (int i = 0; i < 5; ++i) {
    const sample::batch &a = full.next(), &b = resumed.next();
    REQUIRE(a.epoch == 1);
    REQUIRE(a.images == b.images);
    REQUIRE(a.labels == b.labels);
  }
}

TEST_CASE("augmentation: crops shift within 2 pixels, flips mirror, padding is black", "[data][pipeline]") {
  const auto set = synthetic_set(1);
  const int H = 6, W = 5;
  std::vector<float> plain(30), aug(30);
  sample::prepare_image(plain.data(), set, 0, {false, 2, true}, 0);
  const float black = -sample::pixel_mean / sample::pixel_std;
  CHECK(plain[7] == Approx(set.pixels[7] / (255.0f * sample::pixel_std) + black));
  std::set<std::pair<int, int>> shifts;
  int flips = 0;
  for (std::uint64_t key = 0; key < 400; ++key) {
    sample::prepare_image(aug.data(), set, 0, {true, 2, true}, key);
    // Find the (flip, dy, dx) that explains the output exactly: there must be one.
    bool found = false;
    for (int f = 0; f < 2 && !found; ++f)
      for (int dy = -2; dy <= 2 && !found; ++dy)
        for (int dx = -2; dx <= 2 && !found; ++dx) {
          bool ok = true;
          for (int y = 0; y < H && ok; ++y)
            for (int x = 0; x < W && ok; ++x) {
              const int sy = y + dy, sx = (f ? W - 1 - x : x) + dx;
              const float want = (sy >= 0 && sy < H && sx >= 0 && sx < W) ? plain[sy * W + sx] : black;
              ok = aug[y * W + x] == want;
            }
          if (ok) found = true, shifts.insert({dy, dx}), flips += f;
        }
    REQUIRE(found);
  }
  CHECK(shifts.size() == 25);  // every shift in [-2, 2]^2 occurs
  CHECK(flips > 120);          // about half of 400
  CHECK(flips < 280);
}
