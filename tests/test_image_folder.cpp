// The ImageNet input pipeline (samples/common/image_folder.hpp) and its fused JPEG decoder
// (samples/common/jpeg.hpp): the fused decode-crop against a full decode, the crop planners,
// bad files, folder listing, sharding, determinism, validation and synthetic mode.
//
// Every JPEG is made here with libjpeg (samples/common/jpeg_encode.hpp): small, seeded.
// Tolerances:
//   fused vs full decode at the same DCT scale, then the same resize: exact (0). The decoder asks
//     libjpeg for 2 pixels beyond its taps on each side, so libjpeg's documented cropped-edge
//     difference of fancy upsampling never reaches a tap (without that margin it reaches 10.5 of
//     255 levels on these images).
//   the resize against an independent bilinear written here, over a full-resolution decode: 1e-4
//     (float rounding of a differently ordered sum).
//   a DCT-scaled decode (n/8 < 1) against full-resolution decode + the same bilinear: mean |diff|
//     under 2.5 and max under 40 levels of 255 on these smooth images: the IDCT's box-like filter
//     is not bilinear point sampling, so only closeness is claimed.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../samples/common/image_folder.hpp"
#include "../samples/common/jpeg_encode.hpp"

namespace fs = std::filesystem;
using sample::crop_plan;
using sample::crop_rect;
using sample::data_error;

namespace {

// A seeded image with smooth shapes, edges and some texture: (h, w, comps) bytes.
std::vector<std::uint8_t> test_image(int w, int h, int comps, std::uint64_t seed) {
  sample::rng g{seed};
  const double a = 0.02 + 0.05 * g.uniform(), b = 0.03 + 0.04 * g.uniform(), ph = 6.28 * g.uniform();
  std::vector<std::uint8_t> px(static_cast<std::size_t>(w) * h * comps);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < comps; ++c) {
        double v = 128 + 80 * std::sin(a * x * (c + 1) + ph) * std::cos(b * y + c) + ((x / 9 + y / 7) % 2 ? 30 : -30);
        v += static_cast<double>(g.next() % 17) - 8;
        px[(static_cast<std::size_t>(y) * w + x) * comps + c] = static_cast<std::uint8_t>(std::clamp(v, 0.0, 255.0));
      }
  return px;
}

std::vector<std::uint8_t> test_jpeg(int w, int h, int comps = 3, sample::jpeg_encode_options o = {}, std::uint64_t seed = 7) {
  const auto px = test_image(w, h, comps, seed);
  return sample::encode_jpeg(px.data(), w, h, comps, o);
}

const sample::normaliser unit = sample::normaliser::of({0, 0, 0}, {1.0f / 255, 1.0f / 255, 1.0f / 255});  // v -> v

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const data_error& e) {
    return e.what();
  }
  return "(no error)";
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

struct temp_dir {
  std::string path;
  explicit temp_dir(const std::string& tag) {
    path = (fs::temp_directory_path() / ("lockstep-imgfolder-" + tag + "-" + std::to_string(::getpid()))).string();
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& b) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  REQUIRE(f.good());
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

// A random plan inside a w x h image (the crops of the tests, not RandomResizedCrop's).
crop_plan random_plan(int w, int h, sample::rng& g) {
  crop_plan p;
  p.rect.w = 1 + g.uniform() * (w - 1);
  p.rect.h = 1 + g.uniform() * (h - 1);
  p.rect.x = g.uniform() * (w - p.rect.w);
  p.rect.y = g.uniform() * (h - p.rect.h);
  p.flip = g.next() & 1;
  return p;
}

}  // namespace

TEST_CASE("the fused decode-crop equals a full decode at the same DCT scale, cropped and resized the same way", "[jpeg]") {
  struct variant {
    const char* what;
    int w, h, comps;
    sample::jpeg_encode_options o;
  };
  sample::jpeg_encode_options s444, s422, prog, rst;
  s444.h_sampling = s444.v_sampling = 1;
  s422.v_sampling = 1;
  prog.progressive = true;
  rst.restart_rows = 1;
  const std::vector<variant> variants = {
      {"4:2:0 baseline", 173, 131, 3, {}}, {"4:4:4", 97, 113, 3, s444}, {"4:2:2", 150, 89, 3, s422},
      {"progressive 4:2:0", 161, 120, 3, prog}, {"restart markers", 128, 96, 3, rst}, {"grayscale", 139, 101, 1, {}},
      {"CMYK (Adobe)", 77, 66, 4, {}}};
  sample::jpeg_decoder dec;
  sample::rng g{42};
  // Every IDCT size, not only the default SIMD ones; and 8/8 only, where the bilinear step
  // downscales by up to 11x (the resize's wide-group path).
  for (const variant& v : variants)
   for (unsigned scales : {sample::all_scales, 0x80u}) {
    dec.scales = scales;
    INFO(v.what << ", scales 0x" << std::hex << scales << std::dec);
    const auto jpg = test_jpeg(v.w, v.h, v.comps, v.o);
    for (int size : {1, 7, 16, 33}) {
      for (int t = 0; t < 25; ++t) {
        const crop_plan plan = random_plan(v.w, v.h, g);
        std::vector<float> fused(3 * static_cast<std::size_t>(size) * size), ref(fused.size());
        const sample::decode_info info = dec.decode(jpg.data(), jpg.size(), "t.jpg", [&](const sample::jpeg_header& hd) {
          REQUIRE(hd.width == v.w);
          REQUIRE(hd.height == v.h);
          return plan;
        }, size, unit, fused.data());
        CHECK(info.scale_num == sample::choose_scale(plan.rect, size, scales));
        int fw = 0, fh = 0;
        const auto full = dec.decode_full(jpg.data(), jpg.size(), "t.jpg", info.scale_num, &fw, &fh);
        REQUIRE(fw == info.scaled_width);
        REQUIRE(fh == info.scaled_height);
        dec.resample(full.data(), fw, fh, plan, info.scale_num, size, unit, ref.data());
        INFO("size " << size << " crop " << plan.rect.x << "," << plan.rect.y << " " << plan.rect.w << "x" << plan.rect.h
                     << " flip " << plan.flip << " scale " << info.scale_num << "/8, decoded columns " << info.col0 << "+"
                     << info.cols << " rows " << info.row0 << "+" << info.rows);
        REQUIRE(max_abs_diff(fused, ref) == 0.0);
        // The decode read only what the crop needs: columns and rows inside the image, and no row
        // below the crop's last (plus one for the bilinear tap).
        CHECK(info.col0 >= 0);
        CHECK(info.col0 + info.cols <= info.scaled_width);
        CHECK(info.row0 + info.rows <= std::min(info.scaled_height, static_cast<int>(std::ceil((plan.rect.y + plan.rect.h) * info.scale_num / 8)) + 1));
      }
    }
  }
}

