// A stream-ordered transport that learns of a failure outside any call, as NCCL's proxy thread
// does (ncclCommGetAsyncError): inproc_deferred, whose async_error() (transport/concept.hpp)
// reports once `failed` is set. Used by test_abort and test_stream_engine.
#pragma once

#include <atomic>
#include <string>
#include <utility>

#include <lockstep/transport/inproc_stream.hpp>

namespace lockstep::testing {

class failing_async : public transport::inproc_deferred {
 public:
  failing_async(transport::inproc_deferred t, const std::atomic<bool>* failed)
      : transport::inproc_deferred(std::move(t)), failed_(failed) {}
  std::string async_error() const { return failed_->load() ? "the connection to rank 1 was closed" : std::string(); }

 private:
  const std::atomic<bool>* failed_;
};

}  // namespace lockstep::testing
