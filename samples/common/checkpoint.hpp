// samples/common/checkpoint.hpp: the file handling under the sample trainers' checkpoints: atomic
// replacement, a fingerprint of the flags a run was started with, and reads that check the sizes a
// header claims against the file before allocating anything.
//
// Each trainer defines its own header (what its model needs to be rebuilt); both keep the same shape:
//   8-byte magic | u32 header words | u64 seed, options fingerprint | f32 arrays, sizes in the header
// Atomic: the file is written to "<path>.tmp" and renamed over the old one, so a crash leaves either
// the previous checkpoint or the new one, never half of one.
#pragma once

#include <cstdint>
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

}  // namespace sample
