// python/lockstep_torch/csrc/module.cpp: lockstep_torch._C, the C++ half of lockstep_torch.
//
// One `engine` per lockstep group over a c10d process group (c10d_transport.hpp). It runs
// lockstep's all_reduce with a codec and a topology chosen by name, either now (all_reduce, the GIL
// released) or on the group's worker thread (reduce_bucket_async, what the DDP hook calls): the
// call returns at once and a Python callable is called from the worker, with the GIL taken, when
// the bucket is reduced (None) or failed (lockstep's message). Error-feedback residuals are kept
// per DDP bucket index; a bucket that moved in memory keeps them (they are carried to the new
// address), a bucket whose size changed is an error, since its residuals no longer line up.
//
// Everything that may wait releases the GIL first: the worker needs it to complete a future, and
// a thread that held it while waiting for the worker would deadlock.
#include <torch/extension.h>

#include <chrono>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "c10d_transport.hpp"
#include "policies.hpp"
#if LOCKSTEP_TORCH_CUDA
#include "cuda_engine.hpp"
#endif

namespace py = pybind11;

namespace lockstep_torch {

using group_t = ls::group<c10d_transport>;

// The data of a tensor an engine may reduce: defined, float32, contiguous, dense, on `on` (the
// engine's device); otherwise errc::invalid_argument naming what is wrong.
inline void* float32_data(const at::Tensor& t, const char* what, int rank, const at::Device& on) {
  auto bad = [&](const std::string& why) { return ls::error(ls::errc::invalid_argument, what, rank, -1, why); };
  if (!t.defined()) throw bad("undefined tensor");
  if (t.scalar_type() != at::kFloat)
    throw bad(std::string("lockstep reduces float32 tensors; this one is ") + std::string(c10::toString(t.scalar_type())));
  if (t.device() != on)
    throw bad("tensor on " + t.device().str() + ": this engine reduces tensors on " + on.str() +
              (on.is_cpu() ? " (for CUDA tensors make the State with device='cuda')" : ""));
  if (!t.is_contiguous()) throw bad("tensor is not contiguous");
  if (t.is_sparse()) throw bad("sparse tensor");
  return t.data_ptr();
}

// A Python callable held by C++ threads: its reference is dropped with the GIL held.
struct py_callback {
  py::object fn;
  explicit py_callback(py::object f) : fn(std::move(f)) {}
  ~py_callback() {
    // Dropped already (by the task that called it, with the GIL held): nothing to take the GIL for.
    if (!fn) return;
    // While the interpreter finalises, taking the GIL ends this thread (pthread_exit), here in a
    // destructor: std::terminate. The reference is leaked instead; the process is ending.
    if (interpreter_finalizing()) {
      (void)fn.release();
      return;
    }
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
  static bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
  }
};

// ---- the engine ----------------------------------------------------------------------------------

class engine {
 public:
  engine(c10::intrusive_ptr<c10d::ProcessGroup> pg, int channel, double timeout_s, std::size_t segment_bytes)
      : g_(std::make_unique<group_t>(c10d_transport(std::move(pg), channel), group_options_for(timeout_s, segment_bytes))) {}

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  ~engine() {
    // The worker may be waiting for the GIL to complete a future: let it, then join it.
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      g_.reset();
    } else {
      g_.reset();
    }
  }

  int rank() const { return g_->rank(); }
  int size() const { return g_->size(); }
  std::string name() const { return g_->name(); }
  double timeout() const { return std::chrono::duration<double>(g_->options().timeout).count(); }
  std::size_t segment_bytes() const { return g_->segment_bytes(); }

  // Reduces `t` in place, now; sum or average over the group.
  void all_reduce(at::Tensor t, const std::string& codec, const std::string& topology, const std::string& op) {
    const codec_kind ck = parse_codec(codec, rank());
    const topology_spec ts = parse_topology(topology, rank(), size());
    const ls::reduce_op rop = parse_op(op, rank());
    std::span<float> buf = checked_span(t, "all_reduce");
    py::gil_scoped_release nogil;
    with_topology(ts, [&](const auto& topo) {
      codecs_.with(ck, [&](auto& c) { ls::all_reduce(*g_, buf, topo, c, rop); });
    });
  }

