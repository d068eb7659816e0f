"""tests/torch/harness.py: runs a test body on N ranks as processes (torch.multiprocessing.spawn,
Gloo over a FileStore in a fresh temporary folder, so concurrent runs never share a port).

A test file calls skip_without_torch() first: without torch or a built lockstep_torch it exits 77,
which Meson reports as skipped. spawn(body, world, *args) runs body(rank, world, *args) in every
rank after init_process_group and fails (raises) when any rank raised; each rank's return value is
written back and returned as a list. backend="nccl" puts rank r on GPU r.
"""
import os
import pickle
import sys
import tempfile

SKIP = 77


def skip_without_torch():
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
        import lockstep_torch  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        sys.exit(SKIP)
    if not dist.is_gloo_available():
        print("skipped: this torch has no Gloo backend")
        sys.exit(SKIP)


def _entry(rank, world, folder, body, args, backend):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=world)
    out = body(rank, world, *args)
    with open(os.path.join(folder, f"result.{rank}"), "wb") as f:
        pickle.dump(out, f)
    # Tear down while the interpreter is whole: lockstep's cached engines (their workers joined,
    # their references to the process group dropped), then the group, whose Gloo threads would
    # otherwise drop their last work objects during finalisation, take the GIL and abort the
    # process ("terminate called without an active exception", torch's known exit race).
    import gc
    import weakref
    import lockstep_torch
    del out
    gc.collect()  # States and DDP models kept alive by reference cycles only
    lockstep_torch._close_engines()
    world_group = weakref.ref(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    gc.collect()
    assert world_group() is None, f"rank {rank}: the process group outlived destroy_process_group()"


def spawn(body, world, *args, backend="gloo"):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="lockstep_torch_") as folder:
        mp.spawn(_entry, args=(world, folder, body, args, backend), nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(os.path.join(folder, f"result.{r}"), "rb") as f:
                results.append(pickle.load(f))
        return results
