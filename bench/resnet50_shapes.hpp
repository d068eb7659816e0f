// bench/resnet50_shapes.hpp: the 161 parameter tensors of ResNet-50 (torchvision's layout, v1.5),
// in the order torch's model.parameters() yields them: 25,557,032 parameters, 53 convolutions,
// 53 batch norms (γ and β, exempt from LARS), one fully connected layer (its bias exempt).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace lockstep::bench {

struct tensor_shape {
  std::string name;
  std::vector<std::size_t> dims;
  bool exempt;  // bias or batch-norm parameter
  std::size_t size() const {
    std::size_t n = 1;
    for (std::size_t d : dims) n *= d;
    return n;
  }
};

inline std::vector<tensor_shape> resnet50_shapes() {
  std::vector<tensor_shape> ts;
  auto conv = [&](const std::string& name, std::size_t out, std::size_t in, std::size_t k) {
    ts.push_back({name + ".weight", {out, in, k, k}, false});
  };
  auto bn = [&](const std::string& name, std::size_t c) {
    ts.push_back({name + ".weight", {c}, true});
    ts.push_back({name + ".bias", {c}, true});
  };
  conv("conv1", 64, 3, 7);
  bn("bn1", 64);
  const std::size_t blocks[4] = {3, 4, 6, 3};
  std::size_t in = 64;
  for (int l = 0; l < 4; ++l) {
    const std::size_t width = std::size_t{64} << l, out = width * 4;
    for (std::size_t b = 0; b < blocks[l]; ++b) {
      const std::string p = "layer" + std::to_string(l + 1) + "." + std::to_string(b);
      conv(p + ".conv1", width, in, 1);
      bn(p + ".bn1", width);
      conv(p + ".conv2", width, width, 3);
      bn(p + ".bn2", width);
      conv(p + ".conv3", out, width, 1);
      bn(p + ".bn3", out);
      if (b == 0) {
        conv(p + ".downsample.0", out, in, 1);
        bn(p + ".downsample.1", out);
      }
      in = out;
    }
  }
  ts.push_back({"fc.weight", {1000, 2048}, false});
  ts.push_back({"fc.bias", {1000}, true});
  return ts;
}

}  // namespace lockstep::bench