TEST_CASE("the resize is bilinear between pixel centres, flipped on request, normalised per channel", "[jpeg]") {
  // An independent bilinear over the whole image decoded at the same DCT scale.
  const int W = 120, H = 90, S = 24;
  const auto jpg = test_jpeg(W, H);
  sample::jpeg_decoder dec;
  const auto norm = sample::normaliser::of({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
  sample::rng g{3};
  for (int t = 0; t < 40; ++t) {
    crop_plan plan = random_plan(W, H, g);
    std::vector<float> out(3 * S * S);
    const auto info = dec.decode(jpg.data(), jpg.size(), "r.jpg", [&](const sample::jpeg_header&) { return plan; }, S, norm, out.data());
    // The reference reads the whole image at the decode's DCT scale, in that image's pixels.
    int W_, H_;
    const auto full = dec.decode_full(jpg.data(), jpg.size(), "r.jpg", info.scale_num, &W_, &H_);
    const double k = info.scale_num / 8.0;
    const float mean[3] = {0.485f, 0.456f, 0.406f}, sd[3] = {0.229f, 0.224f, 0.225f};
    double worst = 0;
    for (int c = 0; c < 3; ++c)
      for (int oy = 0; oy < S; ++oy)
        for (int ox = 0; ox < S; ++ox) {
          const int src_x = plan.flip ? S - 1 - ox : ox;
          const double sx = std::clamp(k * plan.rect.x + (src_x + 0.5) * k * plan.rect.w / S - 0.5, 0.0, W_ - 1.0);
          const double sy = std::clamp(k * plan.rect.y + (oy + 0.5) * k * plan.rect.h / S - 0.5, 0.0, H_ - 1.0);
          const int x0 = static_cast<int>(sx), y0 = static_cast<int>(sy);
          const int x1 = std::min(x0 + 1, W_ - 1), y1 = std::min(y0 + 1, H_ - 1);
          auto at = [&](int x, int y) { return static_cast<double>(full[(static_cast<std::size_t>(y) * W_ + x) * 3 + c]); };
          const double fx = sx - x0, fy = sy - y0;
          const double v = (1 - fy) * ((1 - fx) * at(x0, y0) + fx * at(x1, y0)) + fy * ((1 - fx) * at(x0, y1) + fx * at(x1, y1));
          const double want = (v / 255.0 - mean[c]) / sd[c];
          worst = std::max(worst, std::fabs(want - out[(static_cast<std::size_t>(c) * S + oy) * S + ox]));
        }
    INFO("crop " << plan.rect.x << "," << plan.rect.y << " " << plan.rect.w << "x" << plan.rect.h << " flip " << plan.flip
                  << " scale " << info.scale_num);
    REQUIRE(worst < 1e-4);
  }
}

TEST_CASE("DCT scaling: the smallest n/8 that covers the output, close to a full-resolution decode", "[jpeg]") {
  CHECK(sample::choose_scale({0, 0, 1792, 1792}, 224) == 1);
  CHECK(sample::choose_scale({0, 0, 1791, 1792}, 224) == 2);
  CHECK(sample::choose_scale({0, 0, 300, 300}, 224) == 6);   // 300 * 5/8 = 187 < 224 <= 225 = 300 * 6/8
  CHECK(sample::choose_scale({0, 0, 400, 260}, 224) == 7);   // the shorter side decides
  CHECK(sample::choose_scale({0, 0, 224, 224}, 224) == 8);
  CHECK(sample::choose_scale({0, 0, 50, 40}, 224) == 8);     // upscaling: never the IDCT
  // The decoder's default: only 1/8, 2/8, 4/8 and 8/8 (libjpeg-turbo's SIMD IDCTs).
  CHECK(sample::choose_scale({0, 0, 300, 300}, 224, sample::simd_scales) == 8);
  CHECK(sample::choose_scale({0, 0, 448, 500}, 224, sample::simd_scales) == 4);
  CHECK(sample::choose_scale({0, 0, 1000, 900}, 224, sample::simd_scales) == 2);
  CHECK(sample::choose_scale({0, 0, 1792, 1800}, 224, sample::simd_scales) == 1);
  CHECK(sample::jpeg_decoder{}.scales == sample::simd_scales);

  // A smooth image (no texture above the output's Nyquist rate): the scaled decode is close to
  // the full one resampled by the same bilinear taps.
  const int W = 320, H = 256, S = 32;
  std::vector<std::uint8_t> px(static_cast<std::size_t>(W) * H * 3);
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x)
      for (int c = 0; c < 3; ++c)
        px[(static_cast<std::size_t>(y) * W + x) * 3 + c] =
            static_cast<std::uint8_t>(128 + 100 * std::sin(0.013 * x * (c + 1)) * std::cos(0.017 * y + c));
  const auto jpg = sample::encode_jpeg(px.data(), W, H, 3);
  sample::jpeg_decoder dec;
  dec.scales = sample::all_scales;
  int fw, fh;
  const auto full = dec.decode_full(jpg.data(), jpg.size(), "s.jpg", 8, &fw, &fh);
  sample::rng g{5};
  std::set<int> scales;
  for (int t = 0; t < 30; ++t) {
    crop_plan plan = random_plan(W, H, g);
    plan.rect.w = std::max(plan.rect.w, 60.0);
    plan.rect.h = std::max(plan.rect.h, 60.0);
    plan.rect.x = std::min(plan.rect.x, W - plan.rect.w);
    plan.rect.y = std::min(plan.rect.y, H - plan.rect.h);
    std::vector<float> scaled(3 * S * S), ref(scaled.size());
    const auto info = dec.decode(jpg.data(), jpg.size(), "s.jpg", [&](const sample::jpeg_header&) { return plan; }, S, unit, scaled.data());
    scales.insert(info.scale_num);
    dec.resample(full.data(), fw, fh, plan, 8, S, unit, ref.data());
    double sum = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) sum += std::fabs(scaled[i] - ref[i]);
    INFO("scale " << info.scale_num << "/8 crop " << plan.rect.w << "x" << plan.rect.h);
    CHECK(sum / ref.size() < 2.5);
    CHECK(max_abs_diff(scaled, ref) < 40);
  }
  CHECK(scales.size() >= 4);  // the crops exercised several scales
}

