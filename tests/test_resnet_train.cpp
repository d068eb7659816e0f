// Training ResNet-50 with the sample's replica and trainer (samples/resnet50/replica_cpu.hpp,
// trainer.hpp) at 32x32, 10 classes, small batches:
//   - a step is deterministic: two fresh replicas taking the same step end bit-identical;
//   - 2 replicas with batch-norm over both (--bn-group 2) and a global batch B take the step one
//     replica takes with batch B: fp32, within rounding (relative L2 error of the weight change after
//     2 steps below 1e-4; measured 1.9e-6);
//   - bf16 (convolutions and classifier in bf16, fp32 master weights) follows fp32: the loss after
//     20 steps on a fixed batch within 0.05 of fp32's (measured 0.545 against 0.544, from 2.50);
//   - --resume continues bit-for-bit: 2 epochs in one run and 1 + 1 with --resume give the same
//     checkpoint file; a checkpoint from other flags is refused naming the file;
//   - --evaluate reproduces the training run's last validation from its checkpoint (top-1, top-5
//     and loss equal), writes nothing, and --crop-pct changes what validation sees;
//   - the checkpoint reader (samples/common/checkpoint.hpp, shared with the Fashion sample): a bit
//     flipped in the header, the arrays or the CRC, or a cut, is a named error; the previous format
//     (LSRN5001, no CRC) loads.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>

#include "../samples/common/jpeg_encode.hpp"
#include "../samples/resnet50/flags.hpp"
#include "../samples/resnet50/replica_cpu.hpp"
#include "fashion_gradcheck.hpp"

namespace fs = std::filesystem;
using namespace resnet;
using fashion_test::randn;

namespace {

options small(const std::string& out = "") {
  options o;
  o.synthetic = true;
  o.classes = 10;
  o.size = 32;
  o.batch = 4;
  o.threads = 1;
  o.optimizer = "sgd";
  o.lr = 0.05;
  o.warmup_epochs = 0;
  o.weight_decay = 1e-4f;
  o.quiet = true;
  o.out = out;
  // Each bottleneck starts as the identity: at 32x32 with batch norm over 4 values a deep stack is
  // chaotic at initialisation without it (fp32 against bf16 logits differ by 64%, with it by 1.3%),
  // so the comparisons below would measure the chaos, not the arithmetic.
  o.zero_init_residual = true;
  return o;
}

constexpr int side = 32, classes = 10;

struct fixed_batch {
  std::vector<float> images;
  std::vector<int> labels;
  explicit fixed_batch(int B, std::uint32_t seed) : images(randn(static_cast<std::size_t>(B) * 3 * side * side, seed)) {
    for (int i = 0; i < B; ++i) labels.push_back(static_cast<int>((seed + 3u * i) % classes));
  }
};

// R replicas as threads take `steps` SGD steps on slices of the same global batch; returns rank 0's
// parameters and its losses.
template <class T = float>
std::vector<float> train(int R, int B, int steps, const fixed_batch& data, std::vector<float>* losses = nullptr,
                         double lr = 0.05) {
  options o = small();
  o.ranks = R;
  o.batch = B;
  o.bn_group = R;
  std::vector<float> params;
  lockstep::run_inproc(R, [&](auto& g) {
    using G = std::remove_reference_t<decltype(g)>;
    const sample::replica_bn_group<G> bn(g, R);
    lockstep::codec::fp32 codec;
    const lockstep::optim::sgd opt{o.momentum, o.weight_decay, false, true};
    cpu_replica<G, lockstep::topology::ring, lockstep::codec::fp32, lockstep::optim::sgd, T> rep(
        g, o, classes, lockstep::topology::ring{}, codec, opt);
    const int b = B / R, rank = g.rank();
    const std::size_t img = 3 * static_cast<std::size_t>(side) * side;
    for (int s = 0; s < steps; ++s) {
      const float loss = rep.train_step(data.images.data() + rank * b * img, data.labels.data() + rank * b, b, bn.bn,
                                        static_cast<float>(lr));
      if (losses && rank == 0) losses->push_back(loss);
    }
    if (rank == 0) params = rep.params();
  });
  return params;
}

double rel_change_err(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& start) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    s += (double(b[i]) - start[i]) * (double(b[i]) - start[i]);
  }
  return std::sqrt(d / s);
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

}  // namespace

