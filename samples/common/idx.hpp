// samples/common/idx.hpp: reads the IDX files of MNIST-style data sets (Fashion-MNIST), gzip or not.
//
// Purpose: load a whole image set and its labels into memory once, decoded to bytes, and fail with
// a message a user can act on: every error names the file and says what is wrong with it.
// Limits: unsigned-byte IDX only (magic 0x00000801 for labels, 0x00000803 for images), which is
// what MNIST and Fashion-MNIST ship; zlib reads plain files transparently, so an uncompressed
// .idx file works too. The whole set is held in memory (Fashion-MNIST: 47 MB train, 8 MB test).
//
// IDX layout (big-endian):  magic u32 | dim[0] u32 | ... | dim[ndim-1] u32 | data u8[prod(dim)]
//   magic = 0x00000800 | ndim; byte 2 = 0x08 is the element type "unsigned byte".
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "data_error.hpp"

namespace sample {

// One decoded IDX file: dims as in the header, data row-major.
struct idx_array {
  std::vector<std::uint32_t> dims;
  std::vector<std::uint8_t> data;
};

// Reads exactly n bytes or says why not. Returns bytes read (< n only at end of file).
inline std::size_t gz_read_all(gzFile f, void* out, std::size_t n, const std::string& path) {
  std::size_t got = 0;
  auto* p = static_cast<unsigned char*>(out);
  while (got < n) {
    // gzread takes an unsigned count; read in 1 GiB pieces so large files cannot overflow it.
    const unsigned want = static_cast<unsigned>(std::min<std::size_t>(n - got, 1u << 30));
    const int r = gzread(f, p + got, want);
    if (r < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      throw data_error(path + ": corrupt gzip data (" + std::string(msg ? msg : "zlib error") + ")");
    }
    if (r == 0) {
      // zlib reports a stream cut short as Z_BUF_ERROR after the last bytes it could inflate.
      int code = 0;
      const char* msg = gzerror(f, &code);
      if (code != Z_OK && code != Z_BUF_ERROR)
        throw data_error(path + ": corrupt gzip data (" + std::string(msg ? msg : "zlib error") + ")");
      break;
    }
    got += static_cast<std::size_t>(r);
  }
  return got;
}

// Reads one IDX file of unsigned bytes with `expect_ndim` dimensions.
inline idx_array read_idx(const std::string& path, int expect_ndim) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw data_error(path + ": missing (no such file)");
  if (fs::is_directory(path, ec)) throw data_error(path + ": is a directory, expected an IDX file");

  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw data_error(path + ": cannot open (" + std::strerror(errno) + ")");
  struct closer { gzFile f; ~closer() { gzclose(f); } } close_on_exit{f};

  unsigned char magic[4];
  if (gz_read_all(f, magic, 4, path) != 4) throw data_error(path + ": truncated (shorter than the 4-byte IDX magic)");
  const std::uint32_t m = (std::uint32_t{magic[0]} << 24) | (std::uint32_t{magic[1]} << 16) |
                          (std::uint32_t{magic[2]} << 8) | magic[3];
  const std::uint32_t expect = 0x00000800u | static_cast<std::uint32_t>(expect_ndim);
  if (m != expect) {
    char buf[96];
    std::snprintf(buf, sizeof buf, ": bad magic 0x%08X, expected 0x%08X (unsigned bytes, %d dimensions)",
                  m, expect, expect_ndim);
    throw data_error(path + buf);
  }

  idx_array a;
  a.dims.resize(static_cast<std::size_t>(expect_ndim));
  // The product of the dimensions without wrapping (in 64 bits 2^22 x 2^21 x 2^21 would claim 0
  // bytes): past the cap it is only remembered as too large, and any zero dimension makes it 0.
  constexpr std::size_t cap = std::size_t{1} << 34;
  std::size_t total = 1;
  bool zero = false, too_large = false;
  for (auto& d : a.dims) {
    unsigned char b[4];
    if (gz_read_all(f, b, 4, path) != 4) throw data_error(path + ": truncated in the header (dimension sizes)");
    d = (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | b[3];
    if (d == 0) zero = true;
    else if (total > cap / d) too_large = true;
    else total *= d;
  }
  if (zero) total = 0;
  else if (too_large) throw data_error(path + ": header claims an implausible size");

  // Read in pieces of 1 MiB appended as they arrive, so that a header claiming more than the file
  // holds costs what the file holds, never the claimed size up front.
  std::vector<unsigned char> piece(std::min<std::size_t>(total, std::size_t{1} << 20));
  std::size_t got = 0;
  while (got < total) {
    const std::size_t want = std::min(total - got, piece.size());
    const std::size_t n = gz_read_all(f, piece.data(), want, path);
    a.data.insert(a.data.end(), piece.begin(), piece.begin() + static_cast<std::ptrdiff_t>(n));
    got += n;
    if (n < want) break;
  }
  if (got != total)
    throw data_error(path + ": truncated: the header promises " + std::to_string(total) +
                     " data bytes, the file holds " + std::to_string(got));
  unsigned char extra;
  if (gz_read_all(f, &extra, 1, path) != 0)
    throw data_error(path + ": trailing bytes after the " + std::to_string(total) + " data bytes the header promises");
  return a;
}

// An image set with its labels, as stored: pixels 0..255, labels 0..classes-1.
struct image_set {
  int n = 0, rows = 0, cols = 0;
  std::vector<std::uint8_t> pixels;  // (n, rows, cols)
  std::vector<std::uint8_t> labels;  // (n)
};

// Loads "<dir>/<prefix>-images-idx3-ubyte.gz" and "<dir>/<prefix>-labels-idx1-ubyte.gz"
// (prefix "train" or "t10k") and checks that they agree.
inline image_set load_idx_pair(const std::string& dir, const std::string& prefix, int classes = 10) {
  const std::string img_path = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string lbl_path = dir + "/" + prefix + "-labels-idx1-ubyte.gz";
  idx_array img = read_idx(img_path, 3);
  idx_array lbl = read_idx(lbl_path, 1);
  if (img.dims[0] != lbl.dims[0])
    throw data_error(lbl_path + ": count mismatch: " + std::to_string(lbl.dims[0]) + " labels for " +
                     std::to_string(img.dims[0]) + " images in " + img_path);
  if (img.dims[0] == 0) throw data_error(img_path + ": holds no images");
  for (const std::uint32_t d : img.dims)  // counts and sides are ints from here on
    if (d > static_cast<std::uint32_t>(std::numeric_limits<int>::max()))
      throw data_error(img_path + ": header claims a dimension of " + std::to_string(d) + ", over " +
                       std::to_string(std::numeric_limits<int>::max()));
  for (std::size_t i = 0; i < lbl.data.size(); ++i)
    if (lbl.data[i] >= classes)
      throw data_error(lbl_path + ": label " + std::to_string(lbl.data[i]) + " of item " + std::to_string(i) +
                       " is outside 0.." + std::to_string(classes - 1));
  image_set s;
  s.n = static_cast<int>(img.dims[0]);
  s.rows = static_cast<int>(img.dims[1]);
  s.cols = static_cast<int>(img.dims[2]);
  s.pixels = std::move(img.data);
  s.labels = std::move(lbl.data);
  return s;
}

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* default_fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";

}  // namespace sample
