// The one Catch2 main of the test suite: compiled once, linked into every test program.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
