// samples/resnet50/layers_math.hpp: the element math of ResNet-50's own kernels, written once for
// both backends.
//
// Purpose: the oneDNN backend (layers_cpu.hpp) and the cuDNN backend (layers_cuda.cuh) differ in
// who runs convolutions and the classifier, but batch norm (+ ReLU), a bottleneck's end (batch
// norm, residual add, ReLU), 3x3/2 max pooling and global average pooling are own kernels on both.
// Their per-element arithmetic lives here as LOCKSTEP_HD functions, so the CPU tests (finite
// differences, torch) cover what the GPU runs; the backends differ only where a kernel sums many
// elements (batch norm's per-channel sums: chunks on the CPU, a CUDA block per channel on the GPU).
// Max pooling's backward sums each input cell's gradient over the outputs whose windows cover it, in
// output order, and average pooling sums in cell order, so both backends add the same terms in the
// same order (the GPU one channel per thread, the CPU across channels in vector lanes).
//
// Shape legend (NHWC): H,W input side, OH,OW output side, C channels; an image is (H, W, C).
#pragma once

#include <lockstep/codec/bf16.hpp>
#include <lockstep/core/config.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/batch_norm.hpp"

namespace resnet {

using bf16_t = std::uint16_t;  // bf16 bits, what convolutions read under --precision bf16

// An activation stored as T (float, or bf16 rounded to nearest even) and read back as fp32.
template <class T>
LOCKSTEP_HD inline T store_as(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return lockstep::codec::bf16::to_wire(x);
}
LOCKSTEP_HD inline float load(float x) { return x; }
LOCKSTEP_HD inline float load(bf16_t x) { return lockstep::codec::bf16::from_wire(x); }

// ----------------------------------------------------------------------------------------------
// Batch norm (sample::bn_fold's a = gamma rstd, c = beta - mean a), with or without the ReLU: the
// functions the Fashion CNN uses too (samples/common/batch_norm.hpp).

using sample::bn_apply;  // the forward
using sample::bn_dx;     // dx = a (dy - mean(dy) - xhat mean(dy xhat)), the means over the group
using sample::bn_dy;     // dy, the gradient before the ReLU

// ----------------------------------------------------------------------------------------------
// A bottleneck's end: max(0, BN(x) + shortcut), the shortcut the block's input or BN_d(xd).

LOCKSTEP_HD inline float bn_add_relu(float x, sample::bn_affine f, float shortcut) {
  const float y = x * f.a + f.c + shortcut;
  return y > 0.0f ? y : 0.0f;
}

LOCKSTEP_HD inline float bn_add_bn_relu(float x, sample::bn_affine f, float xd, sample::bn_affine fd) {
  const float y = x * f.a + f.c + xd * fd.a + fd.c;
  return y > 0.0f ? y : 0.0f;
}

// Its backward's first step: the gradient of both summands, where the output was positive.
LOCKSTEP_HD inline float add_relu_grad(float out, float g) { return out > 0.0f ? g : 0.0f; }

// ----------------------------------------------------------------------------------------------
// maxpool3x3: 3x3 windows, stride 2, padding 1 (padding never wins). `which` (0..8) says which
// cell of the window won, the first in row-major order on ties.

LOCKSTEP_HD inline int pool3_out(int n) { return (n + 2 - 3) / 2 + 1; }

// Output (oy, ox, c) of one image (H, W, C) of T.
template <class T>
LOCKSTEP_HD inline float maxpool3_cell(const T* img, int H, int W, int C, int oy, int ox, int c, std::uint8_t* which) {
  float best = -INFINITY;
  std::uint8_t w = 0;
  for (int k = 0; k < 9; ++k) {
    const int iy = 2 * oy - 1 + k / 3, ix = 2 * ox - 1 + k % 3;
    if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
    const float v = load(img[(static_cast<std::size_t>(iy) * W + ix) * C + c]);
    if (v > best) best = v, w = static_cast<std::uint8_t>(k);
  }
  *which = w;
  return best;
}

// Max pooling's backward, one input cell (iy, ix) at a time: the outputs whose windows cover it are
// oy = pool3_first(iy) .. pool3_last(iy, OH) (windows of oy cover rows 2oy-1 .. 2oy+1), ox alike;
// the cell is maxpool3_k(...) of such a window, and takes the window's output gradient d where the
// window's winner is that cell (maxpool3_term). Adding the 0.0f of a window it lost changes no bit
// of a sum that starts at +0.0f (such a sum is never -0.0f), so the per-cell gather below (the GPU)
// and the CPU's loop over channels (kernels_cpu.hpp) add the same terms in the same order.
LOCKSTEP_HD inline int pool3_first(int i) { return i / 2; }
LOCKSTEP_HD inline int pool3_last(int i, int O) { return (i + 1) / 2 < O - 1 ? (i + 1) / 2 : O - 1; }
LOCKSTEP_HD inline int maxpool3_k(int iy, int ix, int oy, int ox) { return (iy - 2 * oy + 1) * 3 + (ix - 2 * ox + 1); }
LOCKSTEP_HD inline float maxpool3_term(int which, int k, float d) { return which == k ? d : 0.0f; }

// The gradient of input cell (iy, ix, c) of one image: the sum of the output gradients (OH, OW, C)
// whose window it won, in output order (oy, then ox).
LOCKSTEP_HD inline float maxpool3_gather(const float* dout, const std::uint8_t* which, int OH, int OW, int C, int iy,
                                         int ix, int c) {
  float s = 0.0f;
  for (int oy = pool3_first(iy); oy <= pool3_last(iy, OH); ++oy)
    for (int ox = pool3_first(ix); ox <= pool3_last(ix, OW); ++ox) {
      const std::size_t o = (static_cast<std::size_t>(oy) * OW + ox) * C + c;
      s += maxpool3_term(which[o], maxpool3_k(iy, ix, oy, ox), dout[o]);
    }
  return s;
}

// ----------------------------------------------------------------------------------------------
// global_avgpool: the mean of channel c over the HW cells of one image (HW, C), summed in cell order
// from 0.0f: avgpool_add per cell, avgpool_mean at the end (the CPU runs the same steps across
// channels, kernels_cpu.hpp).

template <class T>
LOCKSTEP_HD inline float avgpool_add(float acc, T v) { return acc + load(v); }
LOCKSTEP_HD inline float avgpool_mean(float sum, int HW) { return sum / HW; }

template <class T>
LOCKSTEP_HD inline float avgpool_cell(const T* img, int HW, int C, int c) {
  float acc = 0.0f;
  for (int i = 0; i < HW; ++i) acc = avgpool_add(acc, img[static_cast<std::size_t>(i) * C + c]);
  return avgpool_mean(acc, HW);
}

LOCKSTEP_HD inline float avgpool_grad(float dout, int HW) { return dout * (1.0f / HW); }

}  // namespace resnet
