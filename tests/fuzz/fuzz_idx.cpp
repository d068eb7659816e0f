// tests/fuzz/fuzz_idx.cpp: sample::read_idx (samples/common/idx.hpp) on files written from the input.
//
// Input: [flags u8][content ...]. flags bit 0: the file is the content gzip-compressed (bits 5..7
// cut 0..7 bytes off the end of the gzip stream, a download cut short), else the content itself
// (which may start with a gzip header: zlib then inflates whatever follows); bits 1..2: the
// dimensions asked for, 1..4 (the trainer asks 1 for labels, 3 for images).
//
// The oracle reads the same file through zlib as the reader does and decides from the bytes what
// read_idx must do: throw a data_error whose message starts with the path (corrupt stream, short
// file, wrong magic, a size over 2^34, fewer or more data bytes than the dimensions promise), or
// return exactly those dimensions and those data bytes. Any other exception is a failure too.
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/idx.hpp"

namespace {

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_idx: %s %s\n", what, detail.c_str());
  std::abort();
}

const std::string& path() {
  static const std::string p = [] {
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    return std::string(dir) + "/lockstep-fuzz-idx-" + std::to_string(getpid()) + ".gz";
  }();
  return p;
}

void write_file(const std::vector<std::uint8_t>& bytes) {
  FILE* f = std::fopen(path().c_str(), "wb");
  // Registered after path() is made, so it runs before path()'s string is destroyed; libFuzzer ends
  // a run with exit().
  static const int removed_at_exit = std::atexit([] { std::remove(path().c_str()); });
  (void)removed_at_exit;
  if (!f || (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) || std::fclose(f) != 0)
    fail("cannot write", path());
}

std::vector<std::uint8_t> gzip(const std::uint8_t* p, std::size_t n, int level) {
  z_stream z{};
  if (deflateInit2(&z, level, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) fail("deflateInit2");
  std::vector<std::uint8_t> out(deflateBound(&z, n) + 32);
  z.next_in = const_cast<Bytef*>(p);
  z.avail_in = static_cast<uInt>(n);
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  if (deflate(&z, Z_FINISH) != Z_STREAM_END) fail("deflate");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// What zlib yields from the file, read as read_idx reads it: an error is one, a stream cut short
// ends the bytes (gz_read_all's rule). At most `cap` bytes.
struct contents {
  std::vector<std::uint8_t> bytes;
  bool corrupt = false;
};
contents inflate_file(std::size_t cap) {
  contents c;
  gzFile f = gzopen(path().c_str(), "rb");
  if (!f) fail("gzopen");
  std::uint8_t buf[4096];
  while (c.bytes.size() < cap) {
    const int r = gzread(f, buf, sizeof buf);
    int code = 0;
    if (r < 0) { c.corrupt = true; break; }
    if (r == 0) {
      gzerror(f, &code);
      c.corrupt = code != Z_OK && code != Z_BUF_ERROR;
      break;
    }
    c.bytes.insert(c.bytes.end(), buf, buf + r);
  }
  gzclose(f);
  return c;
}

std::uint32_t be32(const std::uint8_t* p) { return std::uint32_t{p[0]} << 24 | std::uint32_t{p[1]} << 16 | std::uint32_t{p[2]} << 8 | p[3]; }

// The file is corrupt, shorter than its header or of another magic: no size is read.
bool must_throw_early(const contents& c, std::size_t header, int ndim) {
  return c.corrupt || c.bytes.size() < header || be32(c.bytes.data()) != (0x800u | static_cast<unsigned>(ndim));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t flags = data[0];
  const int ndim = 1 + ((flags >> 1) & 3);
  std::vector<std::uint8_t> file;
  if (flags & 1) {
    file = gzip(data + 1, size - 1, (flags >> 3) & 3 ? 9 : 1);
    file.resize(file.size() - std::min<std::size_t>(file.size(), flags >> 5));
  } else {
    file.assign(data + 1, data + size);
  }
  write_file(file);

  // The reference: the whole inflated content (the reader reads at most 2^34 + 1 bytes; a fuzz
  // input inflates to far less than the cap, which only bounds this oracle's memory).
  const std::size_t cap = std::size_t{1} << 26;
  const contents c = inflate_file(cap);
  if (c.bytes.size() >= cap) return 0;
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(ndim);
  bool must_throw = must_throw_early(c, header, ndim);
  std::vector<std::uint32_t> dims;
  using u128 = unsigned __int128;
  u128 total = 1;
  std::uint64_t claimed = 1;  // the product as read_idx's size_t computes it
  if (!must_throw) {
    for (int d = 0; d < ndim; ++d) {
      dims.push_back(be32(c.bytes.data() + 4 + 4 * d));
      total *= dims.back();
      claimed *= dims.back();
    }
    must_throw = total > (u128{1} << 34) || c.bytes.size() != header + total;
  }
  // (Fixed findings, tests/fuzz/crashes/idx-dims-wrap and idx-claims-16GiB: read_idx let the
  // dimensions' product wrap, and allocated the header's claim before reading a byte.)
  try {
    const sample::idx_array a = sample::read_idx(path(), ndim);
    if (must_throw) fail("returned where it had to throw; dimensions", std::to_string(a.dims.size()));
    if (a.dims != dims) fail("returned other dimensions than the header's");
    if (a.data.size() != total || (total && std::memcmp(a.data.data(), c.bytes.data() + header, a.data.size()) != 0))
      fail("returned other data than the file's");
  } catch (const sample::data_error& e) {
    const std::string what = e.what();
    if (what.rfind(path() + ": ", 0) != 0) fail("an error that does not start with the file's name:", what);
    if (!must_throw) fail("threw on a well-formed file:", what);
  }
  return 0;
}
