// samples/common/flags.hpp: command-line parsing shared by the sample trainers: one flag at a time,
// values and numbers checked, and every error a sentence naming the flag, then exit status 2.
//
//   sample::flag_parser p(argc, argv, "lockstep-train-fashion");
//   while (p.next()) {
//     if (p.is("--out")) o.out = p.value();
//     else if (p.is("--epochs")) o.epochs = p.whole<int>();
//     else p.unknown();
//   }
// Limits: flags and values are separate arguments ("--epochs 4", not "--epochs=4").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

namespace sample {

[[noreturn]] inline void die(const char* program, const std::string& msg) {
  std::fprintf(stderr, "%s: %s (see --help)\n", program, msg.c_str());
  std::exit(2);
}

class flag_parser {
 public:
  // fallback: the program's name when argv[0] is missing.
  flag_parser(int argc, char** argv, const char* fallback) : argc_(argc), argv_(argv) {
    const char* slash = argv[0] ? std::strrchr(argv[0], '/') : nullptr;
    program_ = slash ? slash + 1 : (argv[0] ? argv[0] : fallback);
  }

  const char* program() const { return program_; }

  // Moves to the next flag; false once all are read.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    return true;
  }
  const std::string& flag() const { return flag_; }
  bool is(const char* name) const { return flag_ == name; }

  // The argument after the flag.
  std::string value() {
    if (i_ + 1 >= argc_) fail(flag_ + " needs a value");
    return argv_[++i_];
  }
  // The argument after the flag, which must be a finite number (nan or inf once passed, and
  // --lr nan then ran at the default rate).
  double number() {
    const std::string v = value();
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end) fail(flag_ + ": '" + v + "' is not a number");
    if (!std::isfinite(x)) fail(flag_ + ": '" + v + "' is not a finite number");
    return x;
  }
  // The argument after the flag, which must be a whole number that T holds (below 2^53): 64.7
  // once ran as 64, 1e12 as an int's undefined conversion, -1 as a seed's.
  template <class T>
  T whole() {
    const double x = number();
    const double lo = std::max(static_cast<double>(std::numeric_limits<T>::lowest()), -0x1p53);
    const double hi = std::min(static_cast<double>(std::numeric_limits<T>::max()), 0x1p53);
    if (x != std::floor(x) || x < lo || x > hi)
      fail(flag_ + ": '" + argv_[i_] + "' is not a whole number from " + std::to_string(static_cast<long long>(lo)) +
           " to " + std::to_string(static_cast<long long>(hi)));
    return static_cast<T>(x);
  }

  [[noreturn]] void fail(const std::string& msg) const { die(program_, msg); }
  [[noreturn]] void unknown() const { fail("unknown flag '" + flag_ + "'"); }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
  const char* program_;
  std::string flag_;
};

}  // namespace sample