TEST_CASE("channels_last writes the same values interleaved", "[jpeg]") {
  const int S = 19;
  const auto jpg = test_jpeg(90, 70);
  const auto norm = sample::normaliser::of({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
  sample::jpeg_decoder nchw, nhwc;
  nhwc.channels_last = true;
  sample::rng g{8};
  for (int t = 0; t < 10; ++t) {
    const crop_plan plan = random_plan(90, 70, g);
    std::vector<float> a(3 * S * S), b(a.size());
    nchw.decode(jpg.data(), jpg.size(), "l.jpg", [&](const sample::jpeg_header&) { return plan; }, S, norm, a.data());
    nhwc.decode(jpg.data(), jpg.size(), "l.jpg", [&](const sample::jpeg_header&) { return plan; }, S, norm, b.data());
    for (int c = 0; c < 3; ++c)
      for (int p = 0; p < S * S; ++p) REQUIRE(b[static_cast<std::size_t>(p) * 3 + c] == a[static_cast<std::size_t>(c) * S * S + p]);
  }
}

TEST_CASE("grayscale comes out as three equal channels; CMYK is converted to RGB", "[jpeg]") {
  sample::jpeg_decoder dec;
  const int S = 8;
  std::vector<float> out(3 * S * S);
  const auto gray = test_jpeg(40, 30, 1);
  crop_plan plan{{0, 0, 40, 30}, false};
  dec.decode(gray.data(), gray.size(), "g.jpg", [&](const sample::jpeg_header& h) {
    CHECK(h.components == 1);
    return plan;
  }, S, unit, out.data());
  for (int i = 0; i < S * S; ++i) {
    REQUIRE(out[i] == out[S * S + i]);
    REQUIRE(out[i] == out[2 * S * S + i]);
  }
  // Flat CMYK colours: C, M, Y, K in ink fractions; RGB = 255 (1 - C)(1 - K) and so on.
  for (bool adobe : {true, false}) {
    const std::uint8_t ink[4] = {51, 102, 0, 64};  // C 0.2, M 0.4, Y 0, K 0.25
    std::vector<std::uint8_t> px(16 * 16 * 4);
    for (std::size_t i = 0; i < px.size(); ++i) px[i] = adobe ? static_cast<std::uint8_t>(255 - ink[i % 4]) : ink[i % 4];
    sample::jpeg_encode_options o;
    o.adobe_cmyk = adobe;
    const auto cmyk = sample::encode_jpeg(px.data(), 16, 16, 4, o);
    dec.decode(cmyk.data(), cmyk.size(), "c.jpg", [](const sample::jpeg_header& h) {
      CHECK(h.components == 4);
      return crop_plan{{0, 0, 16, 16}, false};
    }, S, unit, out.data());
    const double want[3] = {255 * 0.8 * 0.75, 255 * 0.6 * 0.75, 255 * 1.0 * 0.75};
    for (int c = 0; c < 3; ++c) CHECK(std::fabs(out[static_cast<std::size_t>(c) * S * S + 27] - want[c]) < 3.0);
  }
}

TEST_CASE("RandomResizedCrop and the centre crop follow torchvision's rules", "[jpeg][crop]") {
  sample::rng g{11};
  int fallbacks = 0;
  for (int t = 0; t < 2000; ++t) {
    const int w = 1 + static_cast<int>(g.next() % 600), h = 1 + static_cast<int>(g.next() % 600);
    const crop_rect r = sample::random_resized_crop(w, h, g);
    INFO(w << "x" << h << " -> " << r.x << "," << r.y << " " << r.w << "x" << r.h);
    REQUIRE(r.w >= 1);
    REQUIRE(r.h >= 1);
    REQUIRE(r.x >= 0);
    REQUIRE(r.y >= 0);
    REQUIRE(r.x + r.w <= w);
    REQUIRE(r.y + r.h <= h);
    REQUIRE(r.x == std::floor(r.x));
    REQUIRE(r.w == std::floor(r.w));
    const double area = r.w * r.h / (static_cast<double>(w) * h), ratio = r.w / r.h;
    // Rounding w and h to whole pixels moves the area and ratio by at most a pixel's worth.
    const bool in_range = area >= 0.08 * (1 - 2.0 / std::min(r.w, r.h)) - 1e-9 && ratio >= 0.75 * (1 - 1.0 / r.h) - 1e-9 &&
                          ratio <= 4.0 / 3.0 * (1 + 1.0 / r.w) + 1e-9;
    if (!in_range) ++fallbacks;  // the centre crop after 10 failed draws: only for extreme shapes
    if (!in_range) REQUIRE((static_cast<double>(w) / h < 0.5 || static_cast<double>(w) / h > 2 || std::min(w, h) < 8));
  }
  CHECK(fallbacks < 400);
  // An image far wider than 4:3 falls back to its centre crop of ratio 4/3 when no draw fits.
  sample::rng g2{1};
  const crop_rect wide = sample::random_resized_crop(1000, 10, g2);
  CHECK(wide.h <= 10);
  // Validation: the centre square of 7/8 of the shorter side.
  const crop_rect c = sample::centre_crop(400, 320);
  CHECK(c.w == 280);
  CHECK(c.h == 280);
  CHECK(c.x == 60);
  CHECK(c.y == 20);
  // crop_pct (timm's name): the share of the shorter side kept; 1 is the whole centre square.
  const crop_rect whole = sample::centre_crop(400, 320, 1.0);
  CHECK((whole.x == 40 && whole.y == 0 && whole.w == 320 && whole.h == 320));
  const crop_rect half = sample::centre_crop(33, 65, 0.5);
  CHECK((half.w == 16.5 && half.h == 16.5 && half.x == 8.25 && half.y == 24.25));
  for (double bad : {0.0, -0.5, 1.0001, std::nan("")}) {
    sample::image_pipeline_options o;
    o.synthetic = true;
    o.crop_pct = bad;
    INFO("crop_pct " << bad);
    CHECK_THROWS_WITH(sample::image_pipeline(o), Catch::Contains("crop_pct") && Catch::Contains("must be in (0, 1]"));
  }
}

TEST_CASE("bad JPEGs are a data_error naming the file: truncated, flipped bytes, empty, PNG renamed", "[jpeg][bad]") {
  sample::jpeg_decoder dec;
  const int S = 16;
  std::vector<float> out(3 * S * S);
  sample::jpeg_encode_options prog;
  prog.progressive = true;
  for (const auto& [what, jpg] : {std::pair{"baseline", test_jpeg(96, 80)}, std::pair{"progressive", test_jpeg(96, 80, 3, prog)}}) {
    INFO(what);
    // A crop of the top-left corner: the rows below it are never decoded, so only the
    // end-of-image check can see a cut there.
    for (const crop_plan& plan : {crop_plan{{0, 0, 20, 16}, false}, crop_plan{{0, 0, 96, 80}, true}}) {
      auto decode = [&](const std::vector<std::uint8_t>& b) {
        dec.decode(b.data(), b.size(), "dir/cut.JPEG", [&](const sample::jpeg_header&) { return plan; }, S, unit, out.data());
      };
      REQUIRE(error_of([&] { decode(jpg); }) == "(no error)");
      for (int tenth = 1; tenth <= 9; ++tenth) {
        std::vector<std::uint8_t> cut(jpg.begin(), jpg.begin() + static_cast<std::ptrdiff_t>(jpg.size() * tenth / 10));
        const std::string e = error_of([&] { decode(cut); });
        INFO("cut at " << tenth * 10 << "%: " << e);
        CHECK(starts_with(e, "dir/cut.JPEG: "));
        CHECK((e.find("truncated") != std::string::npos || e.find("corrupt") != std::string::npos));
      }
      std::vector<std::uint8_t> no_eoi(jpg.begin(), jpg.end() - 2);
      CHECK(starts_with(error_of([&] { decode(no_eoi); }), "dir/cut.JPEG: truncated JPEG"));
      // Trailing bytes after the end-of-image marker are allowed.
      std::vector<std::uint8_t> trailing = jpg;
      trailing.insert(trailing.end(), 100, 0x00);
      CHECK(error_of([&] { decode(trailing); }) == "(no error)");
    }
  }
  const auto jpg = test_jpeg(64, 48);
  auto decode = [&](const std::vector<std::uint8_t>& b) {
    dec.decode(b.data(), b.size(), "x/bad.JPEG", [](const sample::jpeg_header& h) {
      return crop_plan{{0, 0, static_cast<double>(h.width), static_cast<double>(h.height)}, false};
    }, S, unit, out.data());
  };
  CHECK(error_of([&] { decode({}); }) == "x/bad.JPEG: empty file (0 bytes), not a JPEG");
  const std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R', 0, 0, 0, 1};
  CHECK(error_of([&] { decode(png); }) == "x/bad.JPEG: a PNG file, not a JPEG (renamed?)");
  CHECK(starts_with(error_of([&] { decode({'h', 'e', 'l', 'l', 'o'}); }), "x/bad.JPEG: not a JPEG"));
  // Flipped bytes in the markers and tables: each must be an error. Offsets of the markers:
  auto find_marker = [&](std::uint8_t m) {
    for (std::size_t i = 0; i + 1 < jpg.size(); ++i)
      if (jpg[i] == 0xFF && jpg[i + 1] == m) return i;
    FAIL("marker not found");
    return std::size_t{0};
  };
  const std::size_t sof = find_marker(0xC0), sos = find_marker(0xDA), dht = find_marker(0xC4);
  const std::vector<std::pair<const char*, std::size_t>> must_fail = {
      {"SOI", 1}, {"SOF marker", sof + 1}, {"SOF precision", sof + 4}, {"SOF components", sof + 9},
      {"SOS marker", sos + 1}, {"SOS length", sos + 3}, {"DHT class", dht + 4}};
  for (const auto& [where, at] : must_fail) {
    std::vector<std::uint8_t> b = jpg;
    b[at] ^= 0xFF;
    const std::string e = error_of([&] { decode(b); });
    INFO(where << " flipped: " << e);
    CHECK(starts_with(e, "x/bad.JPEG: "));
  }
  // Random flips anywhere: a data_error naming the file, or a decode (JPEG has no checksum:
  // entropy-coded data that still parses gives other pixels, in every decoder). Never a crash
  // or another exception.
  sample::rng g{99};
  int errors = 0;
  for (int t = 0; t < 300; ++t) {
    std::vector<std::uint8_t> b = jpg;
    for (int k = 0; k < 1 + t % 4; ++k) b[g.next() % b.size()] ^= static_cast<std::uint8_t>(1 + g.next() % 255);
    const std::string e = error_of([&] { decode(b); });
    if (e != "(no error)") {
      ++errors;
      INFO(e);
      REQUIRE(starts_with(e, "x/bad.JPEG: "));
    }
  }
  CHECK(errors > 30);
  // The decoder is still usable after all those errors.
  CHECK(error_of([&] { decode(jpg); }) == "(no error)");
  // A file without its quantization tables (its DQT segments cut out) is an error even right after
  // a file that had them: a reused libjpeg object would keep the previous file's tables and decode
  // it (found by fuzz_jpeg: then the result depends on what the thread decoded before). (Without
  // DHT segments libjpeg-turbo uses the standard Huffman tables, as Motion-JPEG expects: decodable.)
  for (std::uint8_t marker : {std::uint8_t{0xDB}}) {
    std::vector<std::uint8_t> cut;
    for (std::size_t i = 0; i < jpg.size();) {
      if (i + 3 < jpg.size() && jpg[i] == 0xFF && jpg[i + 1] == marker) {
        i += 2 + (std::size_t{jpg[i + 2]} << 8 | jpg[i + 3]);
        continue;
      }
      cut.push_back(jpg[i++]);
    }
    REQUIRE(cut.size() < jpg.size());
    REQUIRE(error_of([&] { decode(jpg); }) == "(no error)");
    const std::string e = error_of([&] { decode(cut); });
    INFO(e);
    CHECK(starts_with(e, "x/bad.JPEG: corrupt JPEG (libjpeg: "));
    CHECK((e.find("table") != std::string::npos));
  }
}

namespace {

// A folder of flat-colour JPEGs whose red channel encodes the file's index and green its class.
struct coded_folder {
  temp_dir dir;
  std::vector<std::string> paths;  // in the listing's order
  int classes;
  coded_folder(const std::string& tag, int classes_, int per_class, int val_per_class = 0)
      : dir(tag), classes(classes_) {
    int index = 0;
    for (const auto& [split, n] : {std::pair{"train", per_class}, std::pair{"val", val_per_class}}) {
      if (n == 0) continue;
      for (int c = 0; c < classes; ++c) {
        for (int i = 0; i < n; ++i, ++index) {
          const int w = 24 + 8 * (index % 3), h = 20 + 4 * (index % 5);
          std::vector<std::uint8_t> px(static_cast<std::size_t>(w) * h * 3);
          // Blue carries texture, so crops and flips change the output and determinism means something.
          for (int y = 0; y < h; ++y)
            for (int x = 0; x < w; ++x) {
              std::uint8_t* q = &px[(static_cast<std::size_t>(y) * w + x) * 3];
              q[0] = static_cast<std::uint8_t>(8 + 10 * (index % 25));
              q[1] = static_cast<std::uint8_t>(20 + 40 * c);
              q[2] = static_cast<std::uint8_t>(96 + (x * 37 + y * y * 11 + x * y) % 64);
            }
          sample::jpeg_encode_options o;
          o.quality = 95;
          o.h_sampling = o.v_sampling = 1;
          const char* ext[] = {".JPEG", ".jpg", ".jpeg", ".JpG"};
          // One file of each class lies in a sub-folder (ImageFolder walks the class folder).
          const std::string sub = i == 1 ? "/nested" : "";
          const std::string path = dir.path + "/" + split + "/class_" + std::string(1, static_cast<char>('a' + c)) + sub + "/img" +
                                   std::to_string(100 + index) + ext[index % 4];
          write_bytes(path, sample::encode_jpeg(px.data(), w, h, 3, o));
          if (std::string(split) == "train") paths.push_back(path);
        }
      }
      // Not images: ignored.
      write_bytes(dir.path + "/" + split + "/class_a/notes.txt", {'h', 'i'});
    }
  }
};

// The file index a coded image came from (its red channel, normalised with `opts`).
int index_of(const float* img, int size, const sample::image_pipeline_options& o) {
  const float v = img[static_cast<std::size_t>(size / 2) * size + size / 2];
  const double px = (v * o.stddev[0] + o.mean[0]) * 255.0;
  const int idx = static_cast<int>(std::lround((px - 8) / 10));
  INFO("red " << px << " -> file " << idx);
  CHECK(std::fabs(px - (8 + 10 * idx)) < 4);
  return idx;
}

struct epoch_output {
  std::vector<std::vector<float>> images;  // per step (batch, 3, size, size)
  std::vector<std::vector<std::int32_t>> labels;
};

epoch_output run_epoch(sample::image_pipeline& p, const sample::image_pipeline_options& o, int epoch) {
  epoch_output e;
  p.start_epoch(epoch);
  std::vector<float> img(static_cast<std::size_t>(o.batch) * 3 * o.size * o.size);
  std::vector<std::int32_t> lbl(static_cast<std::size_t>(o.batch));
  while (p.next(img.data(), lbl.data())) {
    e.images.push_back(img);
    e.labels.push_back(lbl);
  }
  return e;
}

}  // namespace

TEST_CASE("the folder is listed as torchvision's ImageFolder lists it", "[pipeline]") {
  coded_folder f("list", 3, 4);
  sample::image_pipeline_options o;
  o.dir = f.dir.path;
  o.batch = 2;
  o.size = 8;
  sample::image_pipeline p(o);
  REQUIRE(p.classes() == 3);
  CHECK(p.class_names() == std::vector<std::string>{"class_a", "class_b", "class_c"});
  REQUIRE(p.images() == 12);
  // Files sorted by (folder, name): the nested file of each class comes after its class folder's files.
  std::vector<std::string> want;
  for (int c = 0; c < 3; ++c) {
    std::vector<std::string> top, nested;
    for (int i = 0; i < 4; ++i) (i == 1 ? nested : top).push_back(f.paths[static_cast<std::size_t>(c * 4 + i)]);
    want.insert(want.end(), top.begin(), top.end());
    want.insert(want.end(), nested.begin(), nested.end());
  }
  for (std::size_t i = 0; i < want.size(); ++i) {
    CHECK(p.files()[i].path == want[i]);
    CHECK(p.files()[i].label == static_cast<int>(i / 4));
  }
  CHECK(p.steps_per_epoch() == 6);
}

// Links: a link to a folder elsewhere is followed; a link back to a folder it is inside of (a
// loop) is not (it listed the class's files again at every turn until ELOOP); a .jpg link to
// nothing is listed, and reading it is the error naming it.
TEST_CASE("folder links are followed once, loops are not; a .jpg link to nothing is listed", "[pipeline][bad]") {
  namespace fs = std::filesystem;
  coded_folder f("links", 2, 2);
  const std::string train = f.dir.path + "/train";
  const std::size_t plain = sample::list_image_folder(train).files.size();
  REQUIRE(plain == 4);
  fs::create_directory_symlink("..", train + "/class_a/nested/up");            // class_a/nested/up -> class_a
  fs::create_directory_symlink(train + "/class_a", train + "/class_a/self");   // class_a/self -> class_a
  fs::create_directory_symlink(train + "/class_b", train + "/class_a/other");  // another class's folder: followed
  fs::create_symlink(train + "/gone.jpg", train + "/class_b/dangling.jpg");
  const sample::image_listing l = sample::list_image_folder(train);
  std::vector<std::string> got;
  for (const auto& file : l.files) got.push_back(file.path.substr(train.size() + 1));
  std::string listed;
  for (const auto& g : got) listed += g + " ";
  INFO(listed);
  // class_a: its 2 files, and class_b's 2 and its dangling link through other/; class_b: its 2
  // files and the dangling link.
  CHECK(l.files.size() == 2 + 3 + 3);
  CHECK(std::count_if(got.begin(), got.end(), [](const std::string& s) { return s.find("/up/") != std::string::npos || s.find("/self/") != std::string::npos; }) == 0);
  CHECK(std::count(got.begin(), got.end(), "class_b/dangling.jpg") == 1);
  CHECK(std::count(got.begin(), got.end(), "class_a/other/dangling.jpg") == 1);
  std::vector<std::uint8_t> bytes;
  CHECK_THROWS_WITH(sample::read_file(train + "/class_b/dangling.jpg", bytes),
                    Catch::StartsWith(train + "/class_b/dangling.jpg: cannot open (No such file or directory)"));
}

TEST_CASE("each replica reads its shard; the shards cover every file once per epoch; a global step does not depend on the replica count", "[pipeline]") {
  coded_folder f("shard", 4, 6);  // 24 files
  sample::image_pipeline_options base;
  base.dir = f.dir.path;
  base.size = 12;
  base.seed = 5;
  std::map<int, std::vector<std::vector<float>>> global_steps;  // replicas -> per step, the global batch
  for (const auto& [R, B] : {std::pair{1, 12}, std::pair{2, 6}, std::pair{3, 4}, std::pair{4, 3}}) {
    std::vector<epoch_output> per_rank;
    for (int r = 0; r < R; ++r) {
      sample::image_pipeline_options o = base;
      o.replicas = R, o.rank = r, o.batch = B;
      o.threads = 1 + r % 2;
      sample::image_pipeline p(o);
      REQUIRE(p.steps_per_epoch() == 2);
      per_rank.push_back(run_epoch(p, o, 3));
    }
    std::multiset<int> seen;
    std::vector<std::vector<float>> steps(2);
    const std::size_t per_image = 3 * 12 * 12;
    for (int s = 0; s < 2; ++s)
      for (int r = 0; r < R; ++r) {
        REQUIRE(per_rank[static_cast<std::size_t>(r)].images.size() == 2);
        const auto& imgs = per_rank[static_cast<std::size_t>(r)].images[static_cast<std::size_t>(s)];
        for (int k = 0; k < B; ++k) {
          const int idx = index_of(imgs.data() + k * per_image, 12, base);
          seen.insert(idx);
          REQUIRE(per_rank[static_cast<std::size_t>(r)].labels[static_cast<std::size_t>(s)][static_cast<std::size_t>(k)] == idx / 6);
        }
        steps[static_cast<std::size_t>(s)].insert(steps[static_cast<std::size_t>(s)].end(), imgs.begin(), imgs.end());
      }
    INFO(R << " replicas of batch " << B);
    CHECK(seen == std::multiset<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23});
    global_steps[R] = steps;
  }
  // The same images with the same augmentation at the same global position, bit for bit.
  for (int R : {2, 3, 4}) CHECK(global_steps[R] == global_steps[1]);
}

TEST_CASE("a run is deterministic: threads, prefetch and the cache change nothing; epochs reshuffle", "[pipeline]") {
  coded_folder f("determinism", 3, 7);  // 21 files, batch 4: 5 steps, one file dropped per epoch
  sample::image_pipeline_options o;
  o.dir = f.dir.path;
  o.size = 16;
  o.batch = 4;
  o.seed = 9;
  sample::image_pipeline p1(o);
  const epoch_output a = run_epoch(p1, o, 0);
  REQUIRE(a.images.size() == 5);
  const epoch_output a_again = run_epoch(p1, o, 0);
  CHECK(a.images == a_again.images);
  const epoch_output b = run_epoch(p1, o, 1);
  CHECK(a.images != b.images);
  for (const auto& [threads, prefetch, cache] : {std::tuple{3, 1, false}, std::tuple{2, 4, true}, std::tuple{4, 2, true}}) {
    sample::image_pipeline_options q = o;
    q.threads = threads, q.prefetch = prefetch, q.cache = cache;
    sample::image_pipeline p(q);
    INFO(threads << " threads, prefetch " << prefetch << ", cache " << cache);
    CHECK(run_epoch(p, q, 0).images == a.images);
    CHECK(run_epoch(p, q, 1).images == b.images);
    CHECK(run_epoch(p, q, 1).labels == b.labels);
    if (cache) CHECK(p.cached_bytes() > 0);
  }
  // next_view: the same batches without the copy, unchanged while held even with the workers free
  // to run ahead (prefetch 1: the held slot is the only one).
  for (int prefetch : {1, 3}) {
    sample::image_pipeline_options q = o;
    q.threads = 3;
    q.prefetch = prefetch;
    sample::image_pipeline pv(q);
    pv.start_epoch(0);
    sample::image_pipeline::batch_view v;
    std::size_t s = 0;
    while (pv.next_view(v)) {
      REQUIRE(s < a.images.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      CHECK(std::equal(a.images[s].begin(), a.images[s].end(), v.images));
      CHECK(std::equal(a.labels[s].begin(), a.labels[s].end(), v.labels));
      ++s;
    }
    CHECK(s == a.images.size());
    // Mixed with next(), and across an epoch restart.
    pv.start_epoch(1);
    REQUIRE(pv.next_view(v));
    CHECK(std::equal(b.images[0].begin(), b.images[0].end(), v.images));
    std::vector<float> img(b.images[0].size());
    std::vector<std::int32_t> lbl(4);
    REQUIRE(pv.next(img.data(), lbl.data()));
    CHECK(img == b.images[1]);
  }
  // channels_last: the same epoch, interleaved.
  sample::image_pipeline_options last = o;
  last.channels_last = true;
  last.threads = 2;
  sample::image_pipeline p3(last);
  const epoch_output l = run_epoch(p3, last, 0);
  REQUIRE(l.images.size() == a.images.size());
  CHECK(l.labels == a.labels);
  for (std::size_t s = 0; s < a.images.size(); ++s)
    for (std::size_t k = 0; k < 4; ++k)
      for (std::size_t c = 0; c < 3; ++c)
        for (std::size_t p = 0; p < 256; ++p)
          REQUIRE(l.images[s][(k * 256 + p) * 3 + c] == a.images[s][(k * 3 + c) * 256 + p]);
  // Another seed: another permutation and other crops.
  sample::image_pipeline_options other = o;
  other.seed = 10;
  sample::image_pipeline p2(other);
  CHECK(run_epoch(p2, other, 0).images != a.images);
}

TEST_CASE("validation: file order, centre crop, the last batch padded with label -1", "[pipeline]") {
  coded_folder f("val", 3, 2, 3);  // val: 9 files
  sample::image_pipeline_options o;
  o.dir = f.dir.path;
  o.train = false;
  o.size = 10;
  o.batch = 2;
  o.replicas = 2;
  std::vector<int> order;
  std::size_t padded = 0;
  for (int r = 0; r < 2; ++r) {
    sample::image_pipeline_options q = o;
    q.rank = r;
    q.threads = 2;
    sample::image_pipeline p(q);
    REQUIRE(p.images() == 9);
    REQUIRE(p.steps_per_epoch() == 3);  // ceil(9 / 4)
    const epoch_output e = run_epoch(p, q, 0);
    const epoch_output e2 = run_epoch(p, q, 7);  // no shuffle: any epoch, the same
    CHECK(e.images == e2.images);
    REQUIRE(e.images.size() == 3);
    for (std::size_t s = 0; s < 3; ++s)
      for (int k = 0; k < 2; ++k) {
        const std::size_t pos = (s * 2 + static_cast<std::size_t>(r)) * 2 + static_cast<std::size_t>(k);
        const std::int32_t label = e.labels[s][static_cast<std::size_t>(k)];
        const float* img = e.images[s].data() + static_cast<std::size_t>(k) * 300;
        if (pos >= 9) {
          CHECK(label == -1);
          CHECK(std::all_of(img, img + 300, [](float v) { return v == 0.0f; }));
          ++padded;
          continue;
        }
        CHECK(label == static_cast<std::int32_t>(pos / 3));
        order.push_back(index_of(img, 10, o));
      }
  }
  CHECK(padded == 3);
  std::sort(order.begin(), order.end());
  CHECK(order == std::vector<int>{6, 7, 8, 9, 10, 11, 12, 13, 14});  // the val files' indices
}

TEST_CASE("bad files in a folder: a data_error naming the file, or counted, skipped and replaced deterministically", "[pipeline][bad]") {
  coded_folder f("badfolder", 2, 6);  // 12 files
  const auto good = sample::encode_jpeg(std::vector<std::uint8_t>(40 * 30 * 3, 90).data(), 40, 30, 3);
  const std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n', 0, 0, 0, 0};
  // Three bad files: truncated at half, empty, a PNG renamed.
  write_bytes(f.paths[2], std::vector<std::uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2)));
  write_bytes(f.paths[7], {});
  write_bytes(f.paths[9], png);
  const std::set<std::string> bad = {f.paths[2], f.paths[7], f.paths[9]};
  sample::image_pipeline_options o;
  o.dir = f.dir.path;
  o.size = 8;
  o.batch = 4;
  {
    sample::image_pipeline p(o);
    p.start_epoch(0);
    std::vector<float> img(4 * 3 * 64);
    std::vector<std::int32_t> lbl(4);
    std::string e;
    try {
      while (p.next(img.data(), lbl.data())) {
      }
    } catch (const data_error& x) {
      e = x.what();
    }
    INFO(e);
    bool names_one = false;
    for (const auto& b : bad) names_one |= starts_with(e, b + ": ");
    CHECK(names_one);
  }
  o.skip_bad = true;
  std::vector<epoch_output> runs;
  for (int threads : {1, 3}) {
    sample::image_pipeline_options q = o;
    q.threads = threads;
    sample::image_pipeline p(q);
    runs.push_back(run_epoch(p, q, 0));
    CHECK(p.skipped() == 3);
    runs.push_back(run_epoch(p, q, 1));
    CHECK(p.skipped() == 3);  // each bad file counted once
    for (const auto& l : runs.back().labels)
      for (auto v : l) CHECK((v == 0 || v == 1));
  }
  CHECK(runs[0].images == runs[2].images);
  CHECK(runs[1].labels == runs[3].labels);
  // A bad file's place holds another file of the set (never an all-zero or grey image).
  for (const auto& step : runs[0].images)
    for (int k = 0; k < 4; ++k) {
      const int idx = index_of(step.data() + k * 3 * 64, 8, o);
      CHECK((idx >= 0 && idx < 12 && idx != 2 && idx != 7 && idx != 9));
    }
}