  // Averages DDP bucket `t` on the group's worker thread and calls done(None) or done(message).
  // bucket_index < 0: no error feedback (DDP's first iteration, whose buckets it rebuilds after).
  void reduce_bucket_async(at::Tensor t, const std::string& codec, const std::string& topology, int bucket_index,
                           py::object done) {
    const codec_kind ck = parse_codec(codec, rank());
    const topology_spec ts = parse_topology(topology, rank(), size());
    std::span<float> buf = checked_span(t, "allreduce_hook");
    bucket_state* bs =
        bucket_index >= 0 && ck != codec_kind::fp32 ? buckets_.bucket(bucket_index, ck, buf.size(), rank()) : nullptr;
    auto cb = std::make_shared<py_callback>(std::move(done));
    group_t* g = g_.get();
    codecs* cs = &codecs_;
    auto task = [g, t, buf, ck, ts, bs, cb, cs]() mutable {
      std::string failure;
      try {
        with_topology(ts, [&](const auto& topo) {
          auto run = [&](auto& c) { ls::all_reduce(*g, buf, topo, c, ls::reduce_op::average); };
          if (bs) bucket_table::with_feedback(*g, *bs, buf, run);
          else cs->with(ck, run);
        });
      } catch (const std::exception& e) {
        failure = e.what();
        if (failure.empty()) failure = "lockstep_torch: unknown failure";
      }
      py::gil_scoped_acquire gil;
      try {
        if (failure.empty()) cb->fn(py::none());
        else cb->fn(py::str(failure));
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("lockstep_torch allreduce_hook completion");
      } catch (const std::exception&) {
        // (a C++ error from the call itself, e.g. a bad_alloc converting its argument: the hook's
        // future then never completes, as with any callback that fails; the reset below must run.
        // Not catch (...): a thread ended by pthread_exit must go on unwinding.)
      }
      // The callable and the tensor go here, with the GIL held, not when the worker drops this
      // task: the tensor's last reference may be its Python object's, and a thread that takes
      // the GIL while the interpreter finalises is ended by pthread_exit, which in a destructor
      // (where the task's captures would go) is std::terminate. Here it unwinds through the
      // worker's loop, which lets it.
      cb->fn = py::object();
      t = at::Tensor();
    };
    py::gil_scoped_release nogil;
    g->submit(std::move(task), "allreduce_hook");
  }

  // Waits until every bucket submitted so far has finished (the group's order is call order).
  void synchronize() {
    py::gil_scoped_release nogil;
    g_->run([] {});
  }

  // How many buckets keep residuals, and their element counts (for tests and logs).
  std::map<int, std::size_t> buckets() { return buckets_.counts(); }
  void reset_buckets() {
    synchronize();
    buckets_.clear();
  }

 private:
  std::span<float> checked_span(const at::Tensor& t, const char* what) const {
    return {static_cast<float*>(float32_data(t, what, rank(), at::Device(at::kCPU))), static_cast<std::size_t>(t.numel())};
  }

  std::unique_ptr<group_t> g_;
  codecs codecs_;
  bucket_table buckets_;
};

// The transport alone, for its tests: sends `send_bytes` (byte i = i mod 251) to `peer` and
// receives `recv_bytes` from it on tag `tag` of channel `channel`; throws what the transport throws
// (a shorter message than posted is errc::mismatch), or when the bytes are not the pattern.
inline void exchange(c10::intrusive_ptr<c10d::ProcessGroup> pg, int channel, int peer, std::uint32_t tag,
                     std::size_t send_bytes, std::size_t recv_bytes, double timeout_s) {
  py::gil_scoped_release nogil;
  c10d_transport t(std::move(pg), channel);
  std::vector<std::byte> out(send_bytes), in(recv_bytes);
  for (std::size_t i = 0; i < send_bytes; ++i) out[i] = static_cast<std::byte>(i % 251);
  auto r = t.irecv(peer, tag, in.data(), in.size());
  auto s = t.isend(peer, tag, out.data(), out.size());
  const auto deadline = ls::deadline_after(timeout_ms(timeout_s));
  if (!t.wait(s, deadline) || !t.wait(r, deadline))
    throw ls::error(ls::errc::timeout, "exchange", t.rank(), peer, "no message within the timeout");
  for (std::size_t i = 0; i < recv_bytes; ++i)
    if (in[i] != static_cast<std::byte>(i % 251))
      throw ls::error(ls::errc::transport, "exchange", t.rank(), peer, "byte " + std::to_string(i) + " differs");
}

#if LOCKSTEP_TORCH_CUDA
// A CUDA bucket for cuda::engine: a contiguous float32 tensor on the engine's GPU, as its address.
inline std::uintptr_t cuda_address(const cuda::engine& e, const at::Tensor& t, const char* what) {
  return reinterpret_cast<std::uintptr_t>(
      float32_data(t, what, e.rank(), at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(e.device()))));
}
#endif

}  // namespace lockstep_torch

