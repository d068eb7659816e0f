// The sample trainer over lockstep (samples/fashion_cnn/trainer.hpp): distributed batch norm,
// replica-count invariance, that training learns, and that --resume continues bit-for-bit.
//
// Runs use the synthetic data set of tests/fashion_runs.hpp (a class is a bright bar at a
// class-dependent place, plus noise), small channel counts and few steps, so the whole file takes
// seconds on two cores and does not depend on the installed Fashion-MNIST.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "../samples/fashion_cnn/replica_cpu.hpp"
#include "fashion_runs.hpp"

namespace fs = std::filesystem;
using namespace fashion;

namespace {

using namespace fashion_test;

const synthetic_data& data_dir() {
  static synthetic_data d("lockstep-fashion", 1024, 256);
  return d;
}

options small_run(const std::string& out) {
  options o;
  o.data = data_dir().dir;
  o.out = data_dir().dir + "/" + out;
  o.channels = {4, 8, 8};
  o.batch = 32;
  o.epochs = 2;
  o.lr = 0.05;
  o.warmup_epochs = 0.2;
  o.train_limit = 256;  // 8 steps per epoch
  o.threads = 1;
  o.quiet = true;
  return o;
}

}  // namespace

TEST_CASE("distributed batch norm over G = N replicas equals batch norm over the whole batch", "[fashion][bn]") {
  const int N = 4, b = 3, K = 5, HW = 7, B = N * b;
  std::mt19937 g(3);
  std::normal_distribution<float> d(0.5f, 2.0f);
  std::vector<float> x(static_cast<std::size_t>(B) * K * HW), dy(x.size()), gamma(K), beta(K);
  for (auto& v : x) v = d(g);
  for (auto& v : dy) v = d(g);
  for (int k = 0; k < K; ++k) gamma[static_cast<std::size_t>(k)] = 1.0f + 0.1f * k, beta[static_cast<std::size_t>(k)] = 0.2f * k - 0.3f;

  // The reference: one replica, the whole batch.
  std::vector<float> y(x.size()), dx(x.size()), dg(K), db(K), mean(K), rstd(K), rm(K, 0.0f), rv(K, 1.0f);
  float count = 0;
  const bn_group local;
  batchnorm_relu_forward(y.data(), mean.data(), rstd.data(), &count, rm.data(), rv.data(), x.data(), gamma.data(),
                         beta.data(), B, K, HW, local, true);
  batchnorm_relu_backward(dx.data(), dg.data(), db.data(), dy.data(), x.data(), mean.data(), rstd.data(), count,
                          gamma.data(), beta.data(), B, K, HW, local);

  // N replicas with b images each, statistics over the group of all N.
  std::vector<float> y4(x.size()), dx4(x.size()), dg_sum(K, 0.0f), db_sum(K, 0.0f), rm4(static_cast<std::size_t>(N) * K);
  // The ranks record their count and running statistics, the main thread asserts (Catch2 v2
  // assertions are not thread-safe).
  std::vector<float> cnt_of(N);
  std::vector<std::vector<float>> rm_of(N), rv_of(N);
  std::mutex mu;
  lockstep::run_inproc(N, [&](auto& world) {
    const int r = world.rank();
    bn_group grp;
    grp.size = world.size();
    grp.all_gather = [&](std::span<const float> mine, std::span<float> all) {
      lockstep::codec::fp32 c;
      lockstep::all_gather(world, mine, all, lockstep::topology::ring{}, c);
    };
    grp.sum = [&](std::span<float> v) { lockstep::all_reduce(world, v); };
    const std::size_t off = static_cast<std::size_t>(r) * b * K * HW;
    std::vector<float> m(K), s(K), rmr(K, 0.0f), rvr(K, 1.0f), lg(K), lb(K);
    float cnt = 0;
    batchnorm_relu_forward(y4.data() + off, m.data(), s.data(), &cnt, rmr.data(), rvr.data(), x.data() + off,
                           gamma.data(), beta.data(), b, K, HW, grp, true);
    batchnorm_relu_backward(dx4.data() + off, lg.data(), lb.data(), dy.data() + off, x.data() + off, m.data(), s.data(),
                            cnt, gamma.data(), beta.data(), b, K, HW, grp);
    std::lock_guard lk(mu);
    cnt_of[static_cast<std::size_t>(r)] = cnt;
    rm_of[static_cast<std::size_t>(r)] = rmr;
    rv_of[static_cast<std::size_t>(r)] = rvr;
    for (int k = 0; k < K; ++k) {
      dg_sum[static_cast<std::size_t>(k)] += lg[static_cast<std::size_t>(k)];
      db_sum[static_cast<std::size_t>(k)] += lb[static_cast<std::size_t>(k)];
    }
  });
  for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r) {
    INFO("rank " << r);
    CHECK(cnt_of[r] == count);
    REQUIRE(rm_of[r].size() == static_cast<std::size_t>(K));
    REQUIRE(rv_of[r].size() == static_cast<std::size_t>(K));
    for (std::size_t k = 0; k < static_cast<std::size_t>(K); ++k) {
      CHECK(rm_of[r][k] == Approx(rm[k]).margin(1e-6));
      CHECK(rv_of[r][k] == Approx(rv[k]).epsilon(1e-5));
    }
  }
  CHECK(max_abs_diff(y, y4) < 1e-5);
  CHECK(max_abs_diff(dx, dx4) < 1e-5);
  CHECK(max_abs_diff(dg, dg_sum) < 1e-4);
  CHECK(max_abs_diff(db, db_sum) < 1e-4);

  // And a group of one is not the same thing: the check above can fail.
  std::vector<float> y1(static_cast<std::size_t>(b) * K * HW), m(K), s(K), rmr(K, 0.0f), rvr(K, 1.0f);
  batchnorm_relu_forward(y1.data(), m.data(), s.data(), &count, rmr.data(), rvr.data(), x.data(), gamma.data(),
                         beta.data(), b, K, HW, local, true);
  CHECK(max_abs_diff(std::vector<float>(y.begin(), y.begin() + static_cast<std::ptrdiff_t>(y1.size())), y1) > 1e-3);
}

