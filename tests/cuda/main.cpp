// The Catch2 main of the GPU tests. Without a GPU a test program must report "skipped" (exit code
// 77, which Meson counts as SKIP), never "passed": nothing it claims was checked.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include <lockstep/device/runtime.hpp>

extern int lockstep_second_tu_linked;  // second_tu.cu: every device header in a second .cu

int main(int argc, char** argv) {
  if (!lockstep_second_tu_linked) return 1;
  if (lockstep::device::device_count() == 0) {
    std::printf("no CUDA device visible: skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
