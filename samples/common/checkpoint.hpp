// samples/common/checkpoint.hpp: the checkpoint file of both sample trainers: one layout, one
// writer and one reader. Atomic replacement, a fingerprint of the flags a run was started with, a
// CRC-32 over the whole file, and reads that check the sizes a header claims against the file
// before allocating anything.
//
// The file (native byte order; the trainer picks the magic and the three model words):
//   magic[8] | u32 head[10] | u64 seed, options fingerprint | f32 params | f32 running |
//   f32 momentum | f32 residuals | u32 crc
//   head: 0 epochs_done, 1 global_step_lo, 2 global_step_hi, 3 params, 4 running, 5 momentum (sizes
//         in floats), the residuals' size at checkpoint_format::residuals_word, and three words the
//         trainer rebuilds its model from (checked by the trainer against its flags)
//   crc:  zlib's CRC-32 of every byte before it
// A flipped bit anywhere is a named error: in a size word, the size check against the file's length
// finds it; anywhere else, the CRC. The previous format of each trainer is the same layout without
// the CRC: it still loads, with a line saying that nothing verified it.
// Atomic: the file is written to "<path>.tmp" and renamed over the old one, so a crash leaves either
// the previous checkpoint or the new one, never half of one.
// Limits: the reader holds the whole file in memory (it is the trainer's state anyway); arrays of up
// to 2^32 - 1 floats each.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace sample {

// FNV-1a of a string: the options fingerprint (the flags that change what a step computes, printed
// into one string by the trainer); resuming under other values is refused.
inline std::uint64_t fingerprint(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// Replaces `path` by what fill(std::ofstream&) writes, atomically.
template <class F>
void write_atomically(const std::string& path, F&& fill) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error(tmp + ": cannot create the checkpoint file");
    fill(f);
    f.flush();
    if (!f) throw std::runtime_error(tmp + ": write failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);
}

template <class T>
void write_pod(std::ostream& f, std::span<const T> v) {
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size_bytes()));
}

template <class T>
void read_pod(std::istream& f, std::span<T> v) {
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size_bytes()));
}

// zlib's CRC-32 of `n` bytes after `crc` (zlib takes 32-bit lengths: fed in 1 GiB pieces).
inline std::uint32_t crc32_update(std::uint32_t crc, const void* p, std::size_t n) {
  const auto* b = static_cast<const Bytef*>(p);
  for (std::size_t done = 0; done < n;) {
    const std::size_t piece = std::min<std::size_t>(n - done, std::size_t{1} << 30);
    crc = static_cast<std::uint32_t>(::crc32(crc, b + done, static_cast<uInt>(piece)));
    done += piece;
  }
  return crc;
}

// Checks that the rest of the file holds exactly `claimed` bytes (a corrupt header must not ask for
// gigabytes, nor may the file carry trailing bytes); throws naming the file.
inline void check_remaining(std::ifstream& f, std::uint64_t claimed, const std::string& path) {
  const auto here = f.tellg();
  f.seekg(0, std::ios::end);
  const auto end = f.tellg();
  f.seekg(here);
  if (here < 0 || end < here || claimed != static_cast<std::uint64_t>(end - here))
    throw std::runtime_error(path + ": the header promises " + std::to_string(claimed) + " bytes of parameters and state, " +
                             "the file holds " + std::to_string(end >= here ? static_cast<long long>(end - here) : 0) +
                             " (truncated or not a checkpoint of this program)");
}

// What both trainers save at an epoch's end.
struct checkpoint {
  int epochs_done = 0;
  long long global_step = 0;
  std::vector<float> params, running, momentum, residuals;
};