TEST_CASE("one replica with batch B and four with B/4 (fp32, G = 4) reach the same weights", "[fashion][train]") {
  options one = small_run("one");
  one.epochs = 1;
  options four = one;
  four.out = data_dir().dir + "/four";
  four.ranks = 4;
  four.bn_group = 4;
  for (auto* o : {&one, &four}) train_inproc(*o);
  const checkpoint a = final_state(one), b = final_state(four);
  double wmax = 0;
  for (float v : a.params) wmax = std::max(wmax, static_cast<double>(std::fabs(v)));
  INFO("max |w| " << wmax);
  CHECK(max_abs_diff(a.params, b.params) < 1e-4 * wmax);
  CHECK(max_abs_diff(a.running, b.running) < 1e-4);
  CHECK(max_abs_diff(a.momentum, b.momentum) < 1e-4);
  // They did train: the weights moved away from the initial ones.
  CHECK(max_abs_diff(a.params, model_create(config{{4, 8, 8}}, one.seed).params) > 1e-3);
}

TEST_CASE("a short run on a subset lowers the loss", "[fashion][train]") {
  options o = small_run("learn");
  o.ranks = 2;
  o.bn_group = 2;
  o.epochs = 3;
  o.train_limit = 512;
  o.codec = "int8";
  o.error_feedback = true;
  o.topology = "torus2d:1x2";
  const run_result r = train_inproc(o);
  REQUIRE(r.epochs.size() == 3);
  INFO("train loss " << r.epochs[0].train_loss << " -> " << r.epochs[2].train_loss << ", test accuracy "
                     << r.epochs[2].test_acc);
  CHECK(r.epochs[2].train_loss < 0.8 * r.epochs[0].train_loss);
  CHECK(r.epochs[2].test_loss < std::log(10.0));
  CHECK(r.epochs[2].test_acc > 0.5);
}

