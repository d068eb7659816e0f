// samples/common/jpeg.hpp: fused JPEG decode-crop-resize-flip-normalise with libjpeg-turbo.
//
// Purpose: turn one compressed JPEG into one network input (3, size, size) of normalised floats,
// doing only the work that input needs (Ying et al. 2018, sec. 3: "decode and crop in one pass").
// The crop is drawn from the header's size alone; libjpeg then decodes the crop at the smallest
// DCT scale n/8 whose scaled crop still covers size x size (n among `scales`: by default 1, 2, 4
// and 8, the scales libjpeg-turbo has SIMD for; any of 1..8 on request), skips the rows above the
// crop (jpeg_skip_scanlines), decodes only the iMCU columns it covers (jpeg_crop_scanline), stops
// after its last row, and each decoded row is resampled horizontally as soon as it arrives.
//
// Resampling: bilinear between pixel centres, not antialiased. The DCT scale leaves at most a
// factor 2 to the bilinear step (8/7 with every scale allowed; more only at n = 1, for crops over
// 16x the output), so the missing antialias costs little; PIL's (torchvision's) bilinear resize
// does antialias.
// Flipping reverses the horizontal taps; normalisation is (v / 255 - mean) / stddev per channel.
//
// Exactness: resample() runs the same taps over a fully decoded image, so a test can check the
// fused path against "full decode at the same scale, then crop, then resize". libjpeg documents
// one difference of partial decodes: fancy (smooth) chroma upsampling treats the left and right
// edges of a cropped region as image edges. decode() asks libjpeg for `margin` (2) extra pixels
// on each side of the columns and rows its taps read, so no tap lands on such an edge pixel.
//
// Errors: every failure is a data_error "<name>: <what>". libjpeg's error_exit would call exit();
// ours longjmps back to decode(), which throws. libjpeg's warnings are errors too (a premature end
// of data would otherwise decode as grey rows), except "unknown JFIF revision", which is metadata.
// Baseline files are read only down to the crop's last row, so truncation below it is caught by a
// separate check: the file must hold an end-of-image marker (FF D9) after its scan data begins
// (entropy-coded data cannot contain FF D9, so a cut file has none there); trailing bytes after
// the marker are allowed. A JPEG has no checksum: flipped bits inside the entropy-coded data that
// still form valid Huffman codes decode to wrong pixels without any error, here as in every
// decoder.
//
// Colour: YCbCr, RGB and grayscale files come out as RGB (gray replicated by libjpeg). CMYK and
// YCCK files are converted: libjpeg gives CMYK, and R = C * K / 255 on Adobe files (which store
// inverted CMYK, as Photoshop writes them), R = (255 - C) * (255 - K) / 255 otherwise; no colour
// profile is applied. Other colour spaces are an error.
//
// Limits: 8-bit JPEGs only (libjpeg-turbo 2.1 has no 12-bit or lossless in this API); images of
// more than max_pixels pixels, or whose decode needs more than max_memory bytes of libjpeg's
// whole-image buffers (progressive files), are refused with an error.
//
// Not thread-safe: one jpeg_decoder per thread; it keeps its libjpeg object and buffers between
// images so a steady-state decode allocates nothing.
//
// Shapes: out (3, size, size) channel-major (one image of NCHW), or (size, size, 3) with
// channels_last; the scanline buffer (cols, 3).
#pragma once

#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <jerror.h>
#include <jpeglib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "data_error.hpp"

