// samples/resnet50/layers_cpu.hpp: the layers of ResNet-50 on the CPU, one free function per layer
// and direction, outputs first.
//
// Purpose: the arithmetic of the sample, apart from the model's wiring (model.hpp). Convolutions
// and the classifier run on oneDNN (samples/common/layers_dnnl.hpp); batch norm is an own kernel
// because its statistics span a group of replicas (samples/common/batch_norm.hpp, as the Fashion
// sample's), and so are the ReLU, residual add, 3x3 max pooling and global average pooling, which
// are a pass over memory each (kernels_cpu.hpp, which needs no oneDNN). A bottleneck's last batch norm, its residual add and the ReLU are
// one pass (bn_add_relu), forward and in backward's first pass. Batch norm's per-channel sums were first split by blocks of 16
// channels, each thread walking every row: 27% of a 224x224 batch-16 step (perf); summed by rows of
// all K channels in chunks they take 4%.
// Activations are NHWC (channels innermost): oneDNN's AVX-512 convolutions take it directly, and
// the per-channel kernels here vectorise over channels. T is the type convolutions read (float, or
// bf16 stored as std::uint16_t under --precision bf16); convolutions write fp32, batch norm reads
// fp32 and writes T, and every activation gradient is fp32 except a convolution's output gradient
// (T, what the bf16 primitives take).
// The element math of the own kernels is layers_math.hpp's, shared with the GPU backend.
// Limits: square kernels with padding R/2; max pooling 3x3 stride 2 padding 1 only. Primitives are
// built once per shape and thread (thread_local cache), as in the Fashion sample.
//
// Shape legend:
//   B  images of this replica     H,W input height, width      OH,OW output height, width
//   C  input channels             K   output channels          R   kernel side
//   N  rows of an NHWC tensor: B*H*W                           G   replicas of a batch-norm group
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <vector>

#include "../common/batch_norm.hpp"
#include "../common/layers_dnnl.hpp"
#include "../common/softmax_xent.hpp"
#include "kernels_cpu.hpp"
#include "layers_math.hpp"

