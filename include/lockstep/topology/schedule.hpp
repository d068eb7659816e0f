// lockstep/topology/schedule.hpp: a schedule is data — who talks to whom, in which order, about
// which chunks — so the executor, the property tests and the simulator all walk the same steps.
//
// The buffer is cut into `chunks` equal pieces (chunk c of n elements covers
// [c*n/chunks, (c+1)*n/chunks)). One step of one rank sends a contiguous span of chunks to one
// peer and receives a span from another, then either adds what it received into its own copy
// (reduce) or overwrites its copy with it (copy). A step never receives into chunks it is sending,
// except in an *exchange* (is_exchange): a reduce step whose send and receive peer are one rank and
// whose spans are one span. Both ends then send their values of the span as they were before the
// step and each ends with the sum of the two, the same bits on both (recursive doubling).
#pragma once

#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep::topology {

enum class action : std::uint8_t { reduce, copy };
enum class phase : std::uint8_t {
  reduce_scatter,  // partial sums travel; at the end each rank owns its reduced chunk(s)
  all_gather,      // owned, final chunks travel
  scatter,         // broadcast's first half: the root hands out chunks
};

struct chunk_span {
  std::uint32_t first = 0;
  std::uint32_t count = 0;
  constexpr std::uint32_t end() const noexcept { return first + count; }
  constexpr bool empty() const noexcept { return count == 0; }
  constexpr bool overlaps(chunk_span o) const noexcept {
    return !empty() && !o.empty() && first < o.end() && o.first < end();
  }
  friend constexpr bool operator==(chunk_span, chunk_span) = default;
};

struct step {
  int send_peer = -1;  // -1: nothing to send in this step
  chunk_span send;
  int recv_peer = -1;  // -1: nothing to receive in this step
  chunk_span recv;
  action act = action::copy;
  enum phase phase = phase::all_gather;
};

// Both ends of an exchange send the same span to each other and add what they receive.
constexpr bool is_exchange(const step& st) noexcept {
  return st.act == action::reduce && st.send_peer >= 0 && st.send_peer == st.recv_peer && st.send == st.recv;
}

struct schedule {
  int rank = 0;
  int size = 1;
  std::uint32_t chunks = 1;
  std::vector<step> steps;
  chunk_span owned;  // what this rank holds reduced after the reduce-scatter steps (may be empty:
                     // a rank folded out of recursive doubling receives its result whole)

  schedule& append(const schedule& next) {
    steps.insert(steps.end(), next.steps.begin(), next.steps.end());
    return *this;
  }

  friend std::ostream& operator<<(std::ostream& os, const schedule& s) {
    auto span = [](chunk_span c) {
      std::ostringstream o;
      if (c.count == 1) o << "chunk " << c.first;
      else o << "chunks " << c.first << ".." << c.end() - 1;
      return o.str();
    };
    os << "rank " << s.rank << " of " << s.size << ", " << s.chunks << " chunks, owns "
       << (s.owned.empty() ? std::string("nothing") : span(s.owned)) << "\n";
    for (std::size_t i = 0; i < s.steps.size(); ++i) {
      const step& st = s.steps[i];
      const char* ph = st.phase == phase::reduce_scatter ? "rs" : st.phase == phase::all_gather ? "ag" : "sc";
      os << "  " << i << " [" << ph << "]";
      if (is_exchange(st)) {
        os << " exchange " << span(st.send) << " <-> " << st.send_peer << " (reduce)\n";
        continue;
      }
      if (st.send_peer >= 0) os << " send " << span(st.send) << " -> " << st.send_peer << ";";
      if (st.recv_peer >= 0)
        os << " recv " << span(st.recv) << " <- " << st.recv_peer << " ("
           << (st.act == action::reduce ? "reduce" : "copy") << ")";
      os << "\n";
    }
    return os;
  }
  std::string str() const {
    std::ostringstream o;
    o << *this;
    return o.str();
  }
};

// Ring building block shared by the topologies: a ring of `n` members where member `pos` talks to
// member_rank(pos +- 1), over `n` parts, part p being chunks [base + p*width, base + (p+1)*width).
// Reduce-scatter leaves member pos owning part pos; all-gather starts from that.
template <class MemberRank>
void ring_reduce_scatter(schedule& s, int n, int pos, MemberRank member_rank, std::uint32_t base,
                         std::uint32_t width) {
  auto part = [&](int p) { return chunk_span{base + static_cast<std::uint32_t>(((p % n) + n) % n) * width, width}; };
  for (int k = 0; k + 1 < n; ++k)
    s.steps.push_back({member_rank((pos + 1) % n), part(pos - k - 1), member_rank((pos + n - 1) % n),
                       part(pos - k - 2), action::reduce, phase::reduce_scatter});
}
template <class MemberRank>
void ring_all_gather(schedule& s, int n, int pos, MemberRank member_rank, std::uint32_t base,
                     std::uint32_t width) {
  auto part = [&](int p) { return chunk_span{base + static_cast<std::uint32_t>(((p % n) + n) % n) * width, width}; };
  for (int k = 0; k + 1 < n; ++k)
    s.steps.push_back({member_rank((pos + 1) % n), part(pos - k), member_rank((pos + n - 1) % n),
                       part(pos - k - 1), action::copy, phase::all_gather});
}

// Broadcast's first half, common to every topology: the root sends chunk c to rank c. The second
// half is the topology's all-gather, which then starts from "rank c owns chunk c".
inline schedule scatter_from(int root, int rank, int size) {
  schedule s{rank, size, static_cast<std::uint32_t>(size), {}, {static_cast<std::uint32_t>(rank), 1}};
  if (rank == root) {
    for (int k = 1; k < size; ++k) {
      const int to = (root + k) % size;
      s.steps.push_back({to, {static_cast<std::uint32_t>(to), 1}, -1, {}, action::copy, phase::scatter});
    }
  } else if (size > 1) {
    s.steps.push_back({-1, {}, root, {static_cast<std::uint32_t>(rank), 1}, action::copy, phase::scatter});
  }
  return s;
}

}  // namespace lockstep::topology