namespace sample {

// What the header says, before any pixel is decoded.
struct jpeg_header {
  int width = 0, height = 0;
  int components = 0;
  J_COLOR_SPACE color = JCS_UNKNOWN;
  bool progressive = false;
};

// A crop of the source image in source pixels; fractional, so the centre crop of validation can be
// exactly centred. The output pixel ox samples x + (ox + 0.5) * w / size (pixel centres).
struct crop_rect {
  double x = 0, y = 0, w = 0, h = 0;
};

// What the caller decides from the header: where to crop and whether to mirror.
struct crop_plan {
  crop_rect rect;
  bool flip = false;
};

// Per-channel normalisation folded into one multiply-add: v * mul + add = (v / 255 - mean) / stddev.
struct normaliser {
  std::array<float, 3> mul{}, add{};
  static normaliser of(const std::array<float, 3>& mean, const std::array<float, 3>& stddev) {
    normaliser n;
    for (int c = 0; c < 3; ++c) {
      n.mul[c] = 1.0f / (255.0f * stddev[c]);
      n.add[c] = -mean[c] / stddev[c];
    }
    return n;
  }
};

// What one decode did (for tests, logs and the reference path).
struct decode_info {
  jpeg_header header;
  crop_plan plan;
  int scale_num = 8;                     // the DCT scale was scale_num / 8
  int scaled_width = 0, scaled_height = 0;  // the whole image at that scale
  int col0 = 0, cols = 0;                // scaled columns libjpeg decoded (after its iMCU rounding)
  int row0 = 0, rows = 0;                // scaled rows read (rows above row0 were skipped)
};

// DCT scales n/8 as a bit set: bit n-1 allows n/8.
inline constexpr unsigned all_scales = 0xFFu;
// 1/8, 2/8, 4/8 and 8/8: the scales whose IDCTs libjpeg-turbo 2.1 has in SIMD (jsimd_idct_islow,
// _4x4, _2x2, 1x1 in C but trivial); 3/8, 5/8, 6/8 and 7/8 (and the 14x14, 12x12, 10x10 chroma
// IDCTs they bring) are plain C. Measured on lockstep-bench-input-pipeline (400x350 quality 90,
// output 224, one core): all eight scales 1.58 s of CPU for 4,160 images, these four 1.29 s.
inline constexpr unsigned simd_scales = 0x8Bu;

// The smallest allowed n in 1..8 with crop * n / 8 >= size on both sides (8 when none covers it:
// upscaling is left to the bilinear step, never to the IDCT).
inline int choose_scale(const crop_rect& r, int size, unsigned allowed = all_scales) {
  for (int n = 1; n < 8; ++n)
    if ((allowed >> (n - 1) & 1u) && r.w * n >= 8.0 * size && r.h * n >= 8.0 * size) return n;
  return 8;
}

namespace jpeg_detail {

// Bilinear taps of one axis: output o reads source i0[o], i1[o] with weight f[o] on i1.
// `start`, `extent`: the crop along this axis in scaled pixels; `limit`: the scaled image's size.
// Positions are clamped to the image (not to the crop), so a crop at the edge repeats edge pixels.
inline void axis_taps(double start, double extent, int out, int limit, bool reverse, int* i0, int* i1, float* f) {
  for (int o = 0; o < out; ++o) {
    const int src = reverse ? out - 1 - o : o;
    double s = start + (src + 0.5) * extent / out - 0.5;
    s = std::clamp(s, 0.0, static_cast<double>(limit - 1));
    const int a = static_cast<int>(std::floor(s));
    i0[o] = a;
    i1[o] = std::min(a + 1, limit - 1);
    f[o] = static_cast<float>(s - a);
  }
}

// hrow (3, S) <- for each channel c and output ox: a + fx (b - a), a = p[off0[ox] + c] and
// b = p[off1[ox] + c], p an RGB row with `pad` readable bytes after its last pixel. The taps of
// axis_taps have off1 = off0 + 3 (the next pixel) or fx = 0 (clamped at the right edge, where b
// does not matter: a + 0 (b - a) = a), so the SIMD paths read b at off0 + 3 + c:
//   AVX-512 VBMI: per group of 16 outputs whose taps lie within 128 bytes (a downscale up to
//     about 2.5), two 64-byte loads at the group's first tap byte (`base`), then one byte permute
//     (vpermt2b) per channel with the group's precomputed indices (`idx`: a in bytes 0..15, b in
//     16..31) picks both taps of all 16 outputs; wider groups (base < 0) gather.
//   AVX-512F / AVX2: a 4-byte gather at off0 + c per output: a is its lowest byte, b its highest.
// All paths do the same float operations in the same order and agree bit for bit (the project
// builds with -ffp-contract=off: no fused multiply-add).
inline constexpr std::size_t row_pad = 132;  // bytes readable after a row: the VBMI path's 128-byte window

#if defined(__AVX512F__) && !defined(LOCKSTEP_NO_AVX512) && !defined(LOCKSTEP_NO_SIMD)
// 16 outputs of channel plane h from taps at byte offsets off0 of pc (AVX-512F gathers). The masked
// forms with zero as the pass-through: GCC 12 warns that the unmasked ones' undefined pass-through
// "may be used uninitialized".
inline void lerp16_gather(const std::uint8_t* pc, const int* off0, const float* fx, float* h) {
  const __m512i low = _mm512_set1_epi32(0xFF), zero = _mm512_setzero_si512();
  const __mmask16 all = 0xFFFF;
  const __m512i v = _mm512_mask_i32gather_epi32(zero, all, _mm512_loadu_si512(off0), pc, 1);
  const __m512 a = _mm512_maskz_cvtepi32_ps(all, _mm512_and_si512(v, low));
  const __m512 b = _mm512_maskz_cvtepi32_ps(all, _mm512_maskz_srli_epi32(all, v, 24));
  _mm512_storeu_ps(h, _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(fx), _mm512_sub_ps(b, a))));
}
#endif