TEST_CASE("--resume continues bit-for-bit", "[fashion][train]") {
  // The last case: 8-bit gradients with error feedback, whose residuals (different on each
  // replica) must come back from the checkpoint for the resumed run to match.
  for (const char* optimizer : {"sgd", "lars", "lars-dyntree8-ef"}) {
    INFO("optimizer " << optimizer);
    const bool ef = optimizer == std::string("lars-dyntree8-ef");
    options full = small_run(std::string("full-") + optimizer);
    full.ranks = 2;
    full.bn_group = 1;
    full.optimizer = ef ? "lars" : optimizer;
    full.lr = full.optimizer == "lars" ? 1.0 : 0.05;
    if (ef) {
      full.codec = "dyntree8";
      full.codec_block = 64;
      full.error_feedback = true;
      full.topology = "torus2d:1x2";
    }
    options split = full;
    split.out = data_dir().dir + "/split-" + optimizer;
    train_inproc(full);
    split.stop_after = 1;
    train_inproc(split);
    CHECK(final_state(split).epochs_done == 1);
    split.resume = true;
    train_inproc(split);
    const checkpoint a = final_state(full), b = final_state(split);
    CHECK(b.epochs_done == 2);
    CHECK(a.global_step == b.global_step);
    CHECK(a.params == b.params);
    CHECK(a.running == b.running);
    CHECK(a.momentum == b.momentum);
    CHECK(a.residuals == b.residuals);
    if (ef) {
      // 2 replicas x 2 phases x every parameter, and not all zero.
      CHECK(a.residuals.size() == 2 * 2 * a.params.size());
      CHECK(std::any_of(a.residuals.begin(), a.residuals.end(), [](float v) { return v != 0.0f; }));
    } else {
      CHECK(a.residuals.empty());
    }
  }
}

TEST_CASE("resuming with other flags is refused with a message saying so", "[fashion][train]") {
  options o = small_run("refuse");
  o.epochs = 1;
  train_inproc(o);
  o.resume = true;
  o.batch = 64;
  CHECK_THROWS_WITH(train_inproc(o), Catch::Contains("written with other training flags"));
}

// The writer is held in the middle of a checkpoint, then SIGKILLed: "<file>.tmp" is made a FIFO
// before it starts, so its write blocks once this side has read the first bytes (deterministic,
// where killing a real write would be a race it almost never loses). What the crash leaves, a
// partial .tmp, is then put in place as a regular file, and --resume must go on from the previous
// checkpoint as if nothing had happened.
TEST_CASE("a checkpoint killed while being written leaves the previous one, and --resume continues from it", "[fashion][train]") {
  options full = small_run("kill-full");
  full.ranks = 2;
  full.bn_group = 1;
  options split = full;
  split.out = data_dir().dir + "/kill-split";
  train_inproc(full);
  split.stop_after = 1;
  train_inproc(split);
  const std::string path = split.out + "/checkpoint.bin", tmp = path + ".tmp";
  const checkpoint before = final_state(split);
  REQUIRE(before.epochs_done == 1);

  REQUIRE(::mkfifo(tmp.c_str(), 0600) == 0);
  checkpoint next = before;
  next.epochs_done = 2;
  next.params.assign(std::size_t{1} << 20, 1.0f);  // 4 MiB: far more than a FIFO's buffer
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    save_checkpoint(path, split, next);  // blocks in the middle of its writes
    ::_exit(0);
  }
  std::vector<char> partial(1000);
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  std::size_t got = 0;
  while (got < partial.size()) {
    const ssize_t n = ::read(fd, partial.data() + got, partial.size() - got);
    REQUIRE(n > 0);
    got += static_cast<std::size_t>(n);
  }
  ::kill(child, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  ::close(fd);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  fs::remove(tmp);
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(partial.data(), static_cast<std::streamsize>(partial.size()));
  }

  const checkpoint after = final_state(split);  // the previous checkpoint, whole
  CHECK(after.epochs_done == 1);
  CHECK(after.params == before.params);
  CHECK(after.momentum == before.momentum);
  split.resume = true;
  train_inproc(split);  // overwrites the leftover .tmp
  const checkpoint a = final_state(full), b = final_state(split);
  CHECK(b.epochs_done == 2);
  CHECK(a.global_step == b.global_step);
  CHECK(a.params == b.params);
  CHECK(a.momentum == b.momentum);
  CHECK_FALSE(fs::exists(tmp));
}

TEST_CASE("a checkpoint of the previous format (no CRC) resumes bit-for-bit", "[fashion][train]") {
  options full = small_run("old-full");
  options split = full;
  split.out = data_dir().dir + "/old-split";
  train_inproc(full);
  split.stop_after = 1;
  train_inproc(split);
  const std::string path = split.out + "/checkpoint.bin";
  std::vector<char> bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  REQUIRE(bytes.size() > 68);
  bytes.resize(bytes.size() - 4);  // LSCKPT02: the same file without the CRC
  std::memcpy(bytes.data(), "LSCKPT02", 8);
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  REQUIRE_FALSE(sample::read_checkpoint(path, checkpoint_format).checksummed);
  split.resume = true;
  train_inproc(split);
  const checkpoint a = final_state(full), b = final_state(split);
  CHECK(b.epochs_done == 2);
  CHECK(a.global_step == b.global_step);
  CHECK(a.params == b.params);
  CHECK(a.running == b.running);
  CHECK(a.momentum == b.momentum);
  CHECK(sample::read_checkpoint(path, checkpoint_format).checksummed);  // what it writes is the new format
}

