// Catch2 v2 assertions are not thread-safe, and some tests assert on rank threads (run_inproc):
// INFO from four rank threads once corrupted Catch's heap in CI. Include this header instead of
// <catch2/catch.hpp> in such a test. It redefines the assertion macros so that each one takes one
// process-wide lock, and makes INFO, UNSCOPED_INFO and CAPTURE throw std::logic_error off the main
// thread: they push onto the test's one message stack, which a lock cannot make right (another
// thread's assertion would report the message). On a rank thread put the context into the
// assertion itself (FAIL("rank " << r << ...)), or record on the rank and assert on the main thread.
//
// The lock is held while the asserted expression is evaluated, so:
//   - an expression asserted on a rank thread must be local: no collective, no wait on a peer
//     (otherwise a rank blocks holding the lock and a peer that asserts cannot reach the call);
//   - never wrap run_inproc(...) in an assertion (CHECK_THROWS_WITH(run_inproc(...), ...)) when
//     its ranks assert: they would wait for the lock the main thread holds.
// CHECKED_IF / CHECKED_ELSE are not covered; do not use them on rank threads.
#pragma once

#include <catch2/catch.hpp>

#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace lockstep_test {

inline std::recursive_mutex& catch_lock() {
  static std::recursive_mutex m;
  return m;
}

// Initialised during static initialisation, before main, hence on the main thread.
inline const std::thread::id catch_main_thread = std::this_thread::get_id();

inline void require_main_thread(const char* macro) {
  if (std::this_thread::get_id() != catch_main_thread)
    throw std::logic_error(std::string(macro) +
                           " on a thread other than the main thread: Catch2's message stack is not thread-safe; "
                           "put the context into the assertion's message (tests/thread_safe_catch.hpp)");
}

}  // namespace lockstep_test

#define LOCKSTEP_TEST_LOCKED(...)                                                                  \
  do {                                                                                             \
    std::lock_guard<std::recursive_mutex> lockstep_catch_guard_(::lockstep_test::catch_lock());   \
    __VA_ARGS__;                                                                                   \
  } while (0)

#undef REQUIRE
#undef REQUIRE_FALSE
#undef REQUIRE_THROWS
#undef REQUIRE_THROWS_AS
#undef REQUIRE_THROWS_WITH
#undef REQUIRE_THROWS_MATCHES
#undef REQUIRE_NOTHROW
#undef REQUIRE_THAT
#undef CHECK
#undef CHECK_FALSE
#undef CHECK_NOFAIL
#undef CHECK_THROWS
#undef CHECK_THROWS_AS
#undef CHECK_THROWS_WITH
#undef CHECK_THROWS_MATCHES
#undef CHECK_NOTHROW
#undef CHECK_THAT
#undef WARN
#undef FAIL
#undef FAIL_CHECK
#undef SUCCEED
#undef INFO
#undef UNSCOPED_INFO
#undef CAPTURE

#define REQUIRE(...) LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_TEST("REQUIRE", Catch::ResultDisposition::Normal, __VA_ARGS__))
#define REQUIRE_FALSE(...)                                                                                       \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_TEST("REQUIRE_FALSE",                                                      \
                                           Catch::ResultDisposition::Normal | Catch::ResultDisposition::FalseTest, \
                                           __VA_ARGS__))
#define REQUIRE_THROWS(...) \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_THROWS("REQUIRE_THROWS", Catch::ResultDisposition::Normal, __VA_ARGS__))
#define REQUIRE_THROWS_AS(expr, exceptionType) \
  LOCKSTEP_TEST_LOCKED(                        \
      INTERNAL_CATCH_THROWS_AS("REQUIRE_THROWS_AS", exceptionType, Catch::ResultDisposition::Normal, expr))
#define REQUIRE_THROWS_WITH(expr, matcher) \
  LOCKSTEP_TEST_LOCKED(                    \
      INTERNAL_CATCH_THROWS_STR_MATCHES("REQUIRE_THROWS_WITH", Catch::ResultDisposition::Normal, matcher, expr))
#define REQUIRE_THROWS_MATCHES(expr, exceptionType, matcher)                                                    \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_THROWS_MATCHES("REQUIRE_THROWS_MATCHES", exceptionType,                   \
                                                     Catch::ResultDisposition::Normal, matcher, expr))
