// lockstep-bench-input-pipeline: training-input images/s of sample::image_pipeline (fused libjpeg
// decode-crop-resize, samples/common/image_folder.hpp) against torchvision's ImageFolder +
// RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize with PIL (bench/input_pipeline_torch.py),
// same files, same core, in the same run.
//
//   lockstep-bench-input-pipeline [--dir DIR] [--size 224] [--batch 32] [--batches 16] [--rounds 3]
//                                 [--cpu 0] [--threads 1] [--cache] [--view] [--python /usr/bin/python3]
//                                 [--no-torch] [--json]
//
// Without --dir it writes (once, and reuses) a Fashion-JPEG folder of --per-class (100) images per
// class at 400x350, quality 90 (samples/common/fashion_jpeg.hpp) under $TMPDIR. Both peers are pinned to the
// one core --cpu: lockstep's decode thread(s) and the consuming thread share it, as torch's single
// thread and the Python interpreter do. Each round times --batches batches after one warm-up batch,
// lockstep then torchvision, so a busy neighbour slows both alike; the table shows the median
// round. Files are read from the page cache by both (no --cache: PIL reads each file every time).
// Two rates per peer: images per second of wall time, and images per second of the process's CPU
// time (user + system; getrusage, Python's time.process_time): on a shared core the second is far
// less disturbed by the neighbours, and is the one to compare when the machine is loaded.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "../samples/common/fashion_jpeg.hpp"
#include "../samples/common/image_folder.hpp"

#ifndef LOCKSTEP_INPUT_PEER_SCRIPT
#define LOCKSTEP_INPUT_PEER_SCRIPT "bench/input_pipeline_torch.py"
#endif

namespace {

struct options {
  std::string dir;
  int size = 224, batch = 32, batches = 16, rounds = 3, cpu = 0, threads = 1, per_class = 100;
  unsigned scales = sample::image_pipeline_options{}.scales;
  bool cache = false, torch = true, json = false, view = false;
  std::string python = "/usr/bin/python3";
};

[[noreturn]] void usage(int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: lockstep-bench-input-pipeline [--dir DIR] [--size 224] [--batch 32] [--batches 16] [--rounds 3]\n"
               "                                     [--cpu 0] [--threads 1] [--cache] [--view] [--python PATH] [--no-torch] [--json]\n"
               "                                     [--per-class 100]\n"
               "  --per-class N: images per class of the default folder (without --dir)\n"
               "  --view: take batches with next_view() (no copy) instead of next()\n");
  std::exit(rc);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(2);
      return argv[++i];
    };
    auto number = [&]() {
      const std::string v = value();
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || x < 0) {
        std::fprintf(stderr, "lockstep-bench-input-pipeline: %s %s is not a whole number\n", a.c_str(), v.c_str());
        std::exit(2);
      }
      return static_cast<int>(x);
    };
    if (a == "--help" || a == "-h") usage(0);
    else if (a == "--dir") o.dir = value();
    else if (a == "--size") o.size = number();
    else if (a == "--batch") o.batch = number();
    else if (a == "--batches") o.batches = number();
    else if (a == "--rounds") o.rounds = number();
    else if (a == "--cpu") o.cpu = number();
    else if (a == "--threads") o.threads = number();
    else if (a == "--per-class") o.per_class = number();
    else if (a == "--cache") o.cache = true;
    else if (a == "--view") o.view = true;
    else if (a == "--scales") o.scales = static_cast<unsigned>(std::strtoul(value().c_str(), nullptr, 0));
    else if (a == "--python") o.python = value();
    else if (a == "--no-torch") o.torch = false;
    else if (a == "--json") o.json = true;
    else {
      std::fprintf(stderr, "lockstep-bench-input-pipeline: unknown flag %s\n", a.c_str());
      usage(2);
    }
  }
  if (o.size < 1 || o.batch < 1 || o.batches < 1 || o.rounds < 1 || o.threads < 1 || o.per_class < 1) usage(2);
  return o;
}

