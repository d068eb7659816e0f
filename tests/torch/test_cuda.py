"""tests/torch/test_cuda.py: lockstep_torch's CUDA buckets (csrc/cuda_engine.cu: lockstep's device
executor over an NCCL communicator of its own; its orchestration also runs on the CPU in
tests/test_stream_engine.cpp).

Everywhere: the extension says whether it was built with CUDA buckets, and a CUDA State or a CUDA
all_reduce where no GPU is visible (or in a build without them) is a lockstep_torch.Error saying
so, raised before any message, after which the CPU State still works; a State for another device
type is an Error. The all-gather a CUDA State makes (rank 0's NCCL id and every rank's settings)
runs over Gloo: the id reaches every rank, and settings that differ are an Error on every rank.
Where torch sees a GPU (LOCKSTEP_TORCH_REQUIRE_GPU=1, which scripts/gpu-check sets: it must): on
min(2, GPUs) ranks over NCCL, all_reduce of CUDA tensors (fp32 exact on
integers over ring and torus2d, every codec within 2 % of the exact sum), and DDP of test_ddp's
model on the GPUs with the hook: fp32 parameters equal to NCCL's default all-reduce within fp32
rounding after 20 steps, dyntree8 + error feedback within test_ddp's loss distance; settings that
differ between the ranks are an Error on every rank.
"""
import os
import sys

from harness import skip_without_torch, spawn


def without_gpu(rank, world):
    import torch
    import lockstep_torch as lt

    def expect(fn, *needles):
        try:
            fn()
        except lt.Error as e:
            for n in needles:
                assert n in str(e), f"rank {rank}: '{n}' not in: {e}"
            return str(e)
        raise AssertionError(f"rank {rank}: no lockstep_torch.Error, expected one with {needles}")

    a = "(a GPU is visible: the CUDA errors are not checked here)"
    if not (lt._C.has_cuda and torch.cuda.is_available()):
        why = "need a GPU" if lt._C.has_cuda else "no CUDA buckets"
        a = expect(lambda: lt.State(codec="dyntree8", device="cuda"), why)
        expect(lambda: lt.State(codec="fp32", device="cuda:0"), why)
    expect(lambda: lt.State(device="meta"), "cpu or cuda")
    state = lt.State(codec="int8", topology="ring", device="cpu")
    x = torch.full((100,), float(rank + 1))
    lt.all_reduce(x, codec="fp32")
    assert torch.equal(x, torch.full((100,), float(world * (world + 1) // 2))), f"rank {rank}: {x}"
    got = []
    y = torch.ones(64)
    state.reduce_bucket(y, 0, got.append)
    state.synchronize()
    assert got == [None] and torch.allclose(y, torch.ones(64)), f"rank {rank}: {got} {y}"
    # The settings check and id exchange a CUDA State makes (over Gloo here, NCCL on GPUs).
    assert lt._agree(state.process_group, "dyntree8 ring ef=1", b"id" if rank == 0 else b"") == b"id" + bytes(126)
    expect(lambda: lt._agree(state.process_group, ["int8 ring", "dyntree8 ring"][rank]), "settings differ",
                 f"on rank {rank}", "'int8 ring'", "'dyntree8 ring'")
    return a


def with_gpu(rank, world):
    import torch
    import torch.distributed as dist
    import lockstep_torch as lt
    from test_ddp import STEPS, same_on_every_rank, train

    dev = torch.device("cuda", rank)
    for topo in ["ring", "torus2d"]:
        x = torch.arange(1001, dtype=torch.float32, device=dev) % 17 - 8 + rank
        exact = (torch.arange(1001, dtype=torch.float32) % 17 - 8) * world + world * (world - 1) / 2
        lt.all_reduce(x, codec="fp32", topology=topo)
        assert torch.equal(x.cpu(), exact), f"rank {rank}: fp32 all_reduce over {topo} is not exact"
        for codec in ["bf16", "int8", "dyntree8"]:
            g = torch.Generator().manual_seed(rank)
            v = torch.randn(4099, generator=g)
            total = sum(torch.randn(4099, generator=torch.Generator().manual_seed(r)) for r in range(world))
            y = v.to(dev)
            lt.all_reduce(y, codec=codec, topology=topo)
            err = (y.cpu() - total).abs().max().item()
            assert err <= 0.02 * total.abs().max().item() * world, f"rank {rank}: {codec} {topo} error {err}"

    ref, ref_losses = train(torch, rank, None, None, dev)
    same_on_every_rank(torch, dist, ref, "NCCL default", rank)
    default = sum(ref_losses[-5:]) / 5
    scale = 1 + ref.abs().max().item()
    state = lt.State(codec="fp32", error_feedback=False, topology="ring")
    assert state.device == dev, f"rank {rank}: State on {state.device}, not {dev}"
    flat, _ = train(torch, rank, state, lt.allreduce_hook, dev)
    same_on_every_rank(torch, dist, flat, "fp32 hook", rank)
    diff = (flat - ref).abs().max().item()
    assert diff <= 1e-5 * scale, f"rank {rank}: fp32 hook differs from NCCL's by {diff}"
    state = lt.State(codec="dyntree8", error_feedback=True, topology="torus2d")
    flat, losses = train(torch, rank, state, lt.allreduce_hook, dev)
    same_on_every_rank(torch, dist, flat, "dyntree8+ef hook", rank)
    loss = sum(losses[-5:]) / 5
    assert abs(loss - default) <= 0.01 + 0.02 * default, f"rank {rank}: dyntree8+ef {loss:.4f} vs {default:.4f}"
    assert sum(state.residual_buckets().values()) == ref.numel(), f"rank {rank}: {state.residual_buckets()}"
    if world > 1:
        try:
            lt.State(codec=["int8", "dyntree8"][rank % 2], topology="ring")
            raise AssertionError(f"rank {rank}: States with different codecs were made")
        except lt.Error as e:
            assert "settings differ" in str(e), f"rank {rank}: {e}"
    return {"default": default, "dyntree8_ef": loss, "fp32_maxdiff": diff, "steps": STEPS}


if __name__ == "__main__":
    skip_without_torch()
    import torch
    import lockstep_torch as lt
    msg = spawn(without_gpu, 2)[0]
    print(f"CUDA buckets built: {lt._C.has_cuda}; without a GPU a CUDA State says: {msg}")
    if not (lt._C.has_cuda and torch.cuda.is_available()):
        print("the GPU part did not run: " + ("torch sees no GPU here" if lt._C.has_cuda else
                                              "this lockstep_torch was built without CUDA buckets"))
        # scripts/gpu-check sets this on a GPU machine, where a GPU part that cannot run is a failure
        sys.exit(1 if os.environ.get("LOCKSTEP_TORCH_REQUIRE_GPU") else 0)
    world = min(2, torch.cuda.device_count())
    r = spawn(with_gpu, world, backend="nccl")[0]
    print(f"GPU part on {world} rank(s): {r}")