#if defined(__AVX512VBMI__) && !defined(LOCKSTEP_NO_AVX512) && !defined(LOCKSTEP_NO_SIMD) && !defined(LOCKSTEP_NO_VBMI)
#define LOCKSTEP_SAMPLE_JPEG_VBMI 1
#endif

// The VBMI path's groups: base[g] = the first byte of group g's window (or -1: gather), idx (64 bytes
// per group) the window offsets of a (bytes 0..15) and b (16..31) for channel 0.
inline void permute_groups(const int* off0, std::size_t S, int* base, std::uint8_t* idx) {
  for (std::size_t g = 0; (g + 1) * 16 <= S; ++g) {
    const int* o = off0 + 16 * g;
    const int lo = *std::min_element(o, o + 16), hi = *std::max_element(o, o + 16);
    std::uint8_t* ix = idx + 64 * g;
    std::fill(ix, ix + 64, std::uint8_t{0});
    if (hi - lo + 3 + 2 > 127) {  // b of channel 2 must lie inside the 128-byte window
      base[g] = -1;
      continue;
    }
    base[g] = lo;
    for (int k = 0; k < 16; ++k) {
      ix[k] = static_cast<std::uint8_t>(o[k] - lo);
      ix[16 + k] = static_cast<std::uint8_t>(o[k] - lo + 3);
    }
  }
}

inline void lerp_taps(const std::uint8_t* p, const int* off0, const int* off1, const float* fx, std::size_t S,
                      const int* base, const std::uint8_t* idx, float* hrow) {
  std::size_t done = 0;  // outputs of every channel written by the grouped path
#if defined(LOCKSTEP_SAMPLE_JPEG_VBMI)
  const __mmask16 all = 0xFFFF;
  for (std::size_t g = 0; (g + 1) * 16 <= S; ++g) {
    const std::size_t ox = 16 * g;
    if (base[g] < 0) {
      for (std::size_t c = 0; c < 3; ++c) lerp16_gather(p + c, off0 + ox, fx + ox, hrow + c * S + ox);
      continue;
    }
    const __m512i lo = _mm512_loadu_si512(p + base[g]), hi = _mm512_loadu_si512(p + base[g] + 64);
    const __m512i ix = _mm512_loadu_si512(idx + 64 * g);
    const __m512 f = _mm512_loadu_ps(fx + ox);
    for (std::size_t c = 0; c < 3; ++c) {
      const __m512i v = _mm512_permutex2var_epi8(lo, _mm512_add_epi8(ix, _mm512_set1_epi8(static_cast<char>(c))), hi);
      const __m512 a = _mm512_maskz_cvtepi32_ps(all, _mm512_maskz_cvtepu8_epi32(all, _mm512_maskz_extracti32x4_epi32(0xF, v, 0)));
      const __m512 b = _mm512_maskz_cvtepi32_ps(all, _mm512_maskz_cvtepu8_epi32(all, _mm512_maskz_extracti32x4_epi32(0xF, v, 1)));
      _mm512_storeu_ps(hrow + c * S + ox, _mm512_add_ps(a, _mm512_mul_ps(f, _mm512_sub_ps(b, a))));
    }
  }
  done = S / 16 * 16;
#else
  (void)base;
  (void)idx;
#endif
  for (std::size_t c = 0; c < 3; ++c) {
    const std::uint8_t* pc = p + c;
    float* h = hrow + c * S;
    std::size_t ox = done;
#if !defined(LOCKSTEP_SAMPLE_JPEG_VBMI) && defined(__AVX512F__) && !defined(LOCKSTEP_NO_AVX512) && !defined(LOCKSTEP_NO_SIMD)
    for (; ox + 16 <= S; ox += 16) lerp16_gather(pc, off0 + ox, fx + ox, h + ox);
#elif !defined(LOCKSTEP_SAMPLE_JPEG_VBMI) && defined(__AVX2__) && !defined(LOCKSTEP_NO_SIMD)
    const __m256i low = _mm256_set1_epi32(0xFF);
    const int* words = reinterpret_cast<const int*>(pc);
    for (; ox + 8 <= S; ox += 8) {
      const __m256i v = _mm256_i32gather_epi32(words, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(off0 + ox)), 1);
      const __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
      const __m256 b = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 24));
      _mm256_storeu_ps(h + ox, _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(fx + ox), _mm256_sub_ps(b, a))));
    }
