// tests/fuzz/fuzz_wire_header.cpp: lockstep::detail::describe_mismatch on two collective headers
// (collective/executor.hpp), the check every rank runs on the header a peer sent it.
//
// Input: [which fields differ: u16 mask][header A: 56 bytes][header B: 56 bytes]. "theirs" is A with
// the fields whose mask bit is set taken from B, so equal headers and single-field differences are
// as common as arbitrary ones. Checked: the answer is "" exactly when all ten fields are equal,
// whichever side is whose; a non-empty answer is printable ASCII and the same when asked again.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <lockstep/collective/executor.hpp>

namespace {

using lockstep::detail::wire_header;
static_assert(sizeof(wire_header) == 56, "wire_header gained padding or a field: update this target");

[[noreturn]] void fail(const char* what, const std::string& said) {
  std::fprintf(stderr, "fuzz_wire_header: %s (said \"%s\")\n", what, said.c_str());
  std::abort();
}

bool all_equal(const wire_header& a, const wire_header& b) {
  return a.magic == b.magic && a.kind == b.kind && a.codec_id == b.codec_id && a.topology_id == b.topology_id &&
         a.rop == b.rop && a.root == b.root && a.count == b.count && a.segment == b.segment && a.seq == b.seq &&
         a.layout == b.layout;
}

void check_text(const std::string& s) {
  for (const char ch : s)
    if (ch < 0x20 || ch > 0x7e) fail("a byte that is not printable ASCII", s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint8_t in[2 + 2 * sizeof(wire_header)] = {};
  std::memcpy(in, data, size < sizeof in ? size : sizeof in);
  const unsigned mask = in[0] | unsigned{in[1]} << 8;
  wire_header mine, other;
  std::memcpy(&mine, in + 2, sizeof mine);
  std::memcpy(&other, in + 2 + sizeof mine, sizeof other);
  wire_header theirs = mine;
  if (mask & 1u << 0) theirs.magic = other.magic;
  if (mask & 1u << 1) theirs.kind = other.kind;
  if (mask & 1u << 2) theirs.codec_id = other.codec_id;
  if (mask & 1u << 3) theirs.topology_id = other.topology_id;
  if (mask & 1u << 4) theirs.rop = other.rop;
  if (mask & 1u << 5) theirs.root = other.root;
  if (mask & 1u << 6) theirs.count = other.count;
  if (mask & 1u << 7) theirs.segment = other.segment;
  if (mask & 1u << 8) theirs.seq = other.seq;
  if (mask & 1u << 10) theirs.layout = other.layout;
  if (mask & 1u << 9) theirs.magic = mine.magic = wire_header{}.magic;  // the real magic on both sides

  const bool equal = all_equal(mine, theirs);
  for (const auto& [a, b] : {std::pair{&mine, &theirs}, std::pair{&theirs, &mine}}) {
    const std::string said = lockstep::detail::describe_mismatch(*a, *b);
    if (said.empty() != equal) fail(equal ? "equal headers reported as different" : "different headers reported as equal", said);
    check_text(said);
    if (lockstep::detail::describe_mismatch(*a, *b) != said) fail("a second call said something else", said);
  }
  return 0;
}
