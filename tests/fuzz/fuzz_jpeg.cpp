// tests/fuzz/fuzz_jpeg.cpp: sample::jpeg_decoder (samples/common/jpeg.hpp), the fused decode-crop
// of the ImageNet input pipeline, on arbitrary bytes.
//
// Input: [flags u8][crop u8 x 4][file ...]. flags bits 0..4: output size 1..32; bit 5: mirror;
// bit 6: every DCT scale allowed (else the default 1/8, 2/8, 4/8, 8/8); bit 7: validation's centre
// crop (else the crop from the 4 crop bytes: x, y, w, h as fractions of the header's size).
//
// Oracle: decode() returns, or throws a data_error whose message starts with the file's name;
// nothing else (no other exception, no crash, no sanitizer report). When it returns, every output
// lies in the normalised range of bytes 0..255. When the whole image decodes at the same DCT scale
// (decode_full), the fused decode must succeed too (it reads a subset of the same data) and equal
// resample() over the full image bit for bit, the claim tests/test_image_folder.cpp makes on valid
// files. Limits are lowered (1 Mpixel, 64 MiB of libjpeg buffers) so that a header claiming a huge
// image costs little; those refusals are data_errors too.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/jpeg.hpp"

namespace {

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_jpeg: %s %s\n", what, detail.c_str());
  std::abort();
}

const std::string name = "fuzz/input.JPEG";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  static sample::jpeg_decoder dec;  // reused, as a worker reuses its decoder: errors must leave it usable
  dec.max_pixels = std::size_t{1} << 20;
  dec.max_memory = 64L << 20;
  const std::uint8_t flags = data[0];
  const int S = 1 + (flags & 31);
  const bool flip = flags & 32;
  dec.scales = flags & 64 ? sample::all_scales : sample::simd_scales;
  const bool centre = flags & 128;
  const std::uint8_t* cb = data + 1;
  const std::uint8_t* file = data + 5;
  const std::size_t n = size - 5;
  const auto norm = sample::normaliser::of({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
  std::vector<float> out(3 * static_cast<std::size_t>(S) * S), ref(out.size());

  auto plan_of = [&](const sample::jpeg_header& h) {
    sample::crop_plan p;
    p.flip = flip;
    if (centre) {
      const double side = std::min(h.width, h.height) * 7.0 / 8.0;
      p.rect = {(h.width - side) / 2, (h.height - side) / 2, side, side};
    } else {
      p.rect.w = std::max(1.0, (cb[2] + 1) / 256.0 * h.width);
      p.rect.h = std::max(1.0, (cb[3] + 1) / 256.0 * h.height);
      p.rect.x = cb[0] / 255.0 * (h.width - p.rect.w);
      p.rect.y = cb[1] / 255.0 * (h.height - p.rect.h);
    }
    return p;
  };

  sample::decode_info info;
  bool fused_ok = false;
  try {
    info = dec.decode(file, n, name, plan_of, S, norm, out.data());
    fused_ok = true;
  } catch (const sample::data_error& e) {
    if (std::string(e.what()).rfind(name + ": ", 0) != 0) fail("an error that does not start with the file's name:", e.what());
  }
  if (fused_ok) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      const std::size_t c = i / (static_cast<std::size_t>(S) * S);
      const float lo = norm.add[c] - 1e-4f, hi = 255.0f * norm.mul[c] + norm.add[c] + 1e-4f;
      if (!(out[i] >= lo && out[i] <= hi)) fail("an output outside the normalised byte range:", std::to_string(out[i]));
    }
  }

  // The reference: the whole image at the scale decode() chose (or would choose) for this plan.
  int scale = 8;
  if (fused_ok) {
    scale = info.scale_num;
  } else {
    try {
      const sample::jpeg_header h = dec.read_header(file, n, name);
      scale = sample::choose_scale(plan_of(h).rect, S, dec.scales);
    } catch (const sample::data_error&) {
      return 0;  // the header is bad: decode() rightly refused
    }
  }
  int w = 0, h = 0;
  std::vector<std::uint8_t> full;
  try {
    full = dec.decode_full(file, n, name, scale, &w, &h);
  } catch (const sample::data_error& e) {
    if (std::string(e.what()).rfind(name + ": ", 0) != 0) fail("decode_full: an error without the file's name:", e.what());
    return 0;  // damage somewhere in the image; the fused decode may not have reached it
  }
  if (!fused_ok) fail("the whole image decodes, the fused crop of it does not");
  dec.resample(full.data(), w, h, info.plan, info.scale_num, S, norm, ref.data());
  if (std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)) != 0)
    fail("the fused decode differs from a full decode at the same scale, cropped and resized the same way");
  return 0;
}