// Where a checkpoint says training stands, against this run's flags (which its fingerprint
// matched, so the steps per epoch are this run's): epochs done within 0..epochs, and the step count
// exactly that many epochs. The previous format has no CRC, so its counters are checked here.
inline void check_progress(const std::string& path, const checkpoint& c, int epochs, long long steps_per_epoch) {
  if (c.epochs_done < 0 || c.epochs_done > epochs)
    throw std::runtime_error(path + ": says " + std::to_string(c.epochs_done) + " epochs are done, outside 0.." +
                             std::to_string(epochs) + " (--epochs): damaged");
  if (c.global_step != static_cast<long long>(c.epochs_done) * steps_per_epoch)
    throw std::runtime_error(path + ": says step " + std::to_string(c.global_step) + " after " +
                             std::to_string(c.epochs_done) + " epochs of " + std::to_string(steps_per_epoch) +
                             " steps: damaged, or written for other data");
}

// A trainer's file format: its magics and where its header keeps the residuals' size.
struct checkpoint_format {
  const char* magic;           // 8 bytes: this version (with the CRC)
  const char* previous;        // 8 bytes: the version before (the same layout without the CRC), or nullptr
  const char* what;            // what a file with neither magic is not: "a lockstep checkpoint"
  std::size_t residuals_word;  // the head word holding the residuals' size (one of 6..9)
  const char* refused = nullptr;      // 8 bytes: an older magic that cannot be read, or nullptr
  const char* refused_why = nullptr;  // the error for it
};

using checkpoint_head = std::array<std::uint32_t, 10>;
inline constexpr std::size_t checkpoint_header_bytes = 8 + sizeof(checkpoint_head) + 2 * sizeof(std::uint64_t);

// A checkpoint as read, with the header words and ids the trainer checks against its flags.
struct checkpoint_file {
  checkpoint_head head{};
  std::uint64_t seed = 0, fingerprint = 0;
  sample::checkpoint data;
  bool checksummed = true;  // false: read from the previous format, which has no CRC
};

// Writes `c` to `path` atomically in `fmt`'s current version. `model` holds the trainer's three
// model words; the writer fills the counters and sizes.
inline void write_checkpoint(const std::string& path, const checkpoint_format& fmt, checkpoint_head model,
                             std::uint64_t seed, std::uint64_t options_fingerprint, const checkpoint& c) {
  checkpoint_head& head = model;
  head[0] = static_cast<std::uint32_t>(c.epochs_done);
  head[1] = static_cast<std::uint32_t>(static_cast<std::uint64_t>(c.global_step) & 0xFFFFFFFFu);
  head[2] = static_cast<std::uint32_t>(static_cast<std::uint64_t>(c.global_step) >> 32);
  const std::vector<float>* arrays[4] = {&c.params, &c.running, &c.momentum, &c.residuals};
  const std::size_t size_words[4] = {3, 4, 5, fmt.residuals_word};
  for (int i = 0; i < 4; ++i) {
    if (arrays[i]->size() > 0xFFFFFFFFu)
      throw std::length_error(path + ": an array of " + std::to_string(arrays[i]->size()) + " floats does not fit the format");
    head[size_words[i]] = static_cast<std::uint32_t>(arrays[i]->size());
  }
  const std::uint64_t ids[2] = {seed, options_fingerprint};
  write_atomically(path, [&](std::ofstream& f) {
    std::uint32_t crc = crc32_update(0, nullptr, 0);
    auto put = [&](const void* p, std::size_t n) {
      f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
      crc = crc32_update(crc, p, n);
    };
    put(fmt.magic, 8);
    put(head.data(), sizeof head);
    put(ids, sizeof ids);
    for (const auto* v : arrays) put(v->data(), v->size() * sizeof(float));
    f.write(reinterpret_cast<const char*>(&crc), sizeof crc);
  });
}