// The default folder: made once, reused while its marker says it is complete.
std::string default_folder(int per_class) {
  namespace fs = std::filesystem;
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir =
      std::string(tmp && *tmp ? tmp : "/tmp") + "/lockstep-bench-fashion-jpeg-400x350-q90-" + std::to_string(per_class);
  if (fs::exists(dir + "/complete")) return dir;
  fs::remove_all(dir);
  sample::fashion_jpeg_options f;
  f.out = dir;
  f.limit = per_class;
  f.threads = 2;
  std::fprintf(stderr, "lockstep-bench-input-pipeline: writing %s (%d + %d JPEGs, once)\n", dir.c_str(), 10 * per_class,
               10 * per_class);
  sample::write_fashion_jpeg_folder(f);
  std::FILE* m = std::fopen((dir + "/complete").c_str(), "w");
  if (m) std::fclose(m);
  return dir;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct peer_round {
  double images_per_s = 0, images_per_cpu_s = 0;
  std::string versions;
};

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// One round of the Python peer: its JSON line.
peer_round run_peer(const options& o, std::string* error) {
  const std::string cmd = o.python + " " LOCKSTEP_INPUT_PEER_SCRIPT " --dir '" + o.dir + "' --size " + std::to_string(o.size) +
                          " --batch " + std::to_string(o.batch) + " --batches " + std::to_string(o.batches) + " --cpu " +
                          std::to_string(o.cpu) + " 2>&1";
  std::FILE* p = popen(cmd.c_str(), "r");
  peer_round r;
  if (!p) {
    *error = "cannot start " + cmd;
    return r;
  }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = pclose(p);
  const auto at = out.find("\"images_per_s\": ");
  if (rc != 0 || at == std::string::npos) {
    *error = "the torchvision peer failed (" + cmd + "): " + out;
    return r;
  }
  r.images_per_s = std::strtod(out.c_str() + at + 16, nullptr);
  const auto cpu = out.find("\"images_per_cpu_s\": ");
  if (cpu != std::string::npos) r.images_per_cpu_s = std::strtod(out.c_str() + cpu + 20, nullptr);
  for (const char* key : {"\"torch\": ", "\"torchvision\": ", "\"pil\": "}) {
    const auto k = out.find(key);
    if (k == std::string::npos) continue;
    const auto q0 = out.find('"', k + std::strlen(key)), q1 = out.find('"', q0 + 1);
    r.versions += std::string(key + 1, std::strlen(key) - 4) + " " + out.substr(q0 + 1, q1 - q0 - 1) + " ";
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse(argc, argv);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(o.cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) {
    std::fprintf(stderr, "lockstep-bench-input-pipeline: cannot pin to core %d\n", o.cpu);
    return 1;
  }
  try {
    if (o.dir.empty()) o.dir = default_folder(o.per_class);
    sample::image_pipeline_options po;
    po.dir = o.dir;
    po.size = o.size;
    po.batch = o.batch;
    po.threads = o.threads;
    po.cache = o.cache;
    po.prefetch = 2;
    po.scales = o.scales;
    sample::image_pipeline pipe(po);  // its threads inherit the affinity
    if (pipe.steps_per_epoch() < static_cast<std::size_t>(o.batches + 1))
      throw std::runtime_error(o.dir + "/train: " + std::to_string(pipe.images()) + " images give fewer than " +
                               std::to_string(o.batches + 1) + " batches of " + std::to_string(o.batch));
    std::vector<float> images(static_cast<std::size_t>(o.batch) * 3 * o.size * o.size);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(o.batch));
    std::vector<double> ours, theirs, ours_cpu, theirs_cpu;
    std::string versions, error;
    for (int r = 0; r < o.rounds; ++r) {
      pipe.start_epoch(r);
      pipe.next(images.data(), labels.data());  // warm-up, as the peer's
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      sample::image_pipeline::batch_view v;
      for (int b = 0; b < o.batches; ++b) o.view ? pipe.next_view(v) : pipe.next(images.data(), labels.data());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // The decode thread runs `prefetch` batches ahead: the CPU time of the loop covers as many
      // batches as were taken, within those two; over 16 batches that is the stated 1-in-8 slack
      // at most, and the same on every round.
      const double c = cpu_seconds() - c0;
      ours.push_back(static_cast<double>(o.batches) * o.batch / s);
      ours_cpu.push_back(static_cast<double>(o.batches) * o.batch / c);
      if (o.torch && error.empty()) {
        const peer_round p = run_peer(o, &error);
        if (error.empty()) {
          theirs.push_back(p.images_per_s);
          theirs_cpu.push_back(p.images_per_cpu_s);
          versions = p.versions;
        } else {
          std::fprintf(stderr, "lockstep-bench-input-pipeline: %s (continuing without the peer)\n", error.c_str());
        }
      }
    }
    const double a = median(ours), b = theirs.empty() ? 0.0 : median(theirs);
    const double ac = median(ours_cpu), bc = theirs_cpu.empty() ? 0.0 : median(theirs_cpu);
    const int n = static_cast<int>(pipe.images());
    if (o.json) {
      std::printf("{\"bench\":\"input_pipeline\",\"peer\":\"lockstep\",\"dir\":\"%s\",\"files\":%d,\"size\":%d,\"batch\":%d,"
                  "\"batches\":%d,\"rounds\":%d,\"cpu\":%d,\"threads\":%d,\"cache\":%s,\"view\":%s,\"images_per_s\":%.1f,"
                  "\"images_per_cpu_s\":%.1f}\n",
                  o.dir.c_str(), n, o.size, o.batch, o.batches, o.rounds, o.cpu, o.threads, o.cache ? "true" : "false",
                  o.view ? "true" : "false", a, ac);
      if (!theirs.empty())
        std::printf("{\"bench\":\"input_pipeline\",\"peer\":\"torchvision\",\"dir\":\"%s\",\"files\":%d,\"size\":%d,\"batch\":%d,"
                    "\"batches\":%d,\"rounds\":%d,\"cpu\":%d,\"images_per_s\":%.1f,\"images_per_cpu_s\":%.1f,"
                    "\"ratio\":%.3f,\"ratio_cpu\":%.3f}\n",
                    o.dir.c_str(), n, o.size, o.batch, o.batches, o.rounds, o.cpu, b, bc, a / b, ac / bc);
    } else {
      std::printf("lockstep-bench-input-pipeline: %s/train (%d files), output %dx%d, batch %d, %d batches x %d rounds "
                  "(median), core %d\n",
                  o.dir.c_str(), n, o.size, o.size, o.batch, o.batches, o.rounds, o.cpu);
      std::printf("%-52s %12s %16s\n", "pipeline (decoded+cropped+flipped+normalised)", "images/s", "images/cpu-s");
      std::printf("%-52s %12.1f %16.1f\n",
                  ("lockstep image_pipeline, " + std::to_string(o.threads) + " decode thread" + (o.threads > 1 ? "s" : "") +
                   (o.cache ? ", cache" : "") + (o.view ? ", next_view" : ", next"))
                      .c_str(),
                  a, ac);
      if (!theirs.empty()) {
        std::printf("%-52s %12.1f %16.1f\n", "torchvision ImageFolder + RandomResizedCrop (PIL)", b, bc);
        std::printf("ratio lockstep / torchvision: %.2fx wall, %.2fx cpu   (%s)\n", a / b, ac / bc, versions.c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep-bench-input-pipeline: %s\n", e.what());
    return 1;
  }
  return 0;
}
