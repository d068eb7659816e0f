// lockstep-fashion-to-jpeg: writes Fashion-MNIST as an ImageNet-layout JPEG folder
// (OUT/train/<class>/*.JPEG, OUT/val/<class>/*.JPEG), so the ImageNet input pipeline
// (samples/common/image_folder.hpp) and the ResNet-50 sample run on real JPEG files here.
// The layout and its limits: samples/common/fashion_jpeg.hpp.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../common/fashion_jpeg.hpp"

namespace {

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: lockstep-fashion-to-jpeg --out DIR [options]\n"
               "  --out DIR        folder to write (new or empty): DIR/train/<class>/*.JPEG, DIR/val/<class>/*.JPEG\n"
               "  --source DIR     Fashion-MNIST IDX files (default %s)\n"
               "  --size WxH       image size in pixels, upscaled from 28x28 (default 400x350)\n"
               "  --quality Q      JPEG quality 1..100 (default 90)\n"
               "  --limit N        at most N images per class and split (default 0: all 60,000 + 10,000)\n"
               "  --threads T      encoding threads (default 1)\n"
               "  --progressive    progressive JPEGs (default baseline)\n"
               "  --overwrite      write into a non-empty DIR\n",
               sample::default_fashion_mnist_dir);
}

int to_int(const char* flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!*v || *end || x < 0 || x > 1 << 30) {
    std::fprintf(stderr, "lockstep-fashion-to-jpeg: %s %s is not a whole number\n", flag, v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  sample::fashion_jpeg_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "lockstep-fashion-to-jpeg: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--out") {
      o.out = value();
    } else if (a == "--source") {
      o.source = value();
    } else if (a == "--size") {
      const char* v = value();
      int w = 0, h = 0;
      char tail = 0;
      if (std::sscanf(v, "%dx%d%c", &w, &h, &tail) != 2 || w < 1 || h < 1 || w > 65500 || h > 65500) {
        std::fprintf(stderr, "lockstep-fashion-to-jpeg: --size %s is not WxH (1..65500 each)\n", v);
        return 2;
      }
      o.width = w, o.height = h;
    } else if (a == "--quality") {
      o.quality = to_int("--quality", value());
    } else if (a == "--limit") {
      o.limit = to_int("--limit", value());
    } else if (a == "--threads") {
      o.threads = to_int("--threads", value());
    } else if (a == "--progressive") {
      o.progressive = true;
    } else if (a == "--overwrite") {
      o.overwrite = true;
    } else {
      std::fprintf(stderr, "lockstep-fashion-to-jpeg: unknown flag %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (o.out.empty()) {
    usage(stderr);
    return 2;
  }
  try {
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t n = sample::write_fashion_jpeg_folder(o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("wrote %zu JPEGs (%dx%d, quality %d) to %s in %.1f s\n", n, o.width, o.height, o.quality, o.out.c_str(), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-fashion-to-jpeg: %s\n", e.what());
    return 1;
  }
  return 0;
}