PYBIND11_MODULE(_C, m) {
  using lockstep_torch::engine;
  m.doc() = "lockstep_torch._C: lockstep collectives over a torch.distributed process group";
  static py::exception<lockstep::error> error_type(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const lockstep::error& e) {
      error_type(e.what());
    }
  });
  py::class_<engine>(m, "Engine")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, int, double, std::size_t>(), py::arg("process_group"),
           py::arg("channel"), py::arg("timeout"), py::arg("segment_bytes") = 0)
      .def_property_readonly("rank", &engine::rank)
      .def_property_readonly("size", &engine::size)
      .def_property_readonly("name", &engine::name)
      .def_property_readonly("timeout", &engine::timeout)
      .def_property_readonly("segment_bytes", &engine::segment_bytes)
      .def("all_reduce", &engine::all_reduce, py::arg("tensor"), py::arg("codec"), py::arg("topology"), py::arg("op"))
      .def("reduce_bucket_async", &engine::reduce_bucket_async, py::arg("tensor"), py::arg("codec"), py::arg("topology"),
           py::arg("bucket_index"), py::arg("done"))
      .def("synchronize", &engine::synchronize)
      .def("buckets", &engine::buckets)
      .def("reset_buckets", &engine::reset_buckets);
  m.def(
      "check_settings",
      [](const std::string& codec, const std::string& topology, int rank, int size) {
        lockstep_torch::parse_codec(codec, rank);
        lockstep_torch::parse_topology(topology, rank, size);
      },
      py::arg("codec"), py::arg("topology"), py::arg("rank"), py::arg("size"));
  m.def("_exchange", &lockstep_torch::exchange, py::arg("process_group"), py::arg("channel"), py::arg("peer"),
        py::arg("tag"), py::arg("send_bytes"), py::arg("recv_bytes"), py::arg("timeout"));
  m.attr("max_channels") = lockstep_torch::c10d_transport::max_channels;
#if LOCKSTEP_TORCH_CUDA
  // CUDA buckets: lockstep's device executor over an NCCL communicator of its own (cuda_engine.hpp).
  using engine_handle = lockstep_torch::cuda::engine;
  // Destroying an engine waits for its pending calls (each within the timeout) and tears the
  // communicator down: never with the GIL held, whoever drops the last reference.
  struct release_gil_delete {
    void operator()(engine_handle* p) const {
      if (PyGILState_Check()) {
        py::gil_scoped_release nogil;
        delete p;
      } else {
        delete p;
      }
    }
  };
  m.attr("has_cuda") = true;
  m.def("cuda_available", [] {
    std::string why;
    const bool ok = lockstep_torch::cuda::available(why);
    return py::make_tuple(ok, why);
  });
  m.def("cuda_unique_id", [] { return py::bytes(lockstep_torch::cuda::unique_id()); });
  py::class_<engine_handle, std::unique_ptr<engine_handle, release_gil_delete>>(m, "CudaEngine")
      .def(py::init([](py::bytes id, int rank, int size, int device, double timeout) {
             std::string raw = id;
             py::gil_scoped_release nogil;  // joining the communicator waits for every rank
             return new engine_handle(raw, rank, size, device, timeout);
           }),
           py::arg("nccl_id"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("timeout"))
      .def_property_readonly("rank", &engine_handle::rank)
      .def_property_readonly("size", &engine_handle::size)
      .def_property_readonly("device", &engine_handle::device)
      .def_property_readonly("name", &engine_handle::name)
      .def_property_readonly("timeout", &engine_handle::timeout)
      .def("all_reduce",
           [](engine_handle& e, at::Tensor t, std::uintptr_t stream, const std::string& codec, const std::string& topology,
              const std::string& op) {
             const std::uintptr_t p = lockstep_torch::cuda_address(e, t, "all_reduce");
             py::gil_scoped_release nogil;
             e.all_reduce(p, static_cast<std::size_t>(t.numel()), stream, codec, topology, op);
           },
           py::arg("tensor"), py::arg("stream"), py::arg("codec"), py::arg("topology"), py::arg("op"))
      .def("reduce_bucket",
           [](engine_handle& e, at::Tensor t, std::uintptr_t stream, const std::string& codec, const std::string& topology,
              int bucket_index) {
             const std::uintptr_t p = lockstep_torch::cuda_address(e, t, "allreduce_hook");
             py::gil_scoped_release nogil;
             e.reduce_bucket(p, static_cast<std::size_t>(t.numel()), stream, codec, topology, bucket_index);
           },
           py::arg("tensor"), py::arg("stream"), py::arg("codec"), py::arg("topology"), py::arg("bucket_index"))
      .def("synchronize", [](engine_handle& e) {
        py::gil_scoped_release nogil;
        e.synchronize();
      })
      .def("buckets", &engine_handle::buckets)
      .def("reset_buckets", [](engine_handle& e) {
        py::gil_scoped_release nogil;
        e.reset_buckets();
      });
#else
  m.attr("has_cuda") = false;
#endif
}