TEST_CASE("two identical ResNet-50 steps are bit-identical", "[resnet][train]") {
  const fixed_batch data(4, 1);
  const auto a = train(1, 4, 1, data), b = train(1, 4, 1, data);
  REQUIRE(a.size() == 25557032 - 1000 * 2048 - 1000 + 10 * 2048 + 10);
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("2 replicas with batch norm over both equal 1 replica with the whole batch", "[resnet][train]") {
  const fixed_batch data(8, 2);
  std::vector<float> start, running;
  initial_parameters(model_config(small(), classes), make_layout(model_config(small(), classes)), small().seed, start,
                     running);
  const auto one = train(1, 8, 2, data), two = train(2, 8, 2, data);
  const double e = rel_change_err(two, one, start);
  INFO("relative error of the weight change " << e);
  CHECK(e < 1e-4);
}

TEST_CASE("bf16 training follows fp32: the loss after 20 steps", "[resnet][train][bf16]") {
  const fixed_batch data(4, 3);
  std::vector<float> l32, l16;
  train<float>(1, 4, 20, data, &l32, 0.002);
  train<bf16_t>(1, 4, 20, data, &l16, 0.002);
  INFO("fp32 " << l32.front() << " -> " << l32.back() << ", bf16 " << l16.front() << " -> " << l16.back());
  CHECK(std::fabs(l16.front() - l32.front()) < 0.02);
  CHECK(l32.back() < 0.5 * l32.front());
  CHECK(std::fabs(l16.back() - l32.back()) < 0.05);
}

TEST_CASE("--resume continues bit-for-bit; other flags are refused", "[resnet][train]") {
  const fs::path dir = fs::temp_directory_path() / ("lockstep-resnet-train-" + std::to_string(::getpid()));
  options full = small((dir / "full").string());
  full.synthetic_images = 8;  // 2 steps per epoch
  full.epochs = 2;
  options split = full;
  split.out = (dir / "split").string();
  split.stop_after = 1;
  train_inproc(full);
  train_inproc(split);
  split.resume = true;
  train_inproc(split);
  const std::string a = slurp(full.out + "/checkpoint.bin"), b = slurp(split.out + "/checkpoint.bin");
  REQUIRE(a.size() > 1000);
  CHECK(a == b);
  options other = split;
  other.lr = 0.1;
  CHECK_THROWS_WITH(train_inproc(other), Catch::Contains("checkpoint.bin: written with other training flags"));

  // The reader: a flipped bit, a cut, the previous format.
  const std::string path = split.out + "/checkpoint.bin";
  auto write = [&](const std::string& bytes) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  for (std::size_t byte : {std::size_t{12}, std::size_t{60}, std::size_t{64}, a.size() / 2, a.size() - 5, a.size() - 1}) {
    std::string bad = a;
    bad[byte] = static_cast<char>(bad[byte] ^ 0x10);
    write(bad);
    INFO("byte " << byte << " of " << a.size());
    CHECK_THROWS_WITH(load_checkpoint(path, split, classes),
                      Catch::StartsWith(path + ": corrupted checkpoint: the CRC-32"));
  }
  write(a.substr(0, a.size() - 3));
  CHECK_THROWS_WITH(load_checkpoint(path, split, classes),
                    Catch::StartsWith(path + ": ") && Catch::Contains("truncated or not a checkpoint of this program"));
  std::string old = a.substr(0, a.size() - 4);
  old.replace(0, 8, "LSRN5001");
  write(old);
  const checkpoint c = load_checkpoint(path, split, classes), want = [&] {
    write(a);
    return load_checkpoint(path, split, classes);
  }();
  CHECK(c.epochs_done == 2);
  CHECK(c.global_step == want.global_step);
  CHECK(c.params == want.params);
  CHECK(c.momentum == want.momentum);
  fs::remove_all(dir);
}

TEST_CASE("evaluating a checkpoint reproduces its last validation; the crop share changes it", "[resnet][train]") {
  const fs::path dir = fs::temp_directory_path() / ("lockstep-resnet-eval-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  // An ImageNet-layout folder: 4 classes, 4 training and 2 validation JPEGs each (40x36, so the
  // centre crop has something to cut), colour and stripes by class plus seeded noise.
  sample::rng g{11};
  for (const char* split : {"train", "val"})
    for (int c = 0; c < 4; ++c) {
      const fs::path cdir = dir / "data" / split / ("class" + std::to_string(c));
      fs::create_directories(cdir);
      for (int i = 0; i < (split[0] == 't' ? 4 : 2); ++i) {
        const int w = 40, h = 36;
        std::vector<std::uint8_t> px(static_cast<std::size_t>(w) * h * 3);
        for (int y = 0; y < h; ++y)
          for (int x = 0; x < w; ++x)
            for (int k = 0; k < 3; ++k)
              px[(static_cast<std::size_t>(y) * w + x) * 3 + k] = static_cast<std::uint8_t>(
                  (k == c % 3 ? 150 : 60) + ((x / (2 + c)) % 2 ? 40 : 0) + static_cast<int>(g.next() % 30));
        const auto jpg = sample::encode_jpeg(px.data(), w, h, 3, {});
        std::ofstream f(cdir / ("img" + std::to_string(i) + ".jpg"), std::ios::binary);
        f.write(reinterpret_cast<const char*>(jpg.data()), static_cast<std::streamsize>(jpg.size()));
      }
    }
  options o = small((dir / "out").string());
  o.synthetic = false;
  o.data = (dir / "data").string();
  o.epochs = 1;  // 16 images, batch 4: 4 steps
  const run_result trained = train_inproc(o);
  REQUIRE(trained.epochs.size() == 1);
  const std::string ckpt = slurp(o.out + "/checkpoint.bin"), csv = slurp(o.out + "/metrics.csv");

  options e = o;
  e.evaluate = true;
  const run_result evaluated = train_inproc(e);
  REQUIRE(evaluated.epochs.size() == 1);
  const epoch_record &t = trained.epochs[0], &v = evaluated.epochs[0];
  CHECK(v.epoch == 1);
  CHECK(v.top1 == t.top1);
  CHECK(v.top5 == t.top5);
  CHECK(v.val_loss == t.val_loss);
  CHECK(slurp(o.out + "/checkpoint.bin") == ckpt);  // nothing written
  CHECK(slurp(o.out + "/metrics.csv") == csv);

  e.crop_pct = 1.0;  // the whole 36x36 centre square instead of 31.5x31.5 of it
  const run_result whole = train_inproc(e);
  REQUIRE(whole.epochs.size() == 1);
  CHECK(whole.epochs[0].val_loss != t.val_loss);

  e.crop_pct = 1.5;
  CHECK_THROWS_WITH(validate(e), Catch::Contains("--crop-pct must be in (0, 1]"));
  options no_ckpt = e;
  no_ckpt.crop_pct = 1.0;
  no_ckpt.out = (dir / "nothing").string();
  CHECK_THROWS_WITH(train_inproc(no_ckpt), Catch::Contains("checkpoint.bin"));

  // Without val/: --evaluate is an error naming it (it was a null pipeline: a crash), and training
  // goes on without validation.
  fs::remove_all(dir / "data" / "val");
  options no_val = e;
  no_val.crop_pct = 1.0;
  CHECK_THROWS_WITH(train_inproc(no_val), Catch::Contains(o.data + "/val: missing; --evaluate"));
  no_val.evaluate = false;
  no_val.out = (dir / "out-no-val").string();
  const run_result unvalidated = train_inproc(no_val);
  REQUIRE(unvalidated.epochs.size() == 1);
  CHECK(std::isnan(unvalidated.epochs[0].top1));
  fs::remove_all(dir);
}

// Flags checked before anything runs: a batch-norm group that would see one value per channel in
// the last stage (1x1 maps up to --size 32) is refused, as torch refuses it (it normalised every
// value to beta and wrote a running variance of 0: the loss stayed at ln(classes), val loss grew to
// 1e17); an --optimizer sgd after --recipe mlperf keeps SGD's linear rule, not LARS' peak of 10.
TEST_CASE("flags: one value per channel in a batch norm is refused; the recipe's lr is LARS'", "[resnet][flags]") {
  options o;
  o.synthetic = true;
  o.size = 32;  // the last stage's maps: 1x1
  o.batch = 2;
  o.ranks = 2;
  o.bn_group = 1;
  CHECK_THROWS_WITH(validate(o), Catch::Contains("gives the last stage's batch norms 1 value per channel (its maps are 1x1)"));
  o.bn_group = 2;  // statistics over both replicas: 2 values
  CHECK_NOTHROW(validate(o));
  o.bn_group = 1;
  o.size = 64;  // 2x2 maps: 4 values from one image
  CHECK_NOTHROW(validate(o));
  o.size = 32;
  o.batch = 4;
  CHECK_NOTHROW(validate(o));

  const char* sgd_after[] = {"lockstep-train-resnet50", "--synthetic", "--batch", "512", "--recipe", "mlperf", "--optimizer", "sgd"};
  const options s = parse_flags(8, const_cast<char**>(sgd_after));
  CHECK(s.optimizer == "sgd");
  CHECK(peak_lr(s) == Approx(0.2));  // 0.1 x 512 / 256
  const char* lars[] = {"lockstep-train-resnet50", "--synthetic", "--batch", "512", "--recipe", "mlperf"};
  CHECK(peak_lr(parse_flags(6, const_cast<char**>(lars))) == 10.0);
  // The recipe's warmup follows the final batch; a --warmup-epochs given is kept.
  const char* w5[] = {"x", "--synthetic", "--recipe", "mlperf", "--batch", "32768", "--warmup-epochs", "5"};
  CHECK(parse_flags(8, const_cast<char**>(w5)).warmup_epochs == 5);
  const char* big_then_small[] = {"x", "--synthetic", "--batch", "40000", "--recipe", "mlperf", "--batch", "1024"};
  CHECK(parse_flags(8, const_cast<char**>(big_then_small)).warmup_epochs == 5);
  const char* big[] = {"x", "--synthetic", "--recipe", "mlperf", "--batch", "32768"};
  CHECK(parse_flags(6, const_cast<char**>(big)).warmup_epochs == 25);
}

// Ranks started with different flags would post collectives that do not match (over NCCL: a hang):
// the trainers gather every rank's flag fingerprints first and every rank fails naming the flag.
TEST_CASE("ranks started with a different seed or --bn-group fail at once naming it", "[resnet][flags]") {
  for (int which = 0; which < 2; ++which) {
    std::mutex m;
    std::vector<std::string> what(2);
    lockstep::run_inproc(2, [&](auto& g) {
      options o;
      o.synthetic = true;
      if (g.rank() == 1) {
        if (which == 0) o.seed += 1;
        else o.bn_group = 2;
      }
      try {
        sample::check_same_flags(g, flag_fingerprints(o));
      } catch (const std::invalid_argument& e) {
        std::lock_guard lk(m);
        what[static_cast<std::size_t>(g.rank())] = e.what();
      }
    });
    const std::string want = which == 0 ? "rank 1 was started with other --seed" : "rank 1 was started with other training flags";
    for (const auto& w : what) CHECK(w.rfind(want, 0) == 0);
  }
}