#endif
    for (; ox < S; ++ox) {
      const float a = pc[off0[ox]], b = pc[off1[ox]];
      h[ox] = a + fx[ox] * (b - a);
    }
  }
}

// libjpeg's error manager, extended with where to jump and the message. error_exit and warnings
// longjmp to the setjmp in jpeg_decoder; nothing between them owns a destructor.
struct error_manager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

inline void on_error(j_common_ptr c) {
  auto* e = reinterpret_cast<error_manager*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}

inline void on_message(j_common_ptr c, int level) {
  if (level >= 0) return;                        // trace messages
  if (c->err->msg_code == JWRN_JFIF_MAJOR) return;  // an unknown JFIF revision: metadata only
  on_error(c);                                   // corrupt data, premature end: an error here
}

inline void no_output(j_common_ptr) {}

}  // namespace jpeg_detail

class jpeg_decoder {
 public:
  // Refuse images above this many pixels (a header can claim 65500 x 65500 in a few bytes).
  std::size_t max_pixels = std::size_t{1} << 28;
  // Cap on libjpeg's whole-image buffers (progressive and multi-scan files); see jmemnobs.c.
  long max_memory = 1L << 30;
  // Extra pixels decoded beyond the taps on each side, so that libjpeg's cropped-edge upsampling
  // (see the file comment) never reaches a pixel the taps read.
  int margin = 2;
  // Write (size, size, 3) instead of (3, size, size): the same values, channels interleaved.
  bool channels_last = false;
  // The DCT scales decode() may choose (choose_scale's bit set); all_scales for every n/8.
  unsigned scales = simd_scales;

  jpeg_decoder() {
    cinfo_.err = jpeg_std_error(&err_.pub);
    err_.pub.error_exit = jpeg_detail::on_error;
    err_.pub.emit_message = jpeg_detail::on_message;
    err_.pub.output_message = jpeg_detail::no_output;
    err_.message[0] = 0;
    if (!create()) throw std::runtime_error(std::string("jpeg_decoder: libjpeg: ") + err_.message);
  }
  ~jpeg_decoder() { jpeg_destroy_decompress(&cinfo_); }
  jpeg_decoder(const jpeg_decoder&) = delete;
  jpeg_decoder& operator=(const jpeg_decoder&) = delete;

