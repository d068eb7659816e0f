// The main of the MPI test programs under mpirun: MPI_Init_thread, the Catch2 session, then one
// verdict for the whole job: failed where any rank failed, else skipped (77) where any rank
// skipped a check (mpi_main.hpp), else passed. Every rank returns it, after MPI_Finalize, so that
// mpirun reports the job's verdict rather than the first rank's to exit.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <lockstep/transport/mpi.hpp>

#include <cstdio>
#include <mutex>
#include <set>

#include "mpi_main.hpp"

namespace {

std::mutex skip_m;
std::set<std::string> skipped;  // reasons, printed once each

}  // namespace

void lockstep::test::skip(const std::string& why) {
  std::lock_guard lk(skip_m);
  skipped.insert(why);
}

int main(int argc, char** argv) {
  int verdict = 0;
  {
    lockstep::transport::mpi_session session(&argc, &argv);
    const int failed = Catch::Session().run(argc, argv) != 0 ? 1 : 0;
    int rank = 0, any_failed = 0, any_skipped = 0, mine_skipped = skipped.empty() ? 0 : 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&mine_skipped, &any_skipped, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    for (const auto& why : skipped) std::printf("rank %d skipped: %s\n", rank, why.c_str());
    verdict = any_failed ? 1 : any_skipped ? 77 : 0;
  }  // MPI_Finalize
  return verdict;
}
