#!/usr/bin/python3
# Debian's interpreter on purpose: python3-torch is installed for it, not for a python3 that a
# version manager may put first on PATH.
"""bench/torch_ddp/torch_ddp.py: DDP steps of a real model with Gloo's default all-reduce, PyTorch's
16-bit compression hooks and lockstep_torch's hook per codec, all in one run.

    bench/torch_ddp/torch_ddp.py [--model resnet18|fashion_cnn] [--world 4] [--steps 5] [--warmup 2]
        [--batch 8] [--image 32] [--codecs fp32,bf16,int8,dyntree8] [--topology torus2d]
        [--rounds 1] [--segment-bytes B] [--json] [--build DIR]
    one rank per process (bench/torch_ddp/netlab runs it so):  --rank R --world N --init tcp://H:P

Without --rank it spawns --world ranks on this machine (Gloo over loopback, a file store).
Variants, in this order every round (rounds interleave them, so a busy neighbour slows all alike):
  gloo           DDP's default: Gloo's fp32 all-reduce of each bucket
  fp16_hook      torch's default_hooks.fp16_compress_hook (cast, Gloo all-reduce, cast back)
  bf16_hook      torch's default_hooks.bf16_compress_hook: Gloo in torch 1.13 cannot all-reduce
                 bfloat16 ("Invalid scalar type"); tried, and reported as failed when it fails
  lockstep:<c>   lockstep_torch.allreduce_hook, codec c (error feedback on for the lossy ones),
                 --topology
Figures per variant (milliseconds, the slowest rank's mean over the timed steps):
  step     one DDP step: forward, backward (buckets reduced as they fill), optimizer step
  exposed  step minus the same step under no_sync() (no communication), timed in the same round:
           the communication that backward did not hide
  comm     the step's communication alone: the buckets DDP made, all-reduced the variant's way
           one after another outside backward (gloo: async all_reduce of every bucket, then wait;
           fp16: cast, async all_reduce, wait, cast back; lockstep: its hook's path for every
           bucket, then wait) -- the figure the targets compare
  comm cpu the CPU time of a rank's whole process (every thread: Python, lockstep's worker, Gloo's)
           during one comm, mean over ranks: where comm is well above the links' bound and comm
           cpu x ranks per core comes near comm, the variant waits for CPU, not for the network
Each variant's comm is first checked once against Gloo's fp32 sum of the same buckets: a variant off
by more than its codec's bound is reported as failed, not timed.
Table on stdout (ratios of comm against gloo and fp16_hook), or JSON lines with --json.
"""
import argparse
import json
import os
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))


def find_package(build):
    """Puts the newest built lockstep_torch (BUILD/python) on sys.path."""
    cands = [build] if build else [os.path.join(root, d) for d in os.listdir(root) if d.startswith("build")]
    best = None
    for b in cands:
        init = os.path.join(b, "python", "lockstep_torch", "__init__.py")
        if os.path.exists(init) and (best is None or os.path.getmtime(init) > os.path.getmtime(best)):
            best = init
    if best is None:
        sys.exit("torch_ddp: no built lockstep_torch (ninja -C build python/lockstep_torch/...); pass --build")
    sys.path.insert(0, os.path.dirname(os.path.dirname(best)))


def make_model(torch, name, image):
    torch.manual_seed(0)
    nn = torch.nn
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10), (3, image, image)
    if name == "fashion_cnn":  # the sample trainer's network (bench/train_vs_torch), channels 32,64,128
        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                    nn.MaxPool2d(2, 2, ceil_mode=True)]
        return nn.Sequential(*block(1, 32), *block(32, 64), *block(64, 128), nn.Flatten(), nn.Linear(128 * 16, 10)), \
            (1, 28, 28)
    raise SystemExit(f"torch_ddp: unknown model {name}")


