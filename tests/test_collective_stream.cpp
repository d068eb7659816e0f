// The collective matrix of tests/test_collective.cpp over inproc_deferred: every rank's work
// queued on a host_stream and completed by events, the path a GPU takes, run by the CPU. Every op x
// topology x codec for 1..9 ranks (1..5 under LOCKSTEP_SMALL_MATRIX=1), broadcast from every root,
// with the same inputs and bounds (tests/collective_matrix.hpp).
#include "collective_matrix.hpp"

TEMPLATE_TEST_CASE("every op x topology for 1..9 ranks, stream-ordered", "[collective][stream]", codec::fp32,
                   codec::bf16, codec::int8, codec::dyntree8, codec::error_feedback<codec::int8>) {
  for (int n = 1; n <= max_ranks(); ++n) every_op<on_stream, TestType>(n);
}
