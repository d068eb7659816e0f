// MPI for the Catch2 programs under mpirun: MPI_Init_thread before the first test case,
// MPI_Finalize after the last, through lockstep's own mpi_session. Linked into every MPI test
// program beside the shared Catch2 main.
#define CATCH_CONFIG_EXTERNAL_INTERFACES
#include <catch2/catch.hpp>
#include <lockstep/transport/mpi.hpp>

#include <optional>

namespace {

struct mpi_listener : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  void testRunStarting(Catch::TestRunInfo const&) override { session.emplace(); }
  void testRunEnded(Catch::TestRunStats const&) override { session.reset(); }
  std::optional<lockstep::transport::mpi_session> session;
};

}  // namespace

CATCH_REGISTER_LISTENER(mpi_listener)
