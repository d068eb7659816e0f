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
#include <mutex>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <lockstep/codec.hpp>
#include <lockstep/collective.hpp>
#include <lockstep/topology.hpp>

#include "c10d_transport.hpp"

namespace py = pybind11;

namespace lockstep_torch {

namespace ls = lockstep;
using group_t = ls::group<c10d_transport>;

// ---- names -> policies ---------------------------------------------------------------------------

enum class codec_kind { fp32, bf16, int8, dyntree8 };

inline codec_kind parse_codec(const std::string& name, int rank) {
  if (name == "fp32") return codec_kind::fp32;
  if (name == "bf16") return codec_kind::bf16;
  if (name == "int8") return codec_kind::int8;
  if (name == "dyntree8") return codec_kind::dyntree8;
  throw ls::error(ls::errc::invalid_argument, "lockstep_torch", rank, -1,
                  "unknown codec '" + name + "' (fp32, bf16, int8, dyntree8)");
}

// "ring", "torus2d" (the most square shape) or "torus2d:RxC".
struct topology_spec {
  bool torus = false;
  int rows = 0, cols = 0;
};

inline topology_spec parse_topology(const std::string& name, int rank, int size) {
  if (name == "ring") return {};
  if (name == "torus2d") return {true, 0, 0};
  int r = 0, c = 0;
  char x = 0, end = 0;
  if (name.rfind("torus2d:", 0) == 0 && std::sscanf(name.c_str() + 8, "%d%c%d%c", &r, &x, &c, &end) == 3 && x == 'x') {
    ls::topology::torus2d{r, c}.validate(size, rank);  // a shape that does not fit the group throws here
    return {true, r, c};
  }
  throw ls::error(ls::errc::invalid_argument, "lockstep_torch", rank, -1,
                  "unknown topology '" + name + "' (ring, torus2d, torus2d:RxC)");
}

template <class F>
void with_topology(const topology_spec& t, F&& f) {
  if (t.torus) f(ls::topology::torus2d{t.rows, t.cols});
  else f(ls::topology::ring{});
}

template <class F>
void with_codec(codec_kind k, F&& f) {
  switch (k) {
    case codec_kind::fp32: f(ls::codec::fp32{}); return;
    case codec_kind::bf16: f(ls::codec::bf16{}); return;
    case codec_kind::int8: f(ls::codec::int8{}); return;
    case codec_kind::dyntree8: f(ls::codec::dyntree8{}); return;
  }
}

// The error-feedback state of one DDP bucket: the codec object that holds its residuals.
using feedback = std::variant<std::monostate, ls::codec::error_feedback<ls::codec::bf16>,
                              ls::codec::error_feedback<ls::codec::int8>, ls::codec::error_feedback<ls::codec::dyntree8>>;

inline feedback make_feedback(codec_kind k) {
  switch (k) {
    case codec_kind::fp32: return std::monostate{};  // lossless: nothing to feed back
    case codec_kind::bf16: return ls::codec::error_feedback<ls::codec::bf16>{};
    case codec_kind::int8: return ls::codec::error_feedback<ls::codec::int8>{};
    case codec_kind::dyntree8: return ls::codec::error_feedback<ls::codec::dyntree8>{};
  }
  return std::monostate{};
}

struct bucket_state {
  std::size_t count = 0;
  const float* address = nullptr;  // where its residuals are keyed
  codec_kind codec = codec_kind::fp32;
  feedback ef;
};

// A Python callable held by C++ threads: its reference is dropped with the GIL held.
struct py_callback {
  py::object fn;
  explicit py_callback(py::object f) : fn(std::move(f)) {}
  ~py_callback() {
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
};

// ---- the engine ----------------------------------------------------------------------------------

class engine {
 public:
  engine(c10::intrusive_ptr<c10d::ProcessGroup> pg, int channel, double timeout_s, std::size_t segment_bytes)
      : g_(std::make_unique<group_t>(c10d_transport(std::move(pg), channel), options(timeout_s, segment_bytes))) {}

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
    const ls::reduce_op rop = parse_op(op);
    std::span<float> buf = checked_span(t, "all_reduce");
    py::gil_scoped_release nogil;
    with_topology(ts, [&](const auto& topo) {
      with_codec(ck, [&](auto c) { ls::all_reduce(*g_, buf, topo, c, rop); });
    });
  }