def rank_main(rank, world, init, a):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    find_package(a.build)
    import lockstep_torch as lt

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    net, shape = make_model(torch, a.model, a.image)
    params = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, *shape, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)

    variants = ["gloo", "fp16_hook", "bf16_hook"] + [f"lockstep:{c}" for c in a.codecs.split(",")]
    states = {}
    for v in variants:
        if v.startswith("lockstep:"):
            c = v.split(":")[1]
            states[v] = lt.State(codec=c, error_feedback=c != "fp32", topology=a.topology,
                                 segment_bytes=a.segment_bytes)

    def slowest(seconds):
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() * 1e3

    def mean(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / world * 1e3

    def build(v):
        model = DDP(make_model(torch, a.model, a.image)[0])
        if v == "fp16_hook":
            model.register_comm_hook(pg, default_hooks.fp16_compress_hook)
        elif v == "bf16_hook":
            model.register_comm_hook(pg, default_hooks.bf16_compress_hook)
        elif v.startswith("lockstep:"):
            model.register_comm_hook(states[v], lt.allreduce_hook)
        return model

    def step(model, opt, sync=True):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        if sync:
            loss.backward()
        else:
            with model.no_sync():
                loss.backward()
        opt.step()

    # The buckets DDP makes for this model (after its rebuild), recorded once by a hook that only looks.
    sizes = []

    def record(_, bucket):
        sizes.append(bucket.buffer().numel())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    probe = DDP(make_model(torch, a.model, a.image)[0])
    probe.register_comm_hook(None, record)
    popt = torch.optim.SGD(probe.parameters(), lr=0.01)
    for _ in range(2):
        sizes.clear()
        step(probe, popt)
    del probe, popt
    buckets = [torch.randn(n, generator=g) * 1e-3 for n in sizes]

    def comm_once(v):
        if v == "gloo":
            works = [dist.all_reduce(b, async_op=True) for b in buckets]
            for w in works:
                w.wait()
        elif v in ("fp16_hook", "bf16_hook"):
            dt = torch.float16 if v == "fp16_hook" else torch.bfloat16
            casts = [b.to(dt).div_(world) for b in buckets]
            works = [dist.all_reduce(c, async_op=True) for c in casts]
            for b, c, w in zip(buckets, casts, works):
                w.wait()
                b.copy_(c)
        else:
            st = states[v]
            errors = []
            for i, b in enumerate(buckets):
                st.reduce_bucket(b, i, lambda m: errors.append(m) if m else None)
            st.synchronize()
            if errors:
                raise RuntimeError(errors[0])

    def check(v):
        """One comm of the variant against Gloo's fp32 sum of the same buckets (an average for every
        variant but gloo), before it is timed: a fast but wrong path is reported as failed, not timed.
        Bounds, as a fraction of the bucket's largest value: fp32 1e-5, 16-bit 2e-2, 8-bit 0.1."""
        saved = [b.clone() for b in buckets]
        want = [b.clone() for b in buckets]
        for w in want:
            dist.all_reduce(w)
            if v != "gloo":
                w.div_(world)
        comm_once(v)
        tol = 1e-5 if v in ("gloo", "lockstep:fp32") else 2e-2 if v in ("fp16_hook", "bf16_hook", "lockstep:bf16") else 0.1
        for i, (b, w) in enumerate(zip(buckets, want)):
            err, scale = (b - w).abs().max().item(), w.abs().max().item()
            if not err <= tol * scale:  # NaN fails too
                raise RuntimeError(f"self-check failed: bucket {i} ({b.numel()} values) is off Gloo's reference by "
                                   f"{err / scale if scale else err:.3g} of its largest value (allowed {tol})")
        for b, s in zip(buckets, saved):
            b.copy_(s)

    results = {v: {"step": [], "exposed": [], "comm": [], "comm_cpu": []} for v in variants}
    failed = {}
    models = {}
    for rnd in range(a.rounds):
        for v in variants:
            if v in failed:
                continue
            try:
                if v not in models:
                    model = build(v)
                    models[v] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
                    if v in states:
                        states[v].iteration = 0
                model, opt = models[v]
                for _ in range(a.warmup if rnd == 0 else 1):
                    step(model, opt)
                if rnd == 0:
                    check(v)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step(model, opt)
                t_step = (time.perf_counter() - t0) / a.steps
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step(model, opt, sync=False)
                t_local = (time.perf_counter() - t0) / a.steps
                comm_once(v)
                dist.barrier()
                t0, cpu0 = time.perf_counter(), time.process_time()
                for _ in range(a.steps):
                    comm_once(v)
                t_comm = (time.perf_counter() - t0) / a.steps
                cpu_comm = (time.process_time() - cpu0) / a.steps
                s, lo, c = slowest(t_step), slowest(t_local), slowest(t_comm)
                results[v]["step"].append(s)
                results[v]["exposed"].append(s - lo)
                results[v]["comm"].append(c)
                results[v]["comm_cpu"].append(mean(cpu_comm))
            except Exception as e:  # the same failure on every rank (bf16 on Gloo): reported, not fatal
                failed[v] = str(e).splitlines()[0][:160]
                models.pop(v, None)
                dist.barrier()
    if rank != 0:
        return None
    rows = []
    for v in variants:
        if v in failed:
            rows.append({"variant": v, "failed": failed[v]})
            continue
        r = {k: sum(vals) / len(vals) for k, vals in results[v].items()}
        rows.append({"variant": v, "step_ms": r["step"], "exposed_ms": r["exposed"], "comm_ms": r["comm"],
                     "comm_cpu_ms": r["comm_cpu"]})
    base = {row["variant"]: row.get("comm_ms") for row in rows}
    meta = {"bench": "torch_ddp", "model": a.model, "params": params, "world": world, "batch": a.batch,
            "buckets": len(sizes), "bucket_elems": sizes, "topology": a.topology, "segment_bytes": a.segment_bytes, "steps": a.steps,
            "rounds": a.rounds, "torch": torch.__version__, "threads": a.threads, "label": a.label}
    for row in rows:
        if "comm_ms" in row:
            row["comm_vs_gloo"] = row["comm_ms"] / base["gloo"]
            if base.get("fp16_hook"):
                row["comm_vs_fp16_hook"] = row["comm_ms"] / base["fp16_hook"]
    if a.json:
        for row in rows:
            print(json.dumps({**meta, **row}))
    else:
        print(f"{a.model}: {params / 1e6:.2f} M parameters in {len(sizes)} buckets, {world} ranks, batch {a.batch}, "
              f"lockstep topology {a.topology}, {a.steps} steps x {a.rounds} rounds{', ' + a.label if a.label else ''}")
        print(f"{'variant':<18}{'step ms':>10}{'exposed ms':>12}{'comm ms':>10}{'comm/gloo':>11}{'comm/fp16':>11}"
              f"{'comm cpu ms':>13}")
        for row in rows:
            if "failed" in row:
                print(f"{row['variant']:<18}  failed: {row['failed']}")
                continue
            print(f"{row['variant']:<18}{row['step_ms']:>10.1f}{row['exposed_ms']:>12.1f}{row['comm_ms']:>10.1f}"
                  f"{row['comm_vs_gloo']:>11.3f}{row.get('comm_vs_fp16_hook', float('nan')):>11.3f}"
                  f"{row['comm_cpu_ms']:>13.1f}")
    sys.stdout.flush()
    return rows


def spawned(rank, world, folder, a):
    rank_main(rank, world, f"file://{folder}/store", a)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "fashion_cnn"])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--init", default="")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--codecs", default="fp32,bf16,int8,dyntree8")
    ap.add_argument("--topology", default="torus2d")
    ap.add_argument("--segment-bytes", type=int, default=0, help="lockstep's pipelining unit (0: 1 MiB)")
    ap.add_argument("--label", default="", help="recorded on every JSON line (netlab passes its link rate)")
    ap.add_argument("--build", default="")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rank >= 0:
        rank_main(a.rank, a.world, a.init, a)
        return
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="torch_ddp_") as folder:
        mp.spawn(spawned, args=(a.world, folder, a), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
