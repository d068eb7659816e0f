// A program outside the tree: built against the installed headers through pkg-config, it runs an
// all-reduce over 3 in-process ranks and checks the sum.
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <vector>

int main() {
  bool ok = true;
  lockstep::run_inproc(3, [&](auto& g) {
    std::vector<float> v(1000, static_cast<float>(g.rank() + 1));
    lockstep::codec::bf16 c;
    lockstep::all_reduce(g, std::span<float>(v), lockstep::topology::ring{}, c);
    for (float x : v) ok = ok && x == 6.0f;
  });
  std::puts(ok ? "consumer: all-reduce over the installed headers is correct" : "consumer: wrong sum");
  return ok ? 0 : 1;
}