// What --resume refuses, each with an error that starts with the file's path and says why: a flipped
// bit anywhere (a size word: the size check; any other: the CRC-32), a cut, trailing bytes, another
// file, other flags. The previous format (LSCKPT02, no CRC) still loads, saying so.
TEST_CASE("a truncated, corrupted or foreign checkpoint, or other flags, is a named error", "[fashion][train]") {
  options o = small_run("corrupt");
  o.epochs = 1;
  train_inproc(o);
  const std::string path = o.out + "/checkpoint.bin";
  std::vector<char> good;
  {
    std::ifstream f(path, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(f), {});
  }
  REQUIRE(good.size() > 68);
  auto write = [&](const std::vector<char>& bytes) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  auto refused = [&](const std::string& why) {
    try {
      load_checkpoint(path, o);
      return std::string("accepted");
    } catch (const std::runtime_error& e) {
      const std::string w = e.what();
      if (w.rfind(path + ": ", 0) != 0) return "no path: " + w;
      return w.find(why) == std::string::npos ? "other reason: " + w : std::string("ok");
    }
  };
  SECTION("truncated anywhere") {
    for (std::size_t keep : {std::size_t{0}, std::size_t{7}, std::size_t{40}, std::size_t{64}, good.size() / 2, good.size() - 4,
                             good.size() - 1}) {
      INFO("kept " << keep << " of " << good.size() << " bytes");
      write(std::vector<char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep)));
      const std::string r = refused(keep == 0  ? "an empty file (0 bytes), not a lockstep checkpoint"
                                    : keep < 64 ? std::to_string(keep) + " bytes, shorter than the 64-byte header"
                                                : "truncated or not a checkpoint of this program");
      CHECK(r == "ok");
    }
  }
  SECTION("trailing bytes") {
    auto longer = good;
    longer.push_back('x');
    write(longer);
    CHECK(refused("truncated or not a checkpoint of this program") == "ok");
  }
  SECTION("every bit of the header flipped, one at a time") {
    // Header bytes: magic 0..7, epochs/step 8..19, sizes 20..31, channels 32..43, residual size
    // 44..47, seed and fingerprint 48..63. A size: the size check; the magic: not a checkpoint (or
    // another format); any other: the CRC.
    for (std::size_t byte = 0; byte < 64; ++byte) {
      const bool size = (byte >= 20 && byte < 32) || (byte >= 44 && byte < 48);
      for (int bit = 0; bit < 8; ++bit) {
        auto bad = good;
        bad[byte] = static_cast<char>(bad[byte] ^ (1 << bit));
        write(bad);
        INFO("byte " << byte << " bit " << bit);
        const std::string r = refused(byte < 8 ? "" : size ? "truncated or not a checkpoint of this program" : "corrupted checkpoint: the CRC-32");
        CHECK(r == "ok");
      }
    }
  }
  SECTION("a bit flipped in the arrays or the CRC: the CRC") {
    for (std::size_t byte : {std::size_t{64}, std::size_t{67}, good.size() / 2, good.size() - 5, good.size() - 4, good.size() - 1})
      for (int bit : {0, 5, 7}) {
        auto bad = good;
        bad[byte] = static_cast<char>(bad[byte] ^ (1 << bit));
        write(bad);
        INFO("byte " << byte << " of " << good.size() << ", bit " << bit);
        CHECK(refused("corrupted checkpoint: the CRC-32") == "ok");
      }
  }
  SECTION("the previous format (LSCKPT02, no CRC) loads, said in a log line; cut short it is refused") {
    auto old = std::vector<char>(good.begin(), good.end() - 4);
    std::memcpy(old.data(), "LSCKPT02", 8);
    write(old);
    std::FILE* log = std::tmpfile();
    REQUIRE(log);
    const sample::checkpoint_file f = sample::read_checkpoint(path, checkpoint_format, log);
    CHECK_FALSE(f.checksummed);
    std::rewind(log);
    char line[512] = {};
    CHECK(std::fgets(line, sizeof line, log) != nullptr);
    std::fclose(log);
    CHECK_THAT(std::string(line), Catch::StartsWith(path + ": ") && Catch::Contains("no checksum"));
    write(good);
    const checkpoint now = load_checkpoint(path, o);
    CHECK(f.data.epochs_done == now.epochs_done);
    CHECK(f.data.global_step == now.global_step);
    CHECK(f.data.params == now.params);
    CHECK(f.data.running == now.running);
    CHECK(f.data.momentum == now.momentum);
    CHECK(sample::read_checkpoint(path, checkpoint_format).checksummed);
    old.pop_back();
    write(old);
    CHECK(refused("truncated or not a checkpoint of this program") == "ok");
  }
  SECTION("a file that is not a checkpoint, and one of another program's format") {
    write(std::vector<char>(good.size(), 'x'));
    CHECK(refused("not a lockstep checkpoint") == "ok");
    auto old = good;
    std::memcpy(old.data(), "LSCKPT01", 8);
    write(old);
    CHECK(refused("format 01") == "ok");
  }
  SECTION("a newer version of the format, a directory, a missing file: each says which") {
    auto newer = good;
    std::memcpy(newer.data(), "LSCKPT04", 8);
    write(newer);
    CHECK(refused("a lockstep checkpoint of version \"LSCKPT04\", which this build (\"LSCKPT03\") cannot read") == "ok");
    std::filesystem::remove(path);
    CHECK(refused("no checkpoint to resume from (No such file or directory)") == "ok");
    std::filesystem::create_directory(path);
    CHECK(refused("a directory, not a checkpoint file") == "ok");
    std::filesystem::remove(path);
  }
  SECTION("other flags: channels, seed, batch") {
    write(good);
    options other = o;
    other.channels = {4, 8, 16};
    CHECK_THROWS_WITH(load_checkpoint(path, other), Catch::StartsWith(path) && Catch::Contains("other --channels"));
    other = o;
    other.seed += 1;
    CHECK_THROWS_WITH(load_checkpoint(path, other), Catch::StartsWith(path) && Catch::Contains("other training flags"));
    other = o;
    other.batch = 16;
    CHECK_THROWS_WITH(load_checkpoint(path, other), Catch::StartsWith(path) && Catch::Contains("other training flags"));
    CHECK_NOTHROW(load_checkpoint(path, o));
  }
}

