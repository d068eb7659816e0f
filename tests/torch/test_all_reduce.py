"""tests/torch/test_all_reduce.py WORLD: lockstep_torch.all_reduce on WORLD ranks (processes, Gloo),
every codec x topology x op over sizes 0, 1, 7, 1000, 65537 and 300001 (several 1 MiB segments).

  fp32, integer-valued inputs: exactly the sum (exact in fp32 at these magnitudes).
  every codec, random inputs: within docs/codecs.md's bound of a collective,
      |result - sum| <= (N*d_block + D*d_value) * M + N*1e-6*M   (divided by N for average)
    with M = max_i sum_r |x_r[i]| over the whole buffer for the 8-bit codecs (the doc's bound holds
    per block; the whole buffer's M only loosens it) and per element for bf16; D = N on a ring,
    R+C-1 on an RxC torus; int8 d_block = 1/254; dyntree8 0.9/64 (its top-bin worst case, for
    every quantisation); bf16 d_value = 2^-8.
  every rank ends with the same bits; a NaN in one rank's input is NaN in the result.
"""
import math
import sys

from harness import skip_without_torch, spawn

SIZES = [0, 1, 7, 1000, 65537, 300001]


def torus_shape(n):
    r = 1
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            r = d
    return r, n // r


def body(rank, world):
    import torch
    import torch.distributed as dist
    import lockstep_torch as lt

    checked = 0
    topologies = ["ring", "torus2d"]
    r, c = torus_shape(world)
    topologies.append(f"torus2d:{world}x1")  # a shape given by name: one column of all ranks
    for size in SIZES:
        # Every rank's input, so each rank knows the exact sum (float64).
        gens = [torch.Generator().manual_seed(1000 * q + size) for q in range(world)]
        inputs = [torch.randn(size, generator=g) * (1 + q) for q, g in enumerate(gens)]
        exact = torch.stack(inputs).double().sum(0) if size else torch.zeros(0, dtype=torch.float64)
        absum = torch.stack(inputs).double().abs().sum(0) if size else torch.zeros(0, dtype=torch.float64)
        for topo in topologies:
            if topo == "ring":
                depth = world
            else:
                rr, cc = (r, c) if topo == "torus2d" else (world, 1)
                depth = rr + cc - 1
            for codec in lt.codecs:
                for op in ["sum", "average"]:
                    x = inputs[rank].clone()
                    lt.all_reduce(x, codec=codec, topology=topo, op=op)
                    div = world if op == "average" else 1
                    err = (x.double() - exact / div).abs()
                    M = absum.max().item() if size else 0.0
                    if codec == "fp32":
                        bound = world * 2.0 ** -23 * absum / div
                    elif codec == "bf16":
                        bound = (depth * 2.0 ** -8 + world * 1e-6) * absum / div
                    else:
                        d_block = 1 / 254 if codec == "int8" else 0.9 / 64
                        bound = torch.full_like(absum, (world * d_block + world * 1e-6) * M / div)
                    bad = err > bound
                    assert not bool(bad.any()), (
                        f"rank {rank}: {codec} {topo} {op} size {size}: {int(bad.sum())} values past the bound, "
                        f"worst error {err.max().item():.3g}")
                    # Every rank holds the same bits: rank 0's broadcast over Gloo compares them.
                    ref = x.clone()
                    dist.broadcast(ref, 0)
                    assert torch.equal(ref.view(torch.int32), x.view(torch.int32)), \
                        f"rank {rank}: {codec} {topo} {op} size {size}: ranks differ"
                    checked += 1
    # Exact fp32 sums of integer-valued inputs, on both topologies.
    for topo in topologies:
        x = torch.arange(65537, dtype=torch.float32) % 1000 * (rank + 1)
        lt.all_reduce(x, codec="fp32", topology=topo)
        ref = torch.arange(65537, dtype=torch.float32) % 1000 * (world * (world + 1) // 2)
        assert torch.equal(x, ref), f"rank {rank}: fp32 {topo} is not exact"
    # A NaN on one rank reaches every rank, for every codec.
    for codec in lt.codecs:
        x = torch.ones(4096)
        if rank == 0:
            x[100] = float("nan")
        lt.all_reduce(x, codec=codec)
        assert math.isnan(x[100].item()), f"rank {rank}: {codec} lost a NaN"
        assert not math.isnan(x[4000].item()), f"rank {rank}: {codec} spread a NaN past its block"
    return checked


if __name__ == "__main__":
    skip_without_torch()
    world = int(sys.argv[1])
    counts = spawn(body, world)
    print(f"all_reduce on {world} ranks: {counts[0]} codec x topology x op x size cases on every rank")
