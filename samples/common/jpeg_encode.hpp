// samples/common/jpeg_encode.hpp: compress pixels to a JPEG in memory with libjpeg-turbo.
//
// Purpose: the writing side the samples need: the Fashion-MNIST -> JPEG folder tool, and the tests
// and the fuzzer's corpus, which make their JPEGs here rather than committing binary files.
// Limits: 8-bit gray, RGB or CMYK input; libjpeg's errors become a std::runtime_error (they can
// only come from bad arguments: compression of valid pixels cannot fail).
#pragma once

#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <jpeglib.h>

#include <csetjmp>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace sample {

struct jpeg_encode_options {
  int quality = 90;
  int h_sampling = 2, v_sampling = 2;  // luma sampling factors: 2x2 is 4:2:0 (libjpeg's default), 1x1 is 4:4:4
  bool progressive = false;
  int restart_rows = 0;                 // a restart marker every this many MCU rows (0: none)
  bool adobe_cmyk = true;               // CMYK input: write Adobe's inverted CMYK (as Photoshop does)
};

namespace jpeg_encode_detail {

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

// The setjmp frame: no object with a destructor; the output buffer is malloc'ed by libjpeg.
inline bool compress(const std::uint8_t* pixels, int width, int height, int components, const jpeg_encode_options& o,
                     jpeg_compress_struct* c, error_manager* err, unsigned char** buf, unsigned long* size) {
  if (setjmp(err->jump)) return false;
  jpeg_create_compress(c);
  jpeg_mem_dest(c, buf, size);
  c->image_width = static_cast<JDIMENSION>(width);
  c->image_height = static_cast<JDIMENSION>(height);
  c->input_components = components;
  c->in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(c);
  jpeg_set_quality(c, o.quality, TRUE);
  if (components == 3) {
    c->comp_info[0].h_samp_factor = o.h_sampling;
    c->comp_info[0].v_samp_factor = o.v_sampling;
  }
  if (components == 4) {
    jpeg_set_colorspace(c, JCS_CMYK);
    c->write_Adobe_marker = o.adobe_cmyk ? TRUE : FALSE;
  }
  if (o.progressive) jpeg_simple_progression(c);
  c->restart_in_rows = o.restart_rows;
  jpeg_start_compress(c, TRUE);
  const std::size_t stride = static_cast<std::size_t>(width) * static_cast<std::size_t>(components);
  while (c->next_scanline < c->image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(pixels + c->next_scanline * stride);
    jpeg_write_scanlines(c, &row, 1);
  }
  jpeg_finish_compress(c);
  return true;
}

}  // namespace jpeg_encode_detail

// pixels (height, width, components), components 1 (gray), 3 (RGB) or 4 (CMYK) -> the JPEG file's bytes.
inline std::vector<std::uint8_t> encode_jpeg(const std::uint8_t* pixels, int width, int height, int components,
                                             const jpeg_encode_options& o = {}) {
  if (width <= 0 || height <= 0 || (components != 1 && components != 3 && components != 4))
    throw std::runtime_error("encode_jpeg: " + std::to_string(width) + "x" + std::to_string(height) + "x" +
                             std::to_string(components) + " is not an image it can write");
  jpeg_compress_struct c{};
  jpeg_encode_detail::error_manager err{};
  c.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_encode_detail::on_error;
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const bool ok = jpeg_encode_detail::compress(pixels, width, height, components, o, &c, &err, &buf, &size);
  std::vector<std::uint8_t> out;
  if (ok) out.assign(buf, buf + size);
  jpeg_destroy_compress(&c);
  std::free(buf);
  if (!ok) throw std::runtime_error(std::string("encode_jpeg: libjpeg: ") + err.message);
  return out;
}

}  // namespace sample
