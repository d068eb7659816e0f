"""lockstep_torch: lockstep's compressed all-reduce inside PyTorch.

A DDP communication hook and a plain all_reduce over any torch.distributed process group, running
lockstep's topologies (ring, torus2d) and codecs (fp32, bf16, int8, dyntree8): CPU tensors over the
group's own point-to-point send/recv (Gloo), CUDA tensors with lockstep's device executor over an
NCCL communicator whose id travels over the group (NCCL's own all-reduce cannot compress). No MPI:
the ranks and the rendezvous are torch's.

    import lockstep_torch
    state = lockstep_torch.State(process_group=None, codec="dyntree8", error_feedback=True, topology="torus2d")
    ddp_model.register_comm_hook(state, lockstep_torch.allreduce_hook)

    lockstep_torch.all_reduce(tensor, codec="int8", topology="ring", group=None, op="sum")

Every rank must create its States (and make its first all_reduce call on a group) in the same
order: each gets a tag channel of the process group in creation order, as new_group numbers its
groups (a CUDA State joins a communicator of its own, also a collective call). Bad use raises lockstep_torch.Error (a RuntimeError) with lockstep's message, naming the
rank (and the peer, where one is involved); a peer that never answers is a timeout after
`timeout` seconds (default 300), never a hang. docs/torch.md has the details.
"""
import atexit as _atexit
import datetime as _datetime
import threading as _threading

import torch
import torch.distributed as dist

from . import _C

Error = _C.Error
__all__ = ["State", "allreduce_hook", "all_reduce", "Error", "codecs", "topologies"]

codecs = ("fp32", "bf16", "int8", "dyntree8")
topologies = ("ring", "torus2d")  # and "torus2d:RxC" for a given shape

_lock = _threading.Lock()
_channels = {}       # process group -> channels given out so far
_plain_engines = {}  # process group -> the engine of lockstep_torch.all_reduce
_plain_cuda_engines = {}  # (process group, device index) -> the CUDA engine of lockstep_torch.all_reduce


def _group_of(process_group):
    if process_group is not None:
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise Error("lockstep_torch: this rank is not a member of the process group it was given "
                        "(new_group returns a placeholder on the ranks it leaves out)")
        if not isinstance(process_group, dist.ProcessGroup):
            raise Error("lockstep_torch: group must be a torch.distributed ProcessGroup, not "
                        f"{type(process_group).__name__}")
        return process_group
    if not dist.is_initialized():
        raise Error("lockstep_torch: torch.distributed is not initialised (call init_process_group first)")
    return dist.distributed_c10d._get_default_group()


