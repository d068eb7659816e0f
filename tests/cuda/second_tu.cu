// A second CUDA translation unit in every GPU test program (linked through gpu_main): it includes
// every device header (but transport/nccl.hpp, which needs NCCL to link), so a kernel or function
// defined in a header without inline, static or template linkage shows up as a "multiple
// definition" link error of every GPU test, here and not in a user's program that includes
// lockstep from two .cu files.
#include <lockstep/device/codec.hpp>
#include <lockstep/device/space.hpp>
#include <lockstep/device/optim.hpp>
#include <lockstep/device/reduce.hpp>
#include <lockstep/device/runtime.hpp>
#include <lockstep/device/step.hpp>
#include <lockstep/transport/inproc_device.hpp>

// Referenced by main.cpp, so that the linker takes this object out of the gpu_main archive.
int lockstep_second_tu_linked = 1;
