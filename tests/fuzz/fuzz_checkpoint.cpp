// tests/fuzz/fuzz_checkpoint.cpp: fashion::load_checkpoint (samples/fashion_cnn/trainer.hpp, over
// samples/common/checkpoint.hpp's reader, which the ResNet-50 trainer shares) on files written from
// the input, for the trainer's default options.
//
// Input: [flags u8][file ...]. Flags put the parts a run checks in place, so that the fuzzer gets
// past them without guessing 8-byte hashes or CRCs: bit 0 a magic (bits 6-7: 0 "LSCKPT03", 1 the
// previous "LSCKPT02", 2 or 3 the refused "LSCKPT01"), bit 1 the options' channels, bit 2 their seed
// and fingerprint, bit 3 array sizes of at most 255 floats each (from the header's own bytes), bit
// 4 the file cut where those arrays (and for 03 the CRC) end, bit 5 the right CRC-32 in the file's
// last 4 bytes.
//
// The oracle decides from the bytes (layout in samples/common/checkpoint.hpp) what load_checkpoint
// must do: throw a std::runtime_error whose message starts with the path (short header, other magic,
// other channels or flags, another size than the header's arrays (and for 03 the CRC) need, a CRC
// that does not match), or return exactly the file's epoch, step and four arrays. Any other
// exception is a failure.
#include <unistd.h>
#include <zlib.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fashion_cnn/trainer.hpp"

namespace {

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_checkpoint: %s %s\n", what, detail.c_str());
  std::abort();
}

const std::string& path() {
  static const std::string p = [] {
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    return std::string(dir) + "/lockstep-fuzz-checkpoint-" + std::to_string(getpid()) + ".bin";
  }();
  return p;
}

constexpr std::size_t head_words = 10, header_bytes = 8 + 4 * head_words + 16;
static_assert(header_bytes == sample::checkpoint_header_bytes);
template <class T>
T load(const std::vector<std::uint8_t>& f, std::size_t at) {
  T v;
  std::memcpy(&v, f.data() + at, sizeof v);
  return v;
}
template <class T>
void store(std::vector<std::uint8_t>& f, std::size_t at, T v) {
  std::memcpy(f.data() + at, &v, sizeof v);
}

bool same_bits(const std::vector<float>& a, const std::vector<std::uint8_t>& f, std::size_t at) {
  return a.empty() || std::memcmp(a.data(), f.data() + at, a.size() * sizeof(float)) == 0;
}

// The reference CRC: zlib's, over the bytes before the last 4, in one call.
std::uint32_t crc_before_trailer(const std::vector<std::uint8_t>& f) {
  return static_cast<std::uint32_t>(::crc32(::crc32(0, nullptr, 0), f.data(), static_cast<uInt>(f.size() - 4)));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  static const fashion::options o;
  static const std::uint64_t fingerprint = fashion::options_fingerprint(o);
  const std::uint8_t flags = data[0];
  std::vector<std::uint8_t> f(data + 1, data + size);

  const auto word = [](int i) { return 8 + 4 * static_cast<std::size_t>(i); };
  const char* magics[4] = {"LSCKPT03", "LSCKPT02", "LSCKPT01", "LSCKPT01"};
  if (flags & 0x0f) f.resize(std::max(f.size(), header_bytes));  // the patches need a whole header
  if (flags & 1) std::memcpy(f.data(), magics[flags >> 6], 8);
  if (flags & 2)
    for (int i = 0; i < 3; ++i) store(f, word(6 + i), static_cast<std::uint32_t>(o.channels[static_cast<std::size_t>(i)]));
  if (flags & 4) store(f, word(10), o.seed), store(f, word(10) + 8, fingerprint);
  if (flags & 8)
    for (int i : {3, 4, 5, 9}) store(f, word(i), load<std::uint32_t>(f, word(i)) & 0xffu);

  // The reference.
  bool must_throw = f.size() < header_bytes;
  if (!must_throw) {
    const bool current = std::memcmp(f.data(), "LSCKPT03", 8) == 0, previous = std::memcmp(f.data(), "LSCKPT02", 8) == 0;
    std::uint64_t floats = 0;
    for (int i : {3, 4, 5, 9}) floats += load<std::uint32_t>(f, word(i));
    const std::uint64_t want = header_bytes + 4 * floats + (current ? 4 : 0);
    if (flags & 16) f.resize(std::min<std::size_t>(f.size(), want));
    if ((flags & 32) && f.size() >= header_bytes + 4) store(f, f.size() - 4, crc_before_trailer(f));
    must_throw = !(current || previous) ||
                 f.size() != want ||  // truncated, or trailing bytes: not this program's checkpoint
                 (current && load<std::uint32_t>(f, f.size() - 4) != crc_before_trailer(f)) ||
                 load<std::uint32_t>(f, word(6)) != static_cast<std::uint32_t>(o.channels[0]) ||
                 load<std::uint32_t>(f, word(7)) != static_cast<std::uint32_t>(o.channels[1]) ||
                 load<std::uint32_t>(f, word(8)) != static_cast<std::uint32_t>(o.channels[2]) ||
                 load<std::uint64_t>(f, word(10)) != o.seed || load<std::uint64_t>(f, word(10) + 8) != fingerprint;
  }
  {
    FILE* out = std::fopen(path().c_str(), "wb");
    // Registered after path() is made, so it runs before path()'s string is destroyed; libFuzzer ends
    // a run with exit().
    static const int removed_at_exit = std::atexit([] { std::remove(path().c_str()); });
    (void)removed_at_exit;
    if (!out || (!f.empty() && std::fwrite(f.data(), 1, f.size(), out) != f.size()) || std::fclose(out) != 0) fail("cannot write", path());
  }
  // (Fixed finding, tests/fuzz/crashes/checkpoint-claims-64GiB: load_checkpoint sized its arrays
  // from the header before it knew the file held them; it now checks the file's size first.)
  try {
    const fashion::checkpoint c = fashion::load_checkpoint(path(), o);
    if (must_throw) fail("returned where it had to throw");
    const std::uint32_t step_lo = load<std::uint32_t>(f, word(1)), step_hi = load<std::uint32_t>(f, word(2));
    if (c.epochs_done != static_cast<int>(load<std::uint32_t>(f, word(0))) ||
        static_cast<std::uint64_t>(c.global_step) != (std::uint64_t{step_hi} << 32 | step_lo))
      fail("returned another epoch or step than the file's");
    std::size_t at = header_bytes;
    int i = 0;
    for (const auto* v : {&c.params, &c.running, &c.momentum, &c.residuals}) {
      const int w = (int[]){3, 4, 5, 9}[i++];
      if (v->size() != load<std::uint32_t>(f, word(w)) || !same_bits(*v, f, at)) fail("returned other arrays than the file's");
      at += 4 * v->size();
    }
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    if (what.rfind(path() + ": ", 0) != 0) fail("an error that does not start with the file's name:", what);
    if (!must_throw) fail("threw on a well-formed file:", what);
  }
  return 0;
}
