"""tests/torch/test_errors.py: bad use of lockstep_torch on 2 ranks raises lockstep_torch.Error
(a RuntimeError) with lockstep's message naming the rank (and the peer), never a hang:
  a tensor that is not contiguous float32 (all_reduce, the hook's path, and a float64 DDP model
  whose backward then raises); unknown codec, topology, op; a torus shape that does not fit;
  a bucket whose size changes under error feedback (a bucket that only moves keeps its residuals);
  the transport alone: a message shorter than posted is errc::mismatch, never a truncation;
  settings that differ between the ranks (codec, topology, element count): both ranks fail with
  errc::mismatch naming both sides, and under DDP backward raises with lockstep's message; a peer that never calls: errc::timeout after the State's
  2-second timeout (last: a Gloo timeout closes the process group's connections); a timeout of
  inf or 1e10 s waits (no limit) instead of expiring at once; an Inf step under error feedback
  leaves the later steps finite.
"""
import time

from harness import skip_without_torch, spawn


def body(rank, world):
    import torch
    import torch.distributed as dist
    import lockstep_torch as lt

    def expect(fn, *needles):
        try:
            fn()
        except lt.Error as e:
            msg = str(e)
            for n in needles:
                assert n in msg, f"rank {rank}: '{n}' not in: {msg}"
            return msg
        raise AssertionError(f"rank {rank}: no lockstep_torch.Error, expected one with {needles}")

    def collect(state, tensor, index):
        got = []
        state.reduce_bucket(tensor, index, got.append)
        state.synchronize()
        assert len(got) == 1, f"rank {rank}: the completion ran {len(got)} times"
        return got[0]

    me = f"on rank {rank}"
    # Local checks, before any message: the group stays usable.
    expect(lambda: lt.all_reduce(torch.ones(8, dtype=torch.float64)), "float32", "Double", me)
    expect(lambda: lt.all_reduce(torch.ones(8, dtype=torch.int32)), "float32", me)
    expect(lambda: lt.all_reduce(torch.ones(16)[::2]), "not contiguous", me)
    expect(lambda: lt.all_reduce(torch.ones(8), codec="fp8"), "unknown codec 'fp8'")
    expect(lambda: lt.all_reduce(torch.ones(8), topology="tree"), "unknown topology 'tree'")
    expect(lambda: lt.all_reduce(torch.ones(8), topology="torus2d:3x3"), "3x3 does not match a group of 2")
    expect(lambda: lt.all_reduce(torch.ones(8), op="max"), "unknown op 'max'")
    # torch.distributed's ReduceOp: SUM and AVG are taken, the others named (was pybind's TypeError).
    expect(lambda: lt.all_reduce(torch.ones(8), op=dist.ReduceOp.MAX), "op", "'sum' or 'average'", me)
    expect(lambda: lt.all_reduce(torch.ones(8), op=3), "op 3", me)
    for op, want in ((dist.ReduceOp.SUM, 2.0 + 1.0), (dist.ReduceOp.AVG, 1.5)):
        x = torch.full((8,), float(rank + 1))
        lt.all_reduce(x, op=op)
        assert torch.equal(x, torch.full((8,), want)), f"rank {rank}: {op}: {x}"
    expect(lambda: lt.State(codec="fp8"), "unknown codec")
    x = torch.full((8,), float(rank + 1))
    lt.all_reduce(x)
    assert torch.equal(x, torch.full((8,), 3.0)), f"rank {rank}: all_reduce after the refusals gave {x}"
    # The group keeps its first call's timeout: another one is refused, the same one is not.
    expect(lambda: lt.all_reduce(torch.ones(8), timeout=2), "timeout 2 s", "300 s, set by its first call")
    lt.all_reduce(torch.ones(8), timeout=300)
    # Not a process group, or one this rank is not in: a clear Error, not pybind's TypeError.
    expect(lambda: lt.all_reduce(torch.ones(8), group=object()), "ProcessGroup, not object")
    solo = dist.new_group([0])
    if rank == 1:
        expect(lambda: lt.all_reduce(torch.ones(8), group=solo), "not a member of the process group")

    # A float64 DDP model: the hook refuses its bucket, and backward raises.
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(torch.nn.Linear(4, 2).double())
    state = lt.State(codec="dyntree8", topology="ring")
    model.register_comm_hook(state, lt.allreduce_hook)
    loss = model(torch.ones(3, 4, dtype=torch.float64)).sum()
    try:
        loss.backward()
        raise AssertionError(f"rank {rank}: backward of a float64 model went through the hook")
    except RuntimeError as e:
        assert "float32" in str(e), f"rank {rank}: {e}"

    # Error feedback keeps residuals per bucket: a moved bucket keeps them, a resized one is refused.
    state = lt.State(codec="dyntree8", error_feedback=True, topology="ring")
    state.iteration = 1  # past DDP's first iteration, where error feedback starts
    assert collect(state, torch.ones(1000), 0) is None
    assert collect(state, torch.ones(1000), 0) is None  # a new tensor: another address
    assert state.residual_buckets() == {0: 1000}
    expect(lambda: collect(state, torch.ones(1200), 0), "bucket 0 held 1000 elements and now holds 1200", me)
    t = torch.ones(1000) * (rank + 1)
    assert collect(state, t, 0) is None and torch.allclose(t, torch.full((1000,), 1.5), rtol=0.02)
    state.reset()
    assert state.residual_buckets() == {}
    assert collect(state, torch.ones(1200), 0) is None

    # One overflowed step (the one a loss scaler skips) leaves no Inf or NaN in the residuals: the
    # steps after it are finite again.
    state = lt.State(codec="int8", error_feedback=True, topology="ring")
    state.iteration = 1
    bad = torch.ones(1000)
    bad[7] = float("inf")
    assert collect(state, bad, 3) is None and not torch.isfinite(bad).all()
    for _ in range(2):
        t = torch.ones(1000) * (rank + 1)
        assert collect(state, t, 3) is None and torch.isfinite(t).all(), f"rank {rank}: after an Inf step: {t}"

    # A timeout too large to count (inf, 1e10 s, timedelta.max) means no limit, not a wait that
    # expires at once.
    import datetime
    for big in (float("inf"), 1e10, datetime.timedelta.max):
        state = lt.State(codec="fp32", topology="ring", error_feedback=False, timeout=big)
        t = torch.ones(64) * (rank + 1)
        assert collect(state, t, -1) is None and torch.equal(t, torch.full((64,), 1.5)), f"rank {rank}: timeout {big}: {t}"

    # A positive timeout under half a millisecond is held at 1 ms (policies.hpp's timeout_ms), not
    # rounded to 0, which failed every wait at once and closed the process group.
    tiny = lt.State(codec="fp32", topology="ring", error_feedback=False, timeout=0.0004)
    assert tiny._engine.timeout == 0.001, f"rank {rank}: timeout 0.0004 s held at {tiny._engine.timeout} s"
    del tiny

    # Settings that differ between the ranks: both ranks fail, naming what differs.
    for settings, needle in [
        ((["int8", "dyntree8"][rank], "ring", 1000), "codecs differ"),
        (("fp32", ["ring", "torus2d"][rank], 1000), "topologies differ"),
        (("fp32", "ring", 1000 + rank), "element count"),
    ]:
        codec, topo, n = settings
        state = lt.State(codec=codec, topology=topo, error_feedback=False, timeout=20)
        msg = collect(state, torch.ones(n), -1)
        assert msg is not None and needle in msg and "mismatch" in msg and me in msg and "peer" in msg, \
            f"rank {rank}: {settings}: {msg}"
        # The failed group stays failed: later calls say so at once.
        msg = collect(state, torch.ones(n), -1)
        assert msg is not None and "failed earlier" in msg, f"rank {rank}: after a mismatch: {msg}"

    # A failed all-reduce under DDP reaches backward as an exception carrying lockstep's message
    # (with Future.set_exception, torch 1.13's reducer read the error as the bucket and raised
    # "Unable to cast ... to Tensor").
    model = DDP(torch.nn.Linear(4, 2))
    state = lt.State(codec=["int8", "dyntree8"][rank], topology="ring", timeout=20)
    model.register_comm_hook(state, lt.allreduce_hook)
    loss = model(torch.ones(3, 4)).sum()
    try:
        loss.backward()
        raise AssertionError(f"rank {rank}: backward with codecs that differ went through")
    except RuntimeError as e:
        msg = str(e)
        assert "codecs differ" in msg and "Unable to cast" not in msg and me in msg, f"rank {rank}: {msg}"

    # The transport alone: a message shorter than the receive posted is a mismatch, never a
    # truncation (inline-sized, around the 16-byte trailer, empty, multi-MiB); equal sizes arrive whole.
    pg = dist.distributed_c10d._get_default_group()
    peer = 1 - rank
    for tag, (sent, posted) in enumerate([(0, 0), (48, 48), (1000, 1000), (3 << 20, 3 << 20), (99, 100),
                                          (84, 100), (92, 100), (0, 16), (10, 100), (1 << 20, (1 << 20) + 8)]):
        if sent == posted:
            lt._C._exchange(pg, lt._C.max_channels - 1, peer, tag, sent, posted, 20.0)
        else:
            expect(lambda: lt._C._exchange(pg, lt._C.max_channels - 1, peer, tag, sent, posted, 20.0),
                   "mismatch", f"expected a message of {posted} bytes", me, f"(peer {peer})")

    # A peer that never calls: a timeout, not a hang.
    state = lt.State(codec="dyntree8", topology="ring", timeout=2)
    if rank == 0:
        start = time.monotonic()
        msg = collect(state, torch.ones(1000), -1)
        took = time.monotonic() - start
        assert msg is not None and "timeout" in msg and me in msg and "(peer 1)" in msg, f"rank 0: {msg}"
        assert took < 10, f"rank 0: the timeout of 2 s took {took:.1f} s"
        return {"timeout_s": took, "message": msg}
    time.sleep(4)
    return {}


if __name__ == "__main__":
    skip_without_torch()
    r = spawn(body, 2)[0]
    print(f"errors on 2 ranks: all raised; the 2-second timeout took {r['timeout_s']:.2f} s: {r['message']}")
