// samples/fashion_cnn/layers_math.hpp: the element math of the sample's own kernels, written once
// for both backends.
//
// Purpose: the oneDNN backend (layers_cpu.hpp) and the cuDNN backend (layers_cuda.cuh) differ in
// who runs convolutions and matrix products, but max pooling, batch norm + ReLU and the loss are
// own kernels on both, and so are the --fc head's bias + ReLU. Their per-element arithmetic lives here as LOCKSTEP_HD functions, so the CPU
// tests (finite differences, distributed BN against whole-batch BN) cover what the GPU runs, and
// the two backends can only differ in summation order. The merge of batch-norm statistics across a
// group runs on the host for both backends (G (2K + 1) floats).
// Limits: 2x2 max pooling with stride 2 (odd sizes round up); ReLU fused after batch norm.
#pragma once

#include <lockstep/core/config.hpp>

#include "../common/batch_norm.hpp"
#include "../common/softmax_xent_math.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace fashion {

// ----------------------------------------------------------------------------------------------
// maxpool2x2

LOCKSTEP_HD inline int pooled(int n) { return (n + 1) / 2; }

// Output cell (oy, ox) of one H x W plane: the largest of the (up to) four cells of its window,
// the first in row-major order on ties; `which` (0..3) says which one won.
LOCKSTEP_HD inline float maxpool_cell(const float* plane, int H, int W, int oy, int ox, std::uint8_t* which) {
  float best = plane[(2 * oy) * W + 2 * ox];
  std::uint8_t w = 0;
  for (std::uint8_t k = 1; k < 4; ++k) {
    const int iy = 2 * oy + (k >> 1), ix = 2 * ox + (k & 1);
    if (iy < H && ix < W && plane[iy * W + ix] > best) best = plane[iy * W + ix], w = k;
  }
  *which = w;
  return best;
}

// One byte per output cell: which of the four won (0..3), kept for the backward pass.
inline std::size_t maxpool_workspace_bytes(int B, int C, int H, int W) {
  return static_cast<std::size_t>(B) * C * pooled(H) * pooled(W);
}

// Where in its H x W plane the winner of output cell (oy, ox) was: its gradient goes there.
LOCKSTEP_HD inline int maxpool_source(int W, int oy, int ox, int which) {
  return (2 * oy + (which >> 1)) * W + 2 * ox + (which & 1);
}

// ----------------------------------------------------------------------------------------------
// batch norm + ReLU: the element math, the group and the merge of statistics are shared with the
// ResNet-50 sample (samples/common/batch_norm.hpp).

using sample::bn_affine;
using sample::bn_fold;
using sample::bn_group;
using sample::bn_merge_stats;
using sample::bn_relu;
using sample::bn_relu_dx;
using sample::bn_relu_dy;
using sample::bn_xhat;

// ----------------------------------------------------------------------------------------------
// softmax cross-entropy with label smoothing: samples/common/softmax_xent.hpp.

using sample::xent_grad;
using sample::xent_row;
using sample::xent_target;

// ----------------------------------------------------------------------------------------------
// The --fc head's hidden layers: y = relu(x · W + b). The products are sgemm (oneDNN or cuBLAS);
// the bias, the ReLU and their backward are these.

// One output element: the product's value v plus its bias, through the ReLU.
LOCKSTEP_HD inline float bias_relu(float v, float b) {
  const float y = v + b;
  return y > 0.0f ? y : 0.0f;
}

// The gradient dy of a ReLU's output y, taken back through it (y is the output, not the input:
// y > 0 exactly where the input was).
LOCKSTEP_HD inline float relu_back(float dy, float y) { return y > 0.0f ? dy : 0.0f; }

}  // namespace fashion
