// samples/common/layers_dnnl.hpp: oneDNN plumbing shared by the CPU backends of the sample
// trainers, and the linear classifier both use.
//
// Purpose: one engine and stream per thread, memory descriptors and handles, and
// linear_forward / linear_backward (inner product) in fp32, or with bf16 inputs and weights and
// fp32 accumulation and outputs (ResNet-50's --precision bf16). Primitives are built once per
// shape and thread (thread_local cache), so replicas running as threads never share a primitive or
// its scratchpad.
//
// Shape legend: B images, F features into the classifier, NC classes.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <array>
#include <bit>
#include <cstdint>
#include <map>
#include <vector>

namespace sample {

// ----------------------------------------------------------------------------------------------
// oneDNN plumbing: one engine and stream per thread, primitives cached by shape.

struct dnnl_context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};
inline dnnl_context& dnnl_ctx() {
  thread_local dnnl_context c;
  return c;
}

using shape_key = std::array<int, 6>;
using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;
using dtype = dnnl::memory::data_type;
constexpr auto f32 = dnnl::memory::data_type::f32;
constexpr auto bf16 = dnnl::memory::data_type::bf16;

inline dnnl::memory::desc md(const dims& d, tag t, dtype dt = f32) { return dnnl::memory::desc(d, dt, t); }
inline dnnl::memory mem(const dnnl::memory::desc& d, const void* p) {
  // oneDNN takes a non-const handle for inputs too; it never writes through an input argument.
  return dnnl::memory(d, dnnl_ctx().engine, const_cast<void*>(p));
}

// fp32 -> bf16, round to nearest even (NaN stays NaN). The activations' conversion; the weights'
// bf16 copy is the optimizer's (lockstep::optim::plan::weights_bf16).
inline std::uint16_t to_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

// ----------------------------------------------------------------------------------------------
// linear: out = inp weight^T + bias. dt: the type of inp and weight (f32, or bf16 with fp32
// accumulation); out, bias and every gradient are fp32.

struct linear_prims {
  dnnl::inner_product_forward fwd;
  dnnl::inner_product_backward_data bwd_data;
  dnnl::inner_product_backward_weights bwd_weights;
  dnnl::memory::desc src, wei, bias, dst, ddst, dsrc, dwei;
  std::vector<std::uint16_t> dout_bf16;  // (B, NC): the bf16 primitives want a bf16 output gradient
};

inline linear_prims& linear_lookup(int B, int F, int NC, dtype dt) {
  thread_local std::map<shape_key, linear_prims> cache;
  const shape_key key{B, F, NC, static_cast<int>(dt), 0, 0};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto& eng = dnnl_ctx().engine;
  using namespace dnnl;
  linear_prims p;
  p.src = md({B, F}, tag::nc, dt);
  p.wei = md({NC, F}, tag::oi, dt);
  p.bias = md({NC}, tag::x);
  p.dst = md({B, NC}, tag::nc);
  p.ddst = md({B, NC}, tag::nc, dt);
  p.dsrc = md({B, F}, tag::nc);
  p.dwei = md({NC, F}, tag::oi);
  inner_product_forward::desc fd(prop_kind::forward_training, p.src, p.wei, p.bias, p.dst);
  inner_product_forward::primitive_desc fpd(fd, eng);
  p.fwd = inner_product_forward(fpd);
  inner_product_backward_data::desc bd(p.dsrc, p.wei, p.ddst);
  p.bwd_data = inner_product_backward_data(inner_product_backward_data::primitive_desc(bd, eng, fpd));
  inner_product_backward_weights::desc bw(p.src, p.dwei, p.bias, p.ddst);
  p.bwd_weights = inner_product_backward_weights(inner_product_backward_weights::primitive_desc(bw, eng, fpd));
  if (dt == bf16) p.dout_bf16.resize(static_cast<std::size_t>(B) * NC);
  return cache.emplace(key, std::move(p)).first->second;
}

inline void linear_forward(float* out,           // (B, NC)
                           const void* inp,      // (B, F) of dt
                           const void* weight,   // (NC, F) of dt
                           const float* bias,    // (NC)
                           int B, int F, int NC, dtype dt = f32) {
  auto& p = linear_lookup(B, F, NC, dt);
  p.fwd.execute(dnnl_ctx().stream, {{DNNL_ARG_SRC, mem(p.src, inp)},
                                    {DNNL_ARG_WEIGHTS, mem(p.wei, weight)},
                                    {DNNL_ARG_BIAS, mem(p.bias, bias)},
                                    {DNNL_ARG_DST, mem(p.dst, out)}});
  dnnl_ctx().stream.wait();
}

inline void linear_backward(float* dinp,          // (B, F), overwritten
                            float* dweight,       // (NC, F), overwritten
                            float* dbias,         // (NC), overwritten
                            const float* dout,    // (B, NC)
                            const void* inp,      // (B, F) of dt
                            const void* weight,   // (NC, F) of dt
                            int B, int F, int NC, dtype dt = f32) {
  auto& p = linear_lookup(B, F, NC, dt);
  auto& s = dnnl_ctx().stream;
  const void* dy = dout;
  if (dt == bf16) {
    for (std::size_t i = 0; i < p.dout_bf16.size(); ++i) p.dout_bf16[i] = to_bf16(dout[i]);
    dy = p.dout_bf16.data();
  }
  p.bwd_weights.execute(s, {{DNNL_ARG_SRC, mem(p.src, inp)},
                            {DNNL_ARG_DIFF_DST, mem(p.ddst, dy)},
                            {DNNL_ARG_DIFF_WEIGHTS, mem(p.dwei, dweight)},
                            {DNNL_ARG_DIFF_BIAS, mem(p.bias, dbias)}});
  p.bwd_data.execute(s, {{DNNL_ARG_DIFF_DST, mem(p.ddst, dy)},
                         {DNNL_ARG_WEIGHTS, mem(p.wei, weight)},
                         {DNNL_ARG_DIFF_SRC, mem(p.dsrc, dinp)}});
  s.wait();
}

}  // namespace sample