  // Decodes `data` (n bytes, called `name` in errors) into out (3, size, size): plan(header)
  // decides the crop and the flip; returns what was done. Throws data_error.
  template <class Planner>
  decode_info decode(const std::uint8_t* data, std::size_t n, const std::string& name, Planner&& plan, int size,
                     const normaliser& norm, float* out) {
    decode_info info;
    info.header = read_header(data, n, name);
    info.plan = plan(static_cast<const jpeg_header&>(info.header));
    const crop_rect& r = info.plan.rect;
    if (!(r.w > 0 && r.h > 0 && r.x >= 0 && r.y >= 0 && r.x + r.w <= info.header.width + 1e-9 &&
          r.y + r.h <= info.header.height + 1e-9)) {
      jpeg_abort_decompress(&cinfo_);
      throw data_error(name + ": crop outside the " + std::to_string(info.header.width) + "x" +
                       std::to_string(info.header.height) + " image (a bug of the caller's planner)");
    }
    info.scale_num = choose_scale(r, size, scales);
    prepare_taps(info, size);
    if (!decode_rows(info, size, norm, out)) fail(name);
    jpeg_abort_decompress(&cinfo_);
    return info;
  }

  // The whole image at scale scale_num / 8 as (height, width, 3) bytes: the reference path of the
  // tests and the fuzzer. Same error rules as decode().
  std::vector<std::uint8_t> decode_full(const std::uint8_t* data, std::size_t n, const std::string& name,
                                        int scale_num, int* width, int* height) {
    read_header(data, n, name);
    full_.clear();
    if (!decode_all(scale_num)) fail(name);
    *width = static_cast<int>(cinfo_.output_width);
    *height = static_cast<int>(cinfo_.output_height);
    jpeg_abort_decompress(&cinfo_);
    return full_;
  }

  // The resize of decode() over an image already decoded at info's scale (rgb (height, width, 3)):
  // decode() of the same file and plan must give the same floats.
  void resample(const std::uint8_t* rgb, int width, int height, const crop_plan& plan, int scale_num, int size,
                const normaliser& norm, float* out) {
    decode_info info;
    info.plan = plan;
    info.scale_num = scale_num;
    info.scaled_width = width;
    info.scaled_height = height;
    taps(info, size);
    row0_ = ylo_;
    // Each row is copied into a padded buffer: lerp_taps reads past the last tap.
    const std::size_t row_bytes = static_cast<std::size_t>(width) * 3;
    scanline_.resize(std::max(scanline_.size(), row_bytes + pad));
    stream(size, norm, out, [&](int r) {
      std::memcpy(scanline_.data(), rgb + static_cast<std::size_t>(r) * row_bytes, row_bytes);
      return static_cast<const std::uint8_t*>(scanline_.data());
    }, 0);
  }

  // Reads the header and checks what can be checked before decoding. Leaves libjpeg ready for
  // jpeg_start_decompress.
  jpeg_header read_header(const std::uint8_t* data, std::size_t n, const std::string& name) {
    if (n == 0) throw data_error(name + ": empty file (0 bytes), not a JPEG");
    if (n >= 8 && std::memcmp(data, "\x89PNG\r\n\x1a\n", 8) == 0)
      throw data_error(name + ": a PNG file, not a JPEG (renamed?)");
    if (n >= 4 && (std::memcmp(data, "GIF8", 4) == 0))
      throw data_error(name + ": a GIF file, not a JPEG (renamed?)");
    if (n < 2 || data[0] != 0xFF || data[1] != 0xD8)
      throw data_error(name + ": not a JPEG (no start-of-image marker FF D8 at the start)");
    jpeg_header h;
    std::size_t scan_start = 0;
    if (!header_phase(data, n, &h, &scan_start)) fail(name);
    if (static_cast<std::size_t>(h.width) * static_cast<std::size_t>(h.height) > max_pixels) {
      jpeg_abort_decompress(&cinfo_);
      throw data_error(name + ": " + std::to_string(h.width) + "x" + std::to_string(h.height) +
                       " pixels, over the decoder's limit of " + std::to_string(max_pixels));
    }
    if (!(h.components == 1 && h.color == JCS_GRAYSCALE) && !(h.components == 3 && (h.color == JCS_YCbCr || h.color == JCS_RGB)) &&
        !(h.components == 4 && (h.color == JCS_CMYK || h.color == JCS_YCCK))) {
      jpeg_abort_decompress(&cinfo_);
      throw data_error(name + ": unsupported colour space (" + std::to_string(h.components) + " components, libjpeg colour space " +
                       std::to_string(static_cast<int>(h.color)) + ")");
    }
    // A file cut short has no end-of-image marker after the start of its scan data (FF D9 cannot
    // occur inside entropy-coded data, where FF is always followed by 00 or a restart marker).
    bool eoi = false;
    for (std::size_t i = n; i >= scan_start + 2; --i)
      if (data[i - 2] == 0xFF && data[i - 1] == 0xD9) {
        eoi = true;
        break;
      }
    if (!eoi) {
      jpeg_abort_decompress(&cinfo_);
      throw data_error(name + ": truncated JPEG (no end-of-image marker FF D9 after the scan data; " +
                       std::to_string(n) + " bytes)");
    }
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& name) {
    jpeg_abort_decompress(&cinfo_);
    throw data_error(name + ": corrupt JPEG (libjpeg: " + std::string(err_.message) + ")");
  }

