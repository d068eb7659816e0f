// What the MPI test programs share beside Catch2 (mpi_main.cpp is their main).
#pragma once

#include <string>

namespace lockstep::test {

// Marks this run skipped: a check it was meant to make cannot be made here (one rank, Linux
// forbidding cross-process reads, ...). Catch2 v2 has no skip; the program then exits 77, which
// meson counts as skipped, unless some check failed. The caller returns from its test case.
void skip(const std::string& why);

}  // namespace lockstep::test