namespace resnet {

using sample::bf16;
using sample::bn_group;
using sample::dims;
using sample::dnnl_ctx;
using sample::dtype;
using sample::f32;
using sample::linear_backward;
using sample::linear_forward;
using sample::md;
using sample::mem;
using sample::tag;

template <class T>
constexpr dtype dtype_of = std::is_same_v<T, float> ? f32 : bf16;

// ----------------------------------------------------------------------------------------------
// conv: out = conv(inp, weight), R x R kernel, stride S, padding R/2, no bias (batch norm follows).
// Weights are kept OIHW (torch's layout, the flat parameter block's); oneDNN runs its own blocked
// weight format, so each call reorders them in (and the weight gradient out): 2 bytes/parameter
// of traffic per use, against a convolution's B*OH*OW*C*R*R multiply-adds.

struct conv_shape {
  int B, C, H, W, K, R, S;
  int OH() const { return (H + 2 * (R / 2) - R) / S + 1; }
  int OW() const { return (W + 2 * (R / 2) - R) / S + 1; }
};

struct conv_prims {
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  dnnl::memory::desc src, dst, ddst, dsrc, wei_user, dwei_user;          // ours: NHWC, OIHW
  dnnl::memory::desc wei_fwd, wei_bwd, dwei;                             // oneDNN's choice
  dnnl::memory wei_fwd_m, wei_bwd_m, dwei_m;                             // reorder targets
  dnnl::reorder to_fwd, to_bwd, from_dwei;                               // empty when formats match
  std::string impl;                                                      // what oneDNN picked
};

inline conv_prims& conv_lookup(const conv_shape& s, dtype dt) {
  thread_local std::map<std::array<int, 8>, conv_prims> cache;
  const std::array<int, 8> key{s.B, s.C, s.H, s.W, s.K, s.R, s.S, static_cast<int>(dt)};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  using namespace dnnl;
  auto& eng = dnnl_ctx().engine;
  conv_prims p;
  const int P = s.R / 2;
  p.src = md({s.B, s.C, s.H, s.W}, tag::nhwc, dt);
  p.dst = md({s.B, s.K, s.OH(), s.OW()}, tag::nhwc, f32);
  p.ddst = md({s.B, s.K, s.OH(), s.OW()}, tag::nhwc, dt);
  p.dsrc = md({s.B, s.C, s.H, s.W}, tag::nhwc, f32);
  p.wei_user = md({s.K, s.C, s.R, s.R}, tag::oihw, dt);
  p.dwei_user = md({s.K, s.C, s.R, s.R}, tag::oihw, f32);
  const auto wany = md({s.K, s.C, s.R, s.R}, tag::any, dt), dwany = md({s.K, s.C, s.R, s.R}, tag::any, f32);
  const dims stride{s.S, s.S}, pad{P, P};
  convolution_forward::desc fd(prop_kind::forward_training, algorithm::convolution_direct, p.src, wany, p.dst, stride,
                               pad, pad);
  convolution_forward::primitive_desc fpd(fd, eng);
  p.fwd = convolution_forward(fpd);
  convolution_backward_data::desc bd(algorithm::convolution_direct, p.dsrc, wany, p.ddst, stride, pad, pad);
  convolution_backward_data::primitive_desc bpd(bd, eng, fpd);
  p.bwd_data = convolution_backward_data(bpd);
  convolution_backward_weights::desc bw(algorithm::convolution_direct, p.src, dwany, p.ddst, stride, pad, pad);
  convolution_backward_weights::primitive_desc wpd(bw, eng, fpd);
  p.bwd_weights = convolution_backward_weights(wpd);
  p.wei_fwd = fpd.weights_desc();
  p.wei_bwd = bpd.weights_desc();
  p.dwei = wpd.diff_weights_desc();
  if (p.wei_fwd != p.wei_user) {
    p.wei_fwd_m = memory(p.wei_fwd, eng);
    p.to_fwd = reorder(memory(p.wei_user, eng, nullptr), p.wei_fwd_m);
  }
  if (p.wei_bwd != p.wei_user) {
    p.wei_bwd_m = memory(p.wei_bwd, eng);
    p.to_bwd = reorder(memory(p.wei_user, eng, nullptr), p.wei_bwd_m);
  }
  if (p.dwei != p.dwei_user) {
    p.dwei_m = memory(p.dwei, eng);
    p.from_dwei = reorder(p.dwei_m, memory(p.dwei_user, eng, nullptr));
  }
  p.impl = std::string(fpd.impl_info_str()) + " / " + bpd.impl_info_str() + " / " + wpd.impl_info_str();
  return cache.emplace(key, std::move(p)).first->second;
}

// The weights in the format primitive `target` wants: `user` itself, or reordered into `m`.
inline dnnl::memory weights_for(const dnnl::reorder& to, dnnl::memory& m, const dnnl::memory::desc& user,
                                const void* weight) {
  if (!to) return mem(user, weight);
  to.execute(dnnl_ctx().stream, {{DNNL_ARG_FROM, mem(user, weight)}, {DNNL_ARG_TO, m}});
  return m;
}

inline void conv_forward(float* out,          // (B, OH, OW, K) fp32
                         const void* inp,     // (B, H, W, C) of dt
                         const void* weight,  // (K, C, R, R) of dt
                         const conv_shape& s, dtype dt = f32) {
  auto& p = conv_lookup(s, dt);
  auto& st = dnnl_ctx().stream;
  const dnnl::memory w = weights_for(p.to_fwd, p.wei_fwd_m, p.wei_user, weight);
  p.fwd.execute(st, {{DNNL_ARG_SRC, mem(p.src, inp)}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, mem(p.dst, out)}});
  st.wait();
}

inline void conv_backward(float* dinp,         // (B, H, W, C) fp32, overwritten; or null (not needed)
                          float* dweight,      // (K, C, R, R) fp32, overwritten
                          const void* dout,    // (B, OH, OW, K) of dt
                          const void* inp,     // (B, H, W, C) of dt, as in the forward pass
                          const void* weight,  // (K, C, R, R) of dt
                          const conv_shape& s, dtype dt = f32) {
  auto& p = conv_lookup(s, dt);
  auto& st = dnnl_ctx().stream;
  const dnnl::memory dw = p.from_dwei ? p.dwei_m : mem(p.dwei_user, dweight);
  p.bwd_weights.execute(st, {{DNNL_ARG_SRC, mem(p.src, inp)}, {DNNL_ARG_DIFF_DST, mem(p.ddst, dout)},
                             {DNNL_ARG_DIFF_WEIGHTS, dw}});
  if (p.from_dwei) p.from_dwei.execute(st, {{DNNL_ARG_FROM, p.dwei_m}, {DNNL_ARG_TO, mem(p.dwei_user, dweight)}});
  if (dinp) {
    const dnnl::memory w = weights_for(p.to_bwd, p.wei_bwd_m, p.wei_user, weight);
    p.bwd_data.execute(st, {{DNNL_ARG_DIFF_DST, mem(p.ddst, dout)}, {DNNL_ARG_WEIGHTS, w},
                            {DNNL_ARG_DIFF_SRC, mem(p.dsrc, dinp)}});
  }
  st.wait();
}

// What oneDNN runs for this convolution (forward / backward data / backward weights).
inline const std::string& conv_impl(const conv_shape& s, dtype dt) { return conv_lookup(s, dt).impl; }

}  // namespace resnet
