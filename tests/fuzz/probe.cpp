// tests/fuzz/probe.cpp: what a compiler must do to build the fuzz targets: C++20 as the samples
// use it (a lambda that captures a structured binding: clang 16 and later) and link a libFuzzer
// target with AddressSanitizer and UndefinedBehaviorSanitizer. Compiled at configure time only.
#include <cstddef>
#include <cstdint>
#include <utility>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto [a, b] = std::pair{size, data};
  return [&] { return a > 0 && b[0] == 0; }() ? 0 : 0;
}