  // The setjmp frames below hold no object with a destructor, and everything they write that is
  // read after a longjmp lives in *this.
  bool create() {
    if (setjmp(err_.jump)) return false;  // out of memory in jpeg_create_decompress
    jpeg_create_decompress(&cinfo_);
    return true;
  }

  bool header_phase(const std::uint8_t* data, std::size_t n, jpeg_header* h, std::size_t* scan_start) {
    if (setjmp(err_.jump)) return false;
    // A fresh libjpeg object per file: one reused after jpeg_abort_decompress keeps the previous
    // file's quantization and Huffman tables, so a file that lacks them (an "abbreviated" stream, or
    // a corrupt one) would decode with whatever file this thread read before, instead of failing.
    // Found by fuzz_jpeg (its decoder is reused, as a worker's is). Costs a few small allocations.
    jpeg_destroy_decompress(&cinfo_);
    jpeg_create_decompress(&cinfo_);
    cinfo_.mem->max_memory_to_use = max_memory;
    jpeg_mem_src(&cinfo_, data, static_cast<unsigned long>(n));
    jpeg_read_header(&cinfo_, TRUE);
    h->width = static_cast<int>(cinfo_.image_width);
    h->height = static_cast<int>(cinfo_.image_height);
    h->components = cinfo_.num_components;
    h->color = cinfo_.jpeg_color_space;
    h->progressive = cinfo_.progressive_mode != 0;
    *scan_start = static_cast<std::size_t>(cinfo_.src->next_input_byte - data);
    return true;
  }

  void set_output(int scale_num) {
    cinfo_.scale_num = static_cast<unsigned>(scale_num);
    cinfo_.scale_denom = 8;
    cmyk_ = cinfo_.jpeg_color_space == JCS_CMYK || cinfo_.jpeg_color_space == JCS_YCCK;
    adobe_ = cinfo_.saw_Adobe_marker != 0;
    cinfo_.out_color_space = cmyk_ ? JCS_CMYK : JCS_RGB;
    cinfo_.dct_method = JDCT_ISLOW;  // libjpeg's (and PIL's) default: the accurate integer IDCT
    cinfo_.do_fancy_upsampling = TRUE;
    // Interblock smoothing guesses the AC coefficients of a progressive file whose later scans are
    // missing, from neighbouring blocks: at a cropped edge it sees other neighbours than a full
    // decode does. Off, such a file decodes the same either way (the missing coefficients are 0);
    // a complete file is not affected.
    cinfo_.do_block_smoothing = FALSE;
  }

  // Scaled image size at info.scale_num, then the taps of both axes in scaled pixels.
  void prepare_taps(decode_info& info, int size) {
    // jpeg_calc_output_dimensions: ceil(dim * n / 8), as libjpeg computes it.
    info.scaled_width = static_cast<int>((static_cast<long long>(info.header.width) * info.scale_num + 7) / 8);
    info.scaled_height = static_cast<int>((static_cast<long long>(info.header.height) * info.scale_num + 7) / 8);
    taps(info, size);
  }