  // Averages DDP bucket `t` on the group's worker thread and calls done(None) or done(message).
  // bucket_index < 0: no error feedback (DDP's first iteration, whose buckets it rebuilds after).
  void reduce_bucket_async(at::Tensor t, const std::string& codec, const std::string& topology, int bucket_index,
                           py::object done) {
    const codec_kind ck = parse_codec(codec, rank());
    const topology_spec ts = parse_topology(topology, rank(), size());
    std::span<float> buf = checked_span(t, "allreduce_hook");
    bucket_state* bs = bucket_index >= 0 && ck != codec_kind::fp32 ? bucket(bucket_index, ck, buf.size()) : nullptr;
    auto cb = std::make_shared<py_callback>(std::move(done));
    group_t* g = g_.get();
    auto task = [g, t, buf, ck, ts, bs, cb]() {
      std::string failure;
      try {
        with_topology(ts, [&](const auto& topo) {
          if (bs) run_with_feedback(*g, *bs, buf, topo);
          else with_codec(ck, [&](auto c) { ls::all_reduce(*g, buf, topo, c, ls::reduce_op::average); });
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
      }
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
  std::map<int, std::size_t> buckets() {
    std::lock_guard lk(m_);
    std::map<int, std::size_t> out;
    for (const auto& [k, b] : buckets_) out[k] = b.count;
    return out;
  }
  void reset_buckets() {
    synchronize();
    std::lock_guard lk(m_);
    buckets_.clear();
  }

 private:
  static ls::group_options options(double timeout_s, std::size_t segment_bytes) {
    if (!(timeout_s > 0))
      throw ls::error(ls::errc::invalid_argument, "lockstep_torch", -1, -1,
                      "timeout must be a positive number of seconds, not " + std::to_string(timeout_s));
    ls::group_options o;
    o.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000.0 + 0.5));
    o.segment_bytes = segment_bytes;  // 0: the transport's 1 MiB
    return o;
  }

  ls::reduce_op parse_op(const std::string& op) const {
    if (op == "sum") return ls::reduce_op::sum;
    if (op == "average" || op == "avg" || op == "mean") return ls::reduce_op::average;
    throw ls::error(ls::errc::invalid_argument, "lockstep_torch", rank(), -1, "unknown op '" + op + "' (sum, average)");
  }

  std::span<float> checked_span(const at::Tensor& t, const char* what) const {
    auto bad = [&](const std::string& why) {
      return ls::error(ls::errc::invalid_argument, what, rank(), -1, why);
    };
    if (!t.defined()) throw bad("undefined tensor");
    if (t.scalar_type() != at::kFloat)
      throw bad(std::string("lockstep reduces float32 tensors; this one is ") + std::string(c10::toString(t.scalar_type())));
    if (!t.device().is_cpu())
      throw bad("tensor on " + t.device().str() + ": this build reduces CPU tensors over Gloo (CUDA buckets are not supported yet)");
    if (!t.is_contiguous()) throw bad("tensor is not contiguous");
    if (t.is_sparse()) throw bad("sparse tensor");
    return {t.data_ptr<float>(), static_cast<std::size_t>(t.numel())};
  }

  // The state of bucket `index`, made on first use; its size may not change afterwards.
  bucket_state* bucket(int index, codec_kind ck, std::size_t count) {
    std::lock_guard lk(m_);
    auto [it, fresh] = buckets_.try_emplace(index);
    bucket_state& b = it->second;
    if (fresh) {
      b.count = count;
      b.codec = ck;
      b.ef = make_feedback(ck);
    } else if (b.count != count) {
      throw ls::error(ls::errc::invalid_argument, "allreduce_hook", rank(), -1,
                      "bucket " + std::to_string(index) + " held " + std::to_string(b.count) + " elements and now holds " +
                          std::to_string(count) +
                          ": its error-feedback residuals no longer line up (buckets may only be rebuilt before "
                          "error feedback starts, i.e. in DDP's first iteration; call state.reset() after changing them)");
    } else if (b.codec != ck) {
      b.codec = ck;
      b.ef = make_feedback(ck);
      b.address = nullptr;
    }
    return &b;
  }

  // Runs the all-reduce with bucket `b`'s error-feedback codec. A bucket that moved in memory
  // carries its residuals to its new address first (they are keyed by address).
  template <class Topo>
  static void run_with_feedback(group_t& g, bucket_state& b, std::span<float> buf, const Topo& topo) {
    std::visit(
        [&](auto& ef) {
          if constexpr (!std::is_same_v<std::decay_t<decltype(ef)>, std::monostate>) {
            if (b.address && b.address != buf.data()) {
              ls::space::host h;
              std::vector<float> saved(ef.state_floats(buf.size()));
              ef.save(std::span<const float>(b.address, buf.size()), saved.data(), h);
              ef.forget(b.address);
              ef.load(std::span<const float>(buf.data(), buf.size()), saved.data(), h);
            }
            b.address = buf.data();
            ls::all_reduce(g, buf, topo, ef, ls::reduce_op::average);
          }
        },
        b.ef);
  }

  std::unique_ptr<group_t> g_;
  std::mutex m_;
  std::map<int, bucket_state> buckets_;  // (DDP bucket index)
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
  const auto deadline = lt::clock::now() + std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
  if (!t.wait(s, deadline) || !t.wait(r, deadline))
    throw ls::error(ls::errc::timeout, "exchange", t.rank(), peer, "no message within the timeout");
  for (std::size_t i = 0; i < recv_bytes; ++i)
    if (in[i] != static_cast<std::byte>(i % 251))
      throw ls::error(ls::errc::transport, "exchange", t.rank(), peer, "byte " + std::to_string(i) + " differs");
}

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
}