TEST_CASE("synthetic mode: no files, the requested shapes, seeded labels", "[pipeline]") {
  sample::image_pipeline_options o;
  o.synthetic = true;
  o.synthetic_classes = 7;
  o.synthetic_images = 50;
  o.size = 12;
  o.batch = 4;
  o.replicas = 2;
  sample::image_pipeline p(o);
  CHECK(p.classes() == 7);
  CHECK(p.images() == 50);
  CHECK(p.steps_per_epoch() == 6);
  const epoch_output a = run_epoch(p, o, 0), b = run_epoch(p, o, 0), c = run_epoch(p, o, 1);
  REQUIRE(a.labels.size() == 6);
  CHECK(a.labels == b.labels);
  CHECK(a.labels != c.labels);
  std::set<int> labels;
  for (const auto& l : a.labels)
    for (auto v : l) {
      CHECK((v >= 0 && v < 7));
      labels.insert(v);
    }
  CHECK(labels.size() > 3);
  // next_view: the same labels and pool, no copy.
  p.start_epoch(0);
  sample::image_pipeline::batch_view v;
  for (std::size_t s = 0; p.next_view(v); ++s) {
    CHECK(std::equal(a.labels[s].begin(), a.labels[s].end(), v.labels));
    CHECK(std::equal(a.images[s].begin(), a.images[s].end(), v.images));
  }
  // Pixels are normalised bytes: within [(0 - mean) / sd, (1 - mean) / sd].
  for (float v : a.images[0]) REQUIRE((v >= -0.485f / 0.225f - 1e-3f && v <= (1 - 0.406f) / 0.225f + 1e-3f));
}