  void taps(const decode_info& info, int size) {
    const double s = info.scale_num / 8.0;
    const crop_rect& r = info.plan.rect;
    const std::size_t S = static_cast<std::size_t>(size);
    x0_.resize(S), x1_.resize(S), fx_.resize(S), y0_.resize(S), y1_.resize(S), fy_.resize(S);
    jpeg_detail::axis_taps(r.x * s, r.w * s, size, info.scaled_width, info.plan.flip, x0_.data(), x1_.data(), fx_.data());
    jpeg_detail::axis_taps(r.y * s, r.h * s, size, info.scaled_height, false, y0_.data(), y1_.data(), fy_.data());
    xlo_ = *std::min_element(x0_.begin(), x0_.end());
    xhi_ = *std::max_element(x1_.begin(), x1_.end());
    ylo_ = y0_.front();
    yhi_ = y1_.back();
    hrow_[0].resize(3 * S);
    hrow_[1].resize(3 * S);
    off0_.resize(S), off1_.resize(S);
    // Which scaled rows a tap reads; a downscale by more than 2 skips some.
    needed_.assign(static_cast<std::size_t>(yhi_ - ylo_ + 1), 0);
    for (std::size_t o = 0; o < S; ++o) needed_[y0_[o] - ylo_] = needed_[y1_[o] - ylo_] = 1;
  }

  // Decodes rows [ylo - margin, yhi] of columns [xlo - margin, xhi + margin] (libjpeg widens the
  // columns to iMCU boundaries) and streams them through the resize.
  bool decode_rows(decode_info& info, int size, const normaliser& norm, float* out) {
    if (setjmp(err_.jump)) return false;
    set_output(info.scale_num);
    jpeg_start_decompress(&cinfo_);
    // libjpeg's own size must agree with the taps' (it does: both are ceil(dim * n / 8)).
    if (static_cast<int>(cinfo_.output_width) != info.scaled_width || static_cast<int>(cinfo_.output_height) != info.scaled_height)
      ERREXIT(&cinfo_, JERR_BAD_DCTSIZE);
    JDIMENSION xoff = static_cast<JDIMENSION>(std::max(0, xlo_ - margin));
    JDIMENSION width = static_cast<JDIMENSION>(std::min(info.scaled_width, xhi_ + 1 + margin)) - xoff;
    jpeg_crop_scanline(&cinfo_, &xoff, &width);
    info.col0 = static_cast<int>(xoff);
    info.cols = static_cast<int>(width);
    const int first = std::max(0, ylo_ - margin);
    info.row0 = first;
    info.rows = yhi_ + 1 - first;
    const std::size_t ncomp = cmyk_ ? 4 : 3;
    // + pad: lerp_taps reads past the last tap (jpeg_detail::row_pad).
    if (scanline_.size() < width * ncomp + pad) scanline_.resize(width * ncomp + pad);
    if (cmyk_ && rgb_.size() < width * 3 + pad) rgb_.resize(width * 3 + pad);
    if (first > 0) jpeg_skip_scanlines(&cinfo_, static_cast<JDIMENSION>(first));
    row0_ = first;
    stream(size, norm, out, [this](int) { return next_scanline(); }, static_cast<int>(xoff));
    return true;
  }

  bool decode_all(int scale_num) {
    if (setjmp(err_.jump)) return false;
    set_output(scale_num);
    jpeg_start_decompress(&cinfo_);
    const std::size_t w = cinfo_.output_width, ncomp = cmyk_ ? 4 : 3;
    full_.resize(static_cast<std::size_t>(cinfo_.output_height) * w * 3);
    if (scanline_.size() < w * ncomp + pad) scanline_.resize(w * ncomp + pad);
    if (cmyk_ && rgb_.size() < w * 3 + pad) rgb_.resize(w * 3 + pad);
    for (std::size_t r = 0; r < cinfo_.output_height; ++r) std::memcpy(full_.data() + r * w * 3, next_scanline(), w * 3);
    return true;
  }

