// tests/fuzz/fuzz_shm_frame.cpp: the receiving end of a shared-memory ring
// (transport/shm/endpoint.hpp: open_message, match, park, stream, read_by_reference) on ring
// bytes from the input, in one process.
//
// The consumer needs no second process: it reads the ring's bytes and its control block's head.
// So this target lays out a real segment for two local ranks (shm::layout, as routed.hpp does),
// writes the input into the ring from rank 1 to rank 0 with a head that never runs more than a
// ring ahead of the tail (the one thing a producer guarantees that no byte can break), and drives
// rank 0's endpoint through its public calls: irecv, wait, consume, progress, request destruction.
// The segment is mapped with a PROT_NONE page right after that ring's last byte (the ring is last
// in the layout and its capacity a multiple of a page), so a read or write past its end faults;
// receive buffers are exactly their size on the heap, where AddressSanitizer guards them.
//
// Input: [flags u8][tail u16][op count u8][ops: 3 bytes each][ring bytes ...]
//   flags bit 0: capacity 8192 instead of 4096; bit 1: rank 1 publishes this process's pid (a
//   by-reference record is then read with process_vm_readv from this process); bit 2: rank 1's
//   ring starts out starved; bit 3: head starts at the tail (ops move it) instead of the end.
//   ops (op, a, b): irecv (tag a & 3, b << (a >> 6) bytes), wait, consume (reads every byte it is
//   handed), progress, head += 8 (b + 1), destroy a request, toggle starved.
// Contract: every call returns, or throws lockstep::error, after which the endpoint is only
// destroyed (as a failed group does); a receive reported done holds the bytes asked for.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <lockstep/transport/shm/endpoint.hpp>

namespace shm = lockstep::transport::shm;

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_shm_frame: %s\n", what);
  std::abort();
}

struct mapped {
  shm::layout lay;
  std::shared_ptr<shm::segment> seg;
};

// One segment per capacity, made once: the segment, then a guard page after lay.total() bytes.
const mapped& segment_for(std::size_t capacity) {
  static mapped made[2];
  mapped& m = made[capacity == 8192];
  if (!m.seg) {
    m.lay = shm::layout{2, capacity};
    if (m.lay.ring_offset(1, 0) + shm::layout::round(sizeof(shm::ring_control)) + capacity != m.lay.total())
      fail("the ring from rank 1 to rank 0 is not the segment's last");
    m.seg = std::make_shared<shm::segment>();
    std::string name;
    if (const std::string why = m.seg->create_unique(m.lay.total() + shm::layout::page, name); !why.empty()) fail(why.c_str());
    shm::segment::unlink(name);
    if (mprotect(m.seg->base() + m.lay.total(), shm::layout::page, PROT_NONE) != 0) fail("mprotect of the guard page");
  }
  return m;
}

struct posted {
  std::unique_ptr<std::byte[]> dst;
  std::size_t bytes = 0;
  shm::request req;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 4) return 0;
  const std::uint8_t flags = data[0];
  const std::uint64_t tail0 = 8 * (std::uint64_t{data[1]} | std::uint64_t{data[2]} << 8);
  const std::size_t nops = std::min<std::size_t>(data[3], (size - 4) / 3);
  const std::uint8_t* ops = data + 4;
  const std::uint8_t* bytes = ops + 3 * nops;
  const std::size_t nbytes = size - 4 - 3 * nops;

  const std::size_t capacity = flags & 1 ? 8192 : 4096;
  const mapped& m = segment_for(capacity);
  std::byte* base = m.seg->base();
  std::memset(base, 0, m.lay.total());
  m.lay.format(base);
  auto& control = *reinterpret_cast<shm::ring_control*>(base + m.lay.ring_offset(1, 0));
  std::byte* ring = base + m.lay.ring_offset(1, 0) + shm::layout::round(sizeof(shm::ring_control));
  auto& peer = reinterpret_cast<shm::rank_block*>(base)[1];
  if (flags & 2) peer.pid.store(static_cast<std::int32_t>(getpid()));

  // The ring's bytes from position tail0 on, wrapping at its end.
  const std::size_t len = std::min(capacity, nbytes) / 8 * 8;
  for (std::size_t i = 0; i < len; ++i) ring[(tail0 + i) % capacity] = static_cast<std::byte>(bytes[i]);
  // The consumer trusts nothing of the ring's bytes (docs/reliability.md, Findings: the four
  // shm-* inputs in tests/fuzz/crashes/ are fixed and run like any other input). The only rule
  // kept is what every producer, correct or not, is held to by the consumer's own check: the
  // head at most a ring ahead of the tail (drain() reports a ring corrupt otherwise).
  auto set_head = [&](std::uint64_t want) { control.head.store(std::min(want, control.tail.load() + capacity)); };
  control.tail.store(tail0);
  control.head.store(tail0);
  if (!(flags & 8)) set_head(tail0 + len);
  control.starved.store(flags & 4 ? 1 : 0);

  {
    auto ep = std::make_shared<shm::endpoint>(m.seg, m.lay, 0, std::vector<int>{0, 1});
    std::vector<posted> recvs;
    try {
      for (std::size_t k = 0; k < nops; ++k) {
        const std::uint8_t op = ops[3 * k] % 7, a = ops[3 * k + 1], b = ops[3 * k + 2];
        posted* r = recvs.empty() ? nullptr : &recvs[a % recvs.size()];
        const auto now = lockstep::transport::clock::now();
        switch (op) {
          case 0: {
            if (recvs.size() == 8) break;
            posted p;
            p.bytes = std::size_t{b} << (a >> 6);
            p.dst.reset(new std::byte[p.bytes]);
            p.req = ep->irecv(1, a & 3, p.dst.get(), p.bytes);
            recvs.push_back(std::move(p));
            break;
          }
          case 1:
            if (r && ep->wait(r->req, now) && !r->req.done()) fail("wait returned true for a request that is not done");
            break;
          case 2:
            if (r && !r->req.done())
              ep->consume(r->req, now, [&](const std::byte* got) {
                unsigned sum = 0;
                for (std::size_t i = 0; i < r->bytes; ++i) sum += static_cast<unsigned>(got[i]);
                volatile unsigned keep = sum;
                (void)keep;
              });
            break;
          case 3: ep->progress(); break;
          case 4: {
            const std::uint64_t head = control.head.load(), tail = control.tail.load();
            if (head < tail || head - tail > capacity) fail("the consumer's tail passed the head");
            const std::uint64_t want = head + 8 * (std::uint64_t{b} + 1);
            set_head(want);
            break;
          }
          case 5:
            if (r) r->req = shm::request{};  // destroyed unfinished: withdrawn
            break;
          case 6: control.starved.store(control.starved.load() ^ 1u); break;
        }
      }
    } catch (const lockstep::error&) {
      // A corrupt ring is reported; the group then fails and its endpoint goes away.
    }
    // Requests go before the endpoint, as a failing collective's do.
  }
  return 0;
}