// Reads a checkpoint of `fmt` (its current version, or the previous one, saying so on `log` when not
// null). Throws std::runtime_error starting with the path: no file, not this format (or an older
// one), sizes the file does not hold (truncated, trailing bytes, a flipped size bit), or a CRC that
// does not match (a flipped bit anywhere else). The header's model words, seed and fingerprint are
// the trainer's to check.
inline checkpoint_file read_checkpoint(const std::string& path, const checkpoint_format& fmt, std::FILE* log = nullptr) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error(path + ": a directory, not a checkpoint file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": no checkpoint to resume from (" + std::strerror(errno) + ")");
  const auto file_bytes = std::filesystem::file_size(path, ec);
  if (!ec && file_bytes == 0) throw std::runtime_error(path + ": an empty file (0 bytes), not " + std::string(fmt.what));
  checkpoint_file r;
  char magic[8] = {};
  std::uint64_t ids[2];
  f.read(magic, 8);
  read_pod(f, std::span<std::uint32_t>(r.head));
  read_pod(f, std::span<std::uint64_t>(ids));
  if (f && fmt.refused && std::memcmp(magic, fmt.refused, 8) == 0) throw std::runtime_error(path + ": " + fmt.refused_why);
  const bool current = f && std::memcmp(magic, fmt.magic, 8) == 0;
  const bool previous = f && !current && fmt.previous && std::memcmp(magic, fmt.previous, 8) == 0;
  if (!current && !previous) {
    // Say why: too short to hold a header, a version of this format this build does not know
    // (same four-letter family: written by a newer build), or something else entirely.
    if (!ec && file_bytes < checkpoint_header_bytes)
      throw std::runtime_error(path + ": " + std::to_string(file_bytes) + " bytes, shorter than the " +
                               std::to_string(checkpoint_header_bytes) + "-byte header of " + fmt.what + " (truncated?)");
    if (std::memcmp(magic, fmt.magic, 4) == 0) {
      std::string seen(magic, 8);
      for (char& c : seen)
        if (c < 0x20 || c > 0x7e) c = '?';
      throw std::runtime_error(path + ": " + fmt.what + " of version \"" + seen + "\", which this build (\"" +
                               fmt.magic + "\") cannot read: written by a newer lockstep?");
    }
    throw std::runtime_error(path + ": not " + fmt.what);
  }
  r.seed = ids[0];
  r.fingerprint = ids[1];

  // The sizes the header claims, checked against what the file holds before anything is allocated
  // for them (a corrupt header must not ask for gigabytes).
  std::vector<float>* arrays[4] = {&r.data.params, &r.data.running, &r.data.momentum, &r.data.residuals};
  const std::size_t size_words[4] = {3, 4, 5, fmt.residuals_word};
  std::uint64_t floats = 0;
  for (std::size_t w : size_words) floats += r.head[w];
  check_remaining(f, floats * sizeof(float) + (current ? sizeof(std::uint32_t) : 0), path);
  for (int i = 0; i < 4; ++i) {
    arrays[i]->resize(r.head[size_words[i]]);
    read_pod(f, std::span<float>(*arrays[i]));
  }
  std::uint32_t stored = 0;
  if (current) f.read(reinterpret_cast<char*>(&stored), sizeof stored);
  if (!f) throw std::runtime_error(path + ": truncated checkpoint (it shrank while being read)");

  if (current) {
    std::uint32_t crc = crc32_update(0, nullptr, 0);
    crc = crc32_update(crc, magic, 8);
    crc = crc32_update(crc, r.head.data(), sizeof r.head);
    crc = crc32_update(crc, ids, sizeof ids);
    for (const auto* v : arrays) crc = crc32_update(crc, v->data(), v->size() * sizeof(float));
    if (crc != stored) {
      char detail[160];
      std::snprintf(detail, sizeof detail, "the CRC-32 of its first %" PRIu64 " bytes is %08" PRIx32 ", the file says %08" PRIx32,
                    static_cast<std::uint64_t>(checkpoint_header_bytes + floats * sizeof(float)), crc, stored);
      throw std::runtime_error(path + ": corrupted checkpoint: " + detail + " (a flipped bit or a damaged copy)");
    }
  } else if (log) {
    std::fprintf(log, "%s: a checkpoint of the previous format (%.8s), which has no checksum: read without verifying it\n",
                 path.c_str(), fmt.previous);
  }
  r.checksummed = current;
  r.data.epochs_done = static_cast<int>(r.head[0]);
  r.data.global_step = static_cast<long long>(static_cast<std::uint64_t>(r.head[1]) | (std::uint64_t{r.head[2]} << 32));
  return r;
}

}  // namespace sample