  // One more decoded row as (cols, 3) RGB bytes.
  const std::uint8_t* next_scanline() {
    JSAMPROW row = scanline_.data();
    if (jpeg_read_scanlines(&cinfo_, &row, 1) != 1) ERREXIT(&cinfo_, JERR_INPUT_EOF);  // cannot suspend: a memory source
    if (!cmyk_) return scanline_.data();
    const std::size_t w = cinfo_.output_width;
    const std::uint8_t* p = scanline_.data();
    std::uint8_t* q = rgb_.data();
    for (std::size_t i = 0; i < w; ++i, p += 4, q += 3) {
      const unsigned k = adobe_ ? p[3] : 255u - p[3];
      for (int c = 0; c < 3; ++c) q[c] = static_cast<std::uint8_t>(((adobe_ ? p[c] : 255u - p[c]) * k + 127) / 255);
    }
    return rgb_.data();
  }

  // The resize: rows row0_, row0_ + 1, ... come from row(r) as RGB bytes whose first pixel is
  // scaled column `col0`; every needed row is resampled horizontally into hrow_[r & 1], and
  // output row oy is written as soon as its lower tap row has arrived.
  template <class RowSource>
  void stream(int size, const normaliser& norm, float* out, RowSource&& row, int col0) {
    const std::size_t S = static_cast<std::size_t>(size), plane = S * S;
    for (std::size_t o = 0; o < S; ++o) {  // byte offsets of the taps in a row that starts at col0
      off0_[o] = 3 * (x0_[o] - col0);
      off1_[o] = 3 * (x1_[o] - col0);
    }
    grp_base_.resize(S / 16 + 1);
    grp_idx_.resize(64 * (S / 16 + 1));
    jpeg_detail::permute_groups(off0_.data(), S, grp_base_.data(), grp_idx_.data());
    int oy = 0;
    for (int r = row0_; r <= yhi_ && oy < size; ++r) {
      const std::uint8_t* p = row(r);
      if (r < ylo_ || !needed_[static_cast<std::size_t>(r - ylo_)]) continue;
      jpeg_detail::lerp_taps(p, off0_.data(), off1_.data(), fx_.data(), S, grp_base_.data(), grp_idx_.data(),
                             hrow_[r & 1].data());
      for (; oy < size && y1_[static_cast<std::size_t>(oy)] <= r; ++oy) {
        const float* top = hrow_[y0_[static_cast<std::size_t>(oy)] & 1].data();
        const float* bot = hrow_[y1_[static_cast<std::size_t>(oy)] & 1].data();
        const float f = fy_[static_cast<std::size_t>(oy)];
        if (channels_last) {  // (size, size, 3): the same operations, stored interleaved
          float* o = out + static_cast<std::size_t>(oy) * S * 3;
          for (std::size_t ox = 0; ox < S; ++ox)
            for (std::size_t c = 0; c < 3; ++c) {
              const float t = top[c * S + ox], u = bot[c * S + ox];
              o[3 * ox + c] = (t + f * (u - t)) * norm.mul[c] + norm.add[c];
            }
          continue;
        }
        for (std::size_t c = 0; c < 3; ++c) {
          float* o = out + c * plane + static_cast<std::size_t>(oy) * S;
          const float* t = top + c * S;
          const float* u = bot + c * S;
          const float m = norm.mul[c], d = norm.add[c];
          for (std::size_t ox = 0; ox < S; ++ox) o[ox] = (t[ox] + f * (u[ox] - t[ox])) * m + d;
        }
      }
    }
  }

  static constexpr std::size_t pad = jpeg_detail::row_pad;
  jpeg_decompress_struct cinfo_{};
  jpeg_detail::error_manager err_{};
  bool cmyk_ = false, adobe_ = false;
  std::vector<std::uint8_t> scanline_, rgb_, full_;
  std::vector<int> x0_, x1_, y0_, y1_, off0_, off1_;
  std::vector<float> fx_, fy_;
  std::vector<char> needed_;
  std::vector<int> grp_base_;
  std::vector<std::uint8_t> grp_idx_;
  std::vector<float> hrow_[2];
  int xlo_ = 0, xhi_ = 0, ylo_ = 0, yhi_ = 0, row0_ = 0;
};

}  // namespace sample