#define REQUIRE_NOTHROW(...) \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_NO_THROW("REQUIRE_NOTHROW", Catch::ResultDisposition::Normal, __VA_ARGS__))
#define REQUIRE_THAT(arg, matcher) \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CHECK_THAT("REQUIRE_THAT", matcher, Catch::ResultDisposition::Normal, arg))

#define CHECK(...) \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_TEST("CHECK", Catch::ResultDisposition::ContinueOnFailure, __VA_ARGS__))
#define CHECK_FALSE(...)                                                                                     \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_TEST(                                                                  \
      "CHECK_FALSE", Catch::ResultDisposition::ContinueOnFailure | Catch::ResultDisposition::FalseTest,      \
      __VA_ARGS__))
#define CHECK_NOFAIL(...)                                                                                    \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_TEST(                                                                  \
      "CHECK_NOFAIL", Catch::ResultDisposition::ContinueOnFailure | Catch::ResultDisposition::SuppressFail, \
      __VA_ARGS__))
#define CHECK_THROWS(...) \
  LOCKSTEP_TEST_LOCKED(   \
      INTERNAL_CATCH_THROWS("CHECK_THROWS", Catch::ResultDisposition::ContinueOnFailure, __VA_ARGS__))
#define CHECK_THROWS_AS(expr, exceptionType) \
  LOCKSTEP_TEST_LOCKED(                      \
      INTERNAL_CATCH_THROWS_AS("CHECK_THROWS_AS", exceptionType, Catch::ResultDisposition::ContinueOnFailure, expr))
#define CHECK_THROWS_WITH(expr, matcher)                                                                        \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_THROWS_STR_MATCHES("CHECK_THROWS_WITH",                                   \
                                                         Catch::ResultDisposition::ContinueOnFailure, matcher, expr))
#define CHECK_THROWS_MATCHES(expr, exceptionType, matcher)                                                      \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_THROWS_MATCHES("CHECK_THROWS_MATCHES", exceptionType,                     \
                                                     Catch::ResultDisposition::ContinueOnFailure, matcher, expr))
#define CHECK_NOTHROW(...) \
  LOCKSTEP_TEST_LOCKED(    \
      INTERNAL_CATCH_NO_THROW("CHECK_NOTHROW", Catch::ResultDisposition::ContinueOnFailure, __VA_ARGS__))
#define CHECK_THAT(arg, matcher) \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CHECK_THAT("CHECK_THAT", matcher, Catch::ResultDisposition::ContinueOnFailure, arg))

#define WARN(msg)                                                                                       \
  LOCKSTEP_TEST_LOCKED(                                                                                 \
      INTERNAL_CATCH_MSG("WARN", Catch::ResultWas::Warning, Catch::ResultDisposition::ContinueOnFailure, msg))
#define FAIL(...)                                                                                           \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_MSG("FAIL", Catch::ResultWas::ExplicitFailure,                        \
                                          Catch::ResultDisposition::Normal, __VA_ARGS__))
#define FAIL_CHECK(...)                                                                                     \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_MSG("FAIL_CHECK", Catch::ResultWas::ExplicitFailure,                  \
                                          Catch::ResultDisposition::ContinueOnFailure, __VA_ARGS__))
#define SUCCEED(...)                                                                                        \
  LOCKSTEP_TEST_LOCKED(INTERNAL_CATCH_MSG("SUCCEED", Catch::ResultWas::Ok,                                  \
                                          Catch::ResultDisposition::ContinueOnFailure, __VA_ARGS__))

// Scoped: these declare a variable in the caller's scope, so they cannot be wrapped in a block.
#define INFO(msg)                                      \
  ::lockstep_test::require_main_thread("INFO");       \
  INTERNAL_CATCH_INFO("INFO", msg)
#define UNSCOPED_INFO(msg)                                    \
  ::lockstep_test::require_main_thread("UNSCOPED_INFO");     \
  INTERNAL_CATCH_UNSCOPED_INFO("UNSCOPED_INFO", msg)
#define CAPTURE(...)                                  \
  ::lockstep_test::require_main_thread("CAPTURE");   \
  INTERNAL_CATCH_CAPTURE(INTERNAL_CATCH_UNIQUE_NAME(capturer), "CAPTURE", __VA_ARGS__)