TEST_CASE("IDX images of another size than the model reads are refused, naming the file", "[fashion][data]") {
  // The model reads 28x28 pixels an image: 27x27 images were read past their end (a crash), and
  // 56x56 ones trained on their first quarter without a word.
  const std::string dir = data_dir().dir + "/side27";
  fs::create_directories(dir);
  auto be32 = [](std::ofstream& f, std::uint32_t v) {
    const char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
    f.write(b, 4);
  };
  for (const char* prefix : {"train", "t10k"}) {
    const std::uint32_t n = 64, side = 27;
    std::ofstream img(dir + "/" + prefix + "-images-idx3-ubyte.gz", std::ios::binary);  // gzread reads plain files too
    be32(img, 0x803), be32(img, n), be32(img, side), be32(img, side);
    img << std::string(n * side * side, '\x10');
    std::ofstream lbl(dir + "/" + prefix + "-labels-idx1-ubyte.gz", std::ios::binary);
    be32(lbl, 0x801), be32(lbl, n);
    lbl << std::string(n, '\x03');
  }
  options o = small_run("side27");
  o.data = dir;
  CHECK_THROWS_WITH(load_data(o), Catch::Contains(dir + "/train-images-idx3-ubyte.gz: images are 27x27; the model reads 28x28"));
}

TEST_CASE("a checkpoint's progress must be whole epochs of this run", "[fashion][train]") {
  // The previous format has no CRC: its counters are checked against the flags it matched.
  checkpoint c;
  c.epochs_done = 2, c.global_step = 16;
  CHECK_NOTHROW(sample::check_progress("ck", c, 3, 8));
  c.epochs_done = -1, c.global_step = -8;
  CHECK_THROWS_WITH(sample::check_progress("ck", c, 3, 8), Catch::Contains("ck: says -1 epochs are done, outside 0..3"));
  c.epochs_done = 100, c.global_step = 800;
  CHECK_THROWS_WITH(sample::check_progress("ck", c, 3, 8), Catch::Contains("outside 0..3"));
  c.epochs_done = 1, c.global_step = 2147483656LL;
  CHECK_THROWS_WITH(sample::check_progress("ck", c, 3, 8), Catch::Contains("says step 2147483656 after 1 epochs of 8 steps"));
}
