// The Fashion trainer's hybrid parallelism (samples/fashion_cnn/replica_hybrid.hpp): with the
// AlexNet-like head (--fc), a run that splits fc1 and fc2 over the replicas (--parallel
// hybrid-a|b|c) with fp32 activations trains the same model as a data-parallel run with the same
// seed (loss after 50 steps within 1e-4 relative, weights within 1e-4 of their scale); 8-bit
// activations train too; a hybrid checkpoint resumes as data-parallel (the whole model, same
// format); with LARS, hybrid trains the data-parallel LARS model too; the flags hybrid runs cannot
// honour are refused.
//
// Synthetic data from tests/fashion_runs.hpp (shared with test_fashion_train.cpp), small channels
// and head, so the file takes seconds on two cores.
#include <catch2/catch.hpp>

#include <filesystem>
#include <mutex>

#include "../samples/fashion_cnn/replica_cpu.hpp"
#include "fashion_runs.hpp"

using namespace fashion;

namespace {

using namespace fashion_test;

const synthetic_data& data_dir() {
  static synthetic_data d("lockstep-fashion-hybrid", 1200, 240);
  return d;
}

// 50 steps of 24 images over the head F -> 40 -> 24 -> 10.
options head_run(const std::string& out, int ranks, const std::string& parallel) {
  options o;
  o.data = data_dir().dir;
  o.out = data_dir().dir + "/" + out;
  o.channels = {4, 8, 8};
  o.fc = {40, 24};
  o.ranks = ranks;
  o.parallel = parallel;
  o.batch = 24;
  o.epochs = 1;
  o.lr = 0.05;
  o.warmup_epochs = 0.2;
  o.train_limit = 1200;  // 50 steps
  o.threads = 1;
  o.quiet = true;
  return o;
}

// Trains `hy` and checks it against the data-parallel run `ref` whose final state is `a`: the
// same losses and the same parameters and momentum (and running statistics, when `running`),
// to fp32 rounding.
void check_trains_like(const options& hy, const run_result& ref, const checkpoint& a, bool running) {
  const run_result r = train_inproc(hy);
  REQUIRE(r.epochs.size() == 1);
  CHECK(rel(r.epochs[0].train_loss, ref.epochs[0].train_loss) < 1e-4);
  CHECK(rel(r.epochs[0].test_loss, ref.epochs[0].test_loss) < 1e-4);
  const checkpoint b = final_state(hy);
  CHECK(max_abs_diff(a.params, b.params) < 1e-4 * max_abs(a.params));
  CHECK(max_abs_diff(a.momentum, b.momentum) < 1e-4 * max_abs(a.momentum));
  if (running) CHECK(max_abs_diff(a.running, b.running) < 1e-4 * max_abs(a.running));
}

}  // namespace

TEST_CASE("with fp32 activations, hybrid a, b and c train the data-parallel model", "[fashion][hybrid]") {
  for (int ranks : {2, 3}) {
    const options dp = head_run("dp" + std::to_string(ranks), ranks, "data");
    const run_result ref = train_inproc(dp);
    REQUIRE(ref.epochs.size() == 1);
    const checkpoint a = final_state(dp);
    // They did train: the weights moved away from the initial ones.
    CHECK(max_abs_diff(a.params, model_create(model_config(dp), dp.seed).params) > 1e-3);
    for (const char* scheme : {"hybrid-a", "hybrid-b", "hybrid-c"}) {
      INFO(ranks << " ranks, " << scheme);
      const options hy = head_run(std::string(scheme) + std::to_string(ranks), ranks, scheme);
      check_trains_like(hy, ref, a, true);
    }
  }
}

TEST_CASE("with LARS and fp32 activations, hybrid trains the data-parallel LARS model", "[fashion][hybrid][lars]") {
  // The split layers' trust ratios come from the whole tensors' norms (optim::split_update); a
  // slice's own norm would give another λ per rank and another model.
  for (int ranks : {2, 3}) {
    options dp = head_run("lars-dp" + std::to_string(ranks), ranks, "data");
    dp.optimizer = "lars";
    dp.lr = 0.2;
    const run_result ref = train_inproc(dp);
    REQUIRE(ref.epochs.size() == 1);
    const checkpoint a = final_state(dp);
    CHECK(max_abs_diff(a.params, model_create(model_config(dp), dp.seed).params) > 1e-3);
    for (const char* scheme : {"hybrid-a", "hybrid-c"}) {
      INFO(ranks << " ranks, " << scheme);
      options hy = dp;
      hy.out = data_dir().dir + "/lars-" + scheme + std::to_string(ranks);
      hy.parallel = scheme;
      check_trains_like(hy, ref, a, false);
    }
  }
}

