"""lockstep_torch: lockstep's compressed all-reduce inside PyTorch.

A DDP communication hook and a plain all_reduce over any torch.distributed process group (Gloo on
CPU), running lockstep's topologies (ring, torus2d) and codecs (fp32, bf16, int8, dyntree8) over
the group's own point-to-point send/recv: no MPI, the ranks and the rendezvous are torch's.

    import lockstep_torch
    state = lockstep_torch.State(process_group=None, codec="dyntree8", error_feedback=True, topology="torus2d")
    ddp_model.register_comm_hook(state, lockstep_torch.allreduce_hook)

    lockstep_torch.all_reduce(tensor, codec="int8", topology="ring", group=None, op="sum")

Every rank must create its States (and make its first all_reduce call on a group) in the same
order: each gets a tag channel of the process group in creation order, as new_group numbers its
groups. Bad use raises lockstep_torch.Error (a RuntimeError) with lockstep's message, naming the
rank (and the peer, where one is involved); a peer that never answers is a timeout after
`timeout` seconds (default 300), never a hang. docs/torch.md has the details.
"""
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


def _group_of(process_group):
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        raise Error("lockstep_torch: torch.distributed is not initialised (call init_process_group first)")
    return dist.distributed_c10d._get_default_group()


def _seconds(timeout):
    if isinstance(timeout, _datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _engine(process_group, timeout, segment_bytes=0):
    with _lock:
        channel = _channels.get(process_group, 0)
        if channel >= _C.max_channels:
            raise Error(f"lockstep_torch: at most {_C.max_channels} lockstep groups over one process group")
        engine = _C.Engine(process_group, channel, _seconds(timeout), int(segment_bytes))
        _channels[process_group] = channel + 1
        return engine


class State:
    """The state of lockstep's DDP hook: its group over the process group, its settings, and the
    error-feedback residuals of every bucket (by bucket index).

    DDP rebuilds its buckets after the first iteration, so error feedback starts with the second
    (as PowerSGD's state starts after it); a bucket whose size changes after that is an Error.
    codec: fp32, bf16, int8 or dyntree8; topology: ring, torus2d or torus2d:RxC; error_feedback
    is ignored for fp32 (lossless); timeout in seconds (or a timedelta) bounds every wait;
    segment_bytes is the pipelining unit of large buckets (0: 1 MiB); ranks must agree on it.
    """

    def __init__(self, process_group=None, codec="dyntree8", error_feedback=True, topology="torus2d",
                 timeout=300.0, segment_bytes=0):
        self.process_group = _group_of(process_group)
        self.codec = codec
        self.error_feedback = bool(error_feedback)
        self.topology = topology
        self.iteration = 0
        # Names and the torus shape are checked now, not in backward.
        _C.check_settings(codec, topology, self.process_group.rank(), self.process_group.size())
        self._engine = _engine(self.process_group, timeout, segment_bytes)

    def reduce_bucket(self, tensor, bucket_index, done):
        """Starts the averaging all-reduce of one bucket; done(None) or done(message) follows."""
        index = bucket_index if (self.error_feedback and self.iteration > 0) else -1
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


def allreduce_hook(state, bucket):
    """DDP communication hook: averages the bucket with lockstep's all-reduce (state's codec and
    topology) on lockstep's worker thread; the returned future completes when it is done."""
    tensor = bucket.buffer()
    fut = torch.futures.Future()

    def done(message):
        if message is None:
            fut.set_result(tensor)
        else:
            fut.set_exception(Error(message))

    state.reduce_bucket(tensor, bucket.index(), done)
    if bucket.is_last():
        state.iteration += 1
    return fut


def all_reduce(tensor, codec="fp32", topology="ring", group=None, op="sum", timeout=300.0):
    """Reduces a contiguous float32 CPU tensor in place over `group` (default: the world) with
    lockstep's codec and topology; op is "sum" or "average". Returns the tensor. The first call on
    a group takes its channel (see the module's note on order); `timeout` applies from then on."""
    pg = _group_of(group)
    with _lock:
        engine = _plain_engines.get(pg)
    if engine is None:
        engine = _engine(pg, timeout)
        with _lock:
            _plain_engines[pg] = engine
    engine.all_reduce(tensor, codec, topology, op)
    return tensor