TEST_CASE("a folder that cannot feed a step is a data_error naming it", "[pipeline][bad]") {
  sample::image_pipeline_options o;
  o.dir = "/nonexistent-lockstep-dir";
  CHECK(starts_with(error_of([&] { sample::image_pipeline p(o); }), "/nonexistent-lockstep-dir/train: missing"));
  coded_folder f("small", 2, 3);
  o.dir = f.dir.path;
  o.batch = 4;
  o.replicas = 2;
  CHECK(error_of([&] { sample::image_pipeline p(o); }).find("6 images are fewer than one global batch of 2 x 4") != std::string::npos);
  fs::create_directories(f.dir.path + "/train/class_z_empty");
  o.replicas = 1;
  CHECK(starts_with(error_of([&] { sample::image_pipeline p(o); }), f.dir.path + "/train/class_z_empty: no .jpg or .jpeg files"));
  sample::image_pipeline_options bad_args;
  bad_args.synthetic = true;
  bad_args.rank = 1;
  CHECK_THROWS_AS(sample::image_pipeline(bad_args), std::invalid_argument);
  bad_args.rank = 0;
  sample::image_pipeline p(bad_args);
  std::vector<float> img(1);
  std::vector<std::int32_t> lbl(1);
  CHECK_THROWS_AS(p.next(img.data(), lbl.data()), std::logic_error);
}