TEST_CASE("8-bit and bf16 activations train close to fp32 activations", "[fashion][hybrid]") {
  const options ref = head_run("act-ref", 2, "hybrid-c");
  const run_result base = train_inproc(ref);
  for (const char* act : {"bf16", "int8", "dyntree8"}) {
    INFO("activation codec " << act);
    options o = head_run(std::string("act-") + act, 2, "hybrid-b");
    o.activation_codec = act;
    const run_result r = train_inproc(o);
    REQUIRE(r.epochs.size() == 1);
    CHECK(rel(r.epochs[0].train_loss, base.epochs[0].train_loss) < 0.05);
    CHECK(r.epochs[0].test_loss < std::log(10.0));
  }
}

TEST_CASE("a hybrid checkpoint resumes as data-parallel and continues the data-parallel run", "[fashion][hybrid]") {
  options full = head_run("resume-full", 2, "data");
  full.epochs = 2;
  full.train_limit = 480;  // 20 steps per epoch
  train_inproc(full);
  options split = full;
  split.out = data_dir().dir + "/resume-split";
  split.parallel = "hybrid-a";
  split.stop_after = 1;
  train_inproc(split);
  split.parallel = "data";
  split.resume = true;
  train_inproc(split);
  const checkpoint a = final_state(full), b = final_state(split);
  CHECK(b.epochs_done == 2);
  CHECK(max_abs_diff(a.params, b.params) < 1e-4 * max_abs(a.params));
  CHECK(max_abs_diff(a.momentum, b.momentum) < 1e-4 * max_abs(a.momentum));
}

TEST_CASE("flags a hybrid run cannot honour are refused, naming the flag", "[fashion][hybrid]") {
  options o = head_run("refused", 2, "hybrid-a");
  o.fc = {0, 0};
  CHECK_THROWS_WITH(train_inproc(o), Catch::Contains("give --fc H1,H2"));
  o = head_run("refused", 2, "hybrid-c");
  o.codec = "int8";
  o.error_feedback = true;
  CHECK_THROWS_WITH(train_inproc(o), Catch::Contains("--error-feedback"));
  o = head_run("refused", 4, "hybrid-c");
  o.fc = {3, 8};
  CHECK_THROWS_WITH(train_inproc(o), Catch::Contains("needs at least one of fc1's columns"));
  o = head_run("refused", 2, "hybrid-d");
  CHECK_THROWS_WITH(train_inproc(o), Catch::Contains("--parallel must be data, hybrid-a, hybrid-b or hybrid-c"));
}

// Ranks started with different flags (one data-parallel, one hybrid) would post collectives that
// do not match, and over NCCL hang: the trainers gather every rank's flag fingerprints first, and
// every rank fails naming the flag and the rank.
TEST_CASE("ranks started with different --parallel, --fc or seed fail at once naming the flag", "[fashion][hybrid]") {
  struct variant {
    const char* flag;
    void (*change)(options&);
  };
  const variant variants[] = {
      {"--parallel", [](options& o) { o.parallel = "hybrid-a"; }},
      {"--activation-codec", [](options& o) { o.activation_codec = "int8"; }},  // under every rank's hybrid-b below
      {"--fc", [](options& o) { o.fc = {64, 32}; }},
      {"--seed", [](options& o) { o.seed += 1; }},
      {"training flags", [](options& o) { o.codec = "int8"; }},
  };
  for (const auto& v : variants) {
    CAPTURE(v.flag);
    std::mutex m;
    std::vector<std::string> what(3);
    lockstep::run_inproc(3, [&](auto& g) {
      options o;
      if (std::string(v.flag) == "--activation-codec") o.parallel = "hybrid-b";  // data parallel: not on the wire
      if (g.rank() == 2) v.change(o);
      try {
        sample::check_same_flags(g, flag_fingerprints(o));
      } catch (const std::invalid_argument& e) {
        std::lock_guard lk(m);
        what[static_cast<std::size_t>(g.rank())] = e.what();
      }
    });
    for (const auto& w : what)
      CHECK(w.rfind(std::string("rank 2 was started with other ") + v.flag, 0) == 0);
  }
  // The same flags everywhere: no error (run_inproc rethrows one).
  CHECK_NOTHROW(lockstep::run_inproc(3, [&](auto& g) { sample::check_same_flags(g, flag_fingerprints(options{})); }));
}