def _seconds(timeout):
    if isinstance(timeout, _datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _same_timeout(engine, timeout, rank):
    # The engine's timeout is whole milliseconds, held at a century (policies.hpp's timeout_ms;
    # the CUDA engine reports what it was given): compare both held there.
    if timeout is None:
        return
    century = 36525 * 86400.0
    asked = _seconds(timeout)
    if not asked > 0:
        raise Error(f"lockstep_torch: all_reduce on rank {rank}: timeout must be a positive number of seconds, not {asked}")
    asked, have = min(asked, century), min(engine.timeout, century)
    if abs(asked - have) > max(1e-3, 1e-9 * asked):
        raise Error(f"lockstep_torch: all_reduce on rank {rank}: timeout {asked:g} s, but this group's is "
                    f"{have:g} s, set by its first call (a group keeps one timeout)")


def _engine(process_group, timeout, segment_bytes=0):
    with _lock:
        return _engine_locked(process_group, timeout, segment_bytes)


def _engine_locked(process_group, timeout, segment_bytes=0):
    """_engine with _lock held by the caller: the next channel of the group, taken once."""
    channel = _channels.get(process_group, 0)
    if channel >= _C.max_channels:
        raise Error(f"lockstep_torch: at most {_C.max_channels} lockstep groups over one process group")
    engine = _C.Engine(process_group, channel, _seconds(timeout), int(segment_bytes))
    _channels[process_group] = channel + 1
    return engine


def _backend(process_group):
    """"nccl", "gloo", ...; "" for a process group torch.distributed does not know by name (made
    directly, not by init_process_group or new_group)."""
    try:
        return str(dist.get_backend(process_group))
    except Exception:
        return ""


def _cuda_device(device, rank):
    """The index of a CUDA device, or an Error saying why CUDA buckets cannot run here."""
    where = f"lockstep: lockstep_torch on rank {rank}: invalid argument"
    if not getattr(_C, "has_cuda", False):
        raise Error(f"{where}: this build has no CUDA buckets (nvcc and NCCL were not found when it was built)")
    ok, why = _C.cuda_available()
    if not ok:
        raise Error(f"{where}: CUDA buckets need a GPU, and none is visible ({why})")
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _agree(process_group, settings, payload=b"", device=None):
    """One all-gather over the group (a collective call): returns rank 0's payload (at most 128
    bytes, zero-padded to 128) on every rank, after checking that every rank passed the same settings; where they
    differ, every rank raises an Error naming both sides. The tensors are on `device` over NCCL,
    on the CPU otherwise."""
    rank, size = process_group.rank(), process_group.size()
    text = settings.encode()
    if len(payload) > 128 or len(text) > 127:
        raise Error(f"lockstep: lockstep_torch on rank {rank}: invalid argument: settings too long to agree on")
    row = bytearray(256)
    row[:len(payload)] = payload
    row[128:128 + len(text)] = text
    nccl = _backend(process_group) == "nccl"
    on = device if nccl else torch.device("cpu")
    mine = torch.tensor(list(row), dtype=torch.uint8, device=on)
    rows = [torch.empty_like(mine) for _ in range(size)]
    process_group.allgather([rows], [mine]).wait()
    rows = [bytes(r.cpu().tolist()) for r in rows]
    for peer, r in enumerate(rows):
        other = r[128:].rstrip(b"\0").decode(errors="replace")
        if other != settings:
            raise Error(f"lockstep: lockstep_torch on rank {rank} (peer {peer}): mismatch: settings differ: "
                        f"rank {rank} has '{settings}', rank {peer} has '{other}'")
    return rows[0][:128]


def _cuda_engine(process_group, device_index, timeout, settings):
    """Joins a lockstep CUDA engine on every rank of the group (a collective call): rank 0's NCCL
    id travels with the settings check (_agree)."""
    rank, size = process_group.rank(), process_group.size()
    uid = _C.cuda_unique_id() if rank == 0 else b""
    uid = _agree(process_group, settings, uid, torch.device("cuda", device_index))
    return _C.CudaEngine(uid, rank, size, device_index, _seconds(timeout))


@_atexit.register
def _close_engines():
    # Before the interpreter (and with it CUDA) is torn down: each waits for its pending calls,
    # joins its worker and lets go of its process group, while threads may still take the GIL.
    # The channel counts go too: they hold the process groups, which must be free to go with
    # dist.destroy_process_group() (their Gloo threads joined then, not during finalisation).
    # Only at the end: a State made after this could be given a channel a live State has.
    with _lock:
        _plain_cuda_engines.clear()
        _plain_engines.clear()
        _channels.clear()


class State:
    """The state of lockstep's DDP hook: its group over the process group, its settings, and the
    error-feedback residuals of every bucket (by bucket index).

    DDP rebuilds its buckets after the first iteration, so error feedback starts with the second
    (as PowerSGD's state starts after it); a bucket whose size changes after that is an Error.
    codec: fp32, bf16, int8 or dyntree8; topology: ring, torus2d or torus2d:RxC; error_feedback
    is ignored for fp32 (lossless); timeout in seconds (or a timedelta) bounds every wait;
    segment_bytes is the pipelining unit of large buckets (0: 1 MiB); ranks must agree on it.
    device: where the model's buckets are, "cpu" or "cuda[:N]"; None: "cuda" over an NCCL process
    group, else "cpu". "cuda" means torch's current device: call torch.cuda.set_device(local_rank)
    first, as torchrun scripts do, or name the device (two ranks on one GPU fail in NCCL's init). A CUDA State reduces its buckets in the order of
    torch's current stream, on a communicator of its own (its settings are checked across the
    ranks when it is made); segment_bytes does not apply there (a chunk is one message).
    """

    def __init__(self, process_group=None, codec="dyntree8", error_feedback=True, topology="torus2d",
                 timeout=300.0, segment_bytes=0, device=None):
        self.process_group = _group_of(process_group)
        self.codec = codec
        self.error_feedback = bool(error_feedback)
        self.topology = topology
        self.iteration = 0
        # Names and the torus shape are checked now, not in backward.
        _C.check_settings(codec, topology, self.process_group.rank(), self.process_group.size())
        if device is None:
            device = "cuda" if _backend(self.process_group) == "nccl" else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            index = _cuda_device(self.device, self.process_group.rank())
            self.device = torch.device("cuda", index)
            settings = f"{codec} {topology} ef={int(self.error_feedback)}"
            self._engine = _cuda_engine(self.process_group, index, timeout, settings)
        elif self.device.type == "cpu":
            self._engine = _engine(self.process_group, timeout, segment_bytes)
        else:
            raise Error(f"lockstep_torch: State for buckets on '{device}': cpu or cuda")

    def reduce_bucket(self, tensor, bucket_index, done):
        """Starts the averaging all-reduce of one bucket; done(None) or done(message) follows (at
        once for a CUDA bucket: its reduction is then queued on torch's current stream)."""
        index = bucket_index if (self.error_feedback and self.iteration > 0) else -1
        if self.device.type == "cuda":
            self._engine.reduce_bucket(tensor, _stream_of(tensor), self.codec, self.topology, index)
            done(None)
        else:
            self._engine.reduce_bucket_async(tensor, self.codec, self.topology, index, done)

    def synchronize(self):
        """Waits until every bucket started so far has been reduced."""
        self._engine.synchronize()

    def residual_buckets(self):
        """{bucket index: element count} of the buckets that keep error-feedback residuals."""
        return self._engine.buckets()

    def reset(self):
        """Drops every bucket's residuals (after changing the model's buckets, say)."""
        self._engine.reset_buckets()


def _stream_of(tensor):
    if not tensor.is_cuda:
        raise Error(f"lockstep: allreduce_hook: invalid argument: tensor on {tensor.device}: this State reduces "
                    "CUDA buckets (make it with device='cpu' for a CPU model)")
    return torch.cuda.current_stream(tensor.device).cuda_stream


def allreduce_hook(state, bucket):
    """DDP communication hook: averages the bucket with lockstep's all-reduce (state's codec and
    topology). CPU buckets: on lockstep's worker thread, the returned future completes when it is
    done. CUDA buckets: queued on torch's current stream, and the future is complete at once, as
    NCCL's are (what reads the bucket after it on that stream sees the reduced values)."""
    tensor = bucket.buffer()
    if state.device.type == "cuda":
        # Complete at once (done(None) before reduce_bucket returns); errors raise here.
        fut = torch.futures.Future(devices=[tensor.device] if tensor.is_cuda else None)
        state.reduce_bucket(tensor, bucket.index(), lambda message: fut.set_result(tensor))
        if bucket.is_last():
            state.iteration += 1
        return fut
    # A CPU bucket completes on the worker. A failure must reach DDP as an exception: torch 1.13's
    # Future.set_exception stores it as the value, which DDP's reducer then tries to cast to a
    # Tensor ("Unable to cast ... to Tensor"). So the worker's future carries the message, and a
    # callback raises it, which torch propagates as the error of the future DDP waits on.
    raw = torch.futures.Future()

    def done(message):
        raw.set_result(tensor if message is None else message)

    state.reduce_bucket(tensor, bucket.index(), done)
    if bucket.is_last():
        state.iteration += 1
    return raw.then(_bucket_or_raise)


def _bucket_or_raise(fut):
    value = fut.value()
    if isinstance(value, str):
        raise Error(value)
    return value


def _op_name(op, rank):
    """"sum" or "average" for torch.distributed's ReduceOp.SUM / AVG; a string goes through as it is
    (lockstep names an unknown one); any other ReduceOp or type is an Error saying what is accepted."""
    if isinstance(op, str):
        return op
    if isinstance(op, dist.ReduceOp):
        if op == dist.ReduceOp.SUM:
            return "sum"
        if hasattr(dist.ReduceOp, "AVG") and op == dist.ReduceOp.AVG:
            return "average"
    raise Error(f"lockstep: all_reduce on rank {rank}: invalid argument: op {op!r}: lockstep reduces by "
                "'sum' or 'average' (ReduceOp.SUM or ReduceOp.AVG)")


def all_reduce(tensor, codec="fp32", topology="ring", group=None, op="sum", timeout=None):
    """Reduces a contiguous float32 tensor in place over `group` (default: the world) with
    lockstep's codec and topology; op is "sum" or "average" (or torch.distributed's ReduceOp.SUM or
    ReduceOp.AVG). Returns the tensor. The first call on
    a group takes its channel (see the module's note on order) and sets its timeout (seconds or a
    timedelta; default 300 s), which every later call on that group keeps: a later call that names
    another timeout raises Error rather than silently waiting for the first one's.
    A CUDA tensor is reduced in the order of torch's current stream (the first call on a group and
    device joins a communicator, on every rank); as with NCCL's all_reduce, its count is not
    checked across the ranks."""
    pg = _group_of(group)
    op = _op_name(op, pg.rank())
    first_timeout = 300.0 if timeout is None else timeout
    if tensor.is_cuda:
        index = _cuda_device(tensor.device, pg.rank())
        with _lock:  # held while the engine is made (a collective call): it is made once
            engine = _plain_cuda_engines.get((pg, index))
            if engine is None:
                engine = _cuda_engine(pg, index, first_timeout, "all_reduce")
                _plain_cuda_engines[(pg, index)] = engine
        _same_timeout(engine, timeout, pg.rank())
        engine.all_reduce(tensor, torch.cuda.current_stream(tensor.device).cuda_stream, codec, topology, op)
        return tensor
    with _lock:  # held while the engine is made: two threads' first calls must not take two channels
        engine = _plain_engines.get(pg)
        if engine is None:
            engine = _engine_locked(pg, first_timeout)
            _plain_engines[pg] = engine
    _same_timeout(engine, timeout, pg.rank())
    engine.all_reduce(tensor, codec, topology, op)
    return tensor
