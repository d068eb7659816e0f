// bench/cli.hpp: what the bench tools' command lines share: comma-separated lists
// (--topology ring,torus2d --ranks 1,2,4). Tooling, not library.
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace lockstep::bench {

// "a,b,,c" -> {"a", "b", "c"}: empty items are dropped.
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace lockstep::bench
