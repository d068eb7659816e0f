#!/usr/bin/python3
"""samples/torch_ddp/train_ddp.py: Fashion-MNIST with PyTorch DDP, gradients all-reduced by
lockstep's compressed all-reduce through a DDP communication hook. Copy it; the three lines that
matter are marked "lockstep".

Purpose: show a PyTorch user what lockstep_torch changes in a DDP script (nothing but the hook),
and compare the hook with DDP's default all-reduce on the same seed, data and epochs.
Limits: CPU and Gloo only (the hook reduces float32 CPU buckets); the network is the sample
trainer's small CNN (samples/fashion_cnn: 3 x conv3x3-BN-ReLU-maxpool, then a linear classifier);
no augmentation; BatchNorm normalises with each rank's own batch statistics (no SyncBatchNorm),
and its running statistics are rank 0's (DDP broadcasts the buffers every forward).

Run (4 ranks as local processes, or under torchrun, which sets RANK and WORLD_SIZE):
    PYTHONPATH=build/python samples/torch_ddp/train_ddp.py --world 4 --epochs 1
    PYTHONPATH=build/python samples/torch_ddp/train_ddp.py --world 4 --hook default     # the peer
    PYTHONPATH=build/python torchrun --standalone --nproc_per_node 4 samples/torch_ddp/train_ddp.py
Debian's torchrun (torch 1.13 under Python 3.11) stops in its option parsing; lockstep_torch.run
is torchrun with that fixed (docs/torch.md), the same options:
    PYTHONPATH=build/python /usr/bin/python3 -m lockstep_torch.run --standalone --nproc_per_node 4 \
        samples/torch_ddp/train_ddp.py
Options: --codec fp32|bf16|int8|dyntree8 (dyntree8), --topology ring|torus2d (torus2d),
--no-error-feedback, --data DIR (/usr/share/datasets/fashion-mnist), --images N (all 60000),
--batch B per rank (64), --lr (0.01), --schedule cosine|constant (cosine), --seed, --json.
Prints per epoch: mean training loss and test accuracy (rank 0).

Shapes (B = per-rank batch):
    x       (B, 1, 28, 28)   images, normalised by the training set's mean and deviation
    conv1   (B, 32, 14, 14)  after conv3x3 + BN + ReLU + maxpool 2x2 (ceil mode)
    conv2   (B, 64, 7, 7)
    conv3   (B, 128, 4, 4)
    logits  (B, 10)
"""
import argparse
import gzip
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    """An IDX file (gzip) as a numpy array: images (N, 28, 28) or labels (N,), uint8."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(folder, split, limit):
    """(x, y): x float32 (N, 1, 28, 28) normalised, y int64 (N,)."""
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte.gz"))
    if limit:
        x, y = x[:limit], y[:limit]
    x = (x.astype(np.float32) / 255.0 - 0.2860) / 0.3530
    return torch.from_numpy(x[:, None].copy()), torch.from_numpy(y.astype(np.int64))


def conv_block(cin, cout):
    """conv3x3 (no bias) -> BatchNorm -> ReLU -> maxpool 2x2, ceil mode: (B,cin,H,W) -> (B,cout,H/2,W/2)."""
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2, ceil_mode=True)]


def make_model(seed):
    """The sample trainer's CNN; the same initial weights on every rank (seeded)."""
    torch.manual_seed(seed)
    return nn.Sequential(*conv_block(1, 32), *conv_block(32, 64), *conv_block(64, 128), nn.Flatten(),
                         nn.Linear(128 * 16, 10))


def evaluate(model, x, y):
    """Top-1 accuracy in percent over (x, y), in batches of 1000."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            correct += (model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item()
    model.train()
    return 100.0 * correct / len(x)


def train(rank, world, a):
    torch.set_num_threads(a.threads)
    x, y = load(a.data, "train", a.images)
    xt, yt = load(a.data, "test", 0)
    model = DDP(make_model(a.seed))
    if a.hook == "lockstep":
        import lockstep_torch                                                   # lockstep
        state = lockstep_torch.State(codec=a.codec, topology=a.topology,        # lockstep
                                     error_feedback=not a.no_error_feedback)
        model.register_comm_hook(state, lockstep_torch.allreduce_hook)          # lockstep
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    # Every rank draws the same permutation and takes its own slice of each global batch.
    g = torch.Generator().manual_seed(a.seed)
    steps = len(x) // (a.batch * world)
    if steps == 0:
        raise SystemExit(f"train_ddp.py: {len(x)} training images make no global batch of --batch {a.batch} x "
                         f"{world} ranks: use more images (--images) or a smaller --batch")
    # --schedule cosine: the rate falls from --lr to 0 over the whole run, step by step.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * steps) if a.schedule == "cosine" else None
    history = []
    for epoch in range(a.epochs):
        perm = torch.randperm(len(x), generator=g)
        total, t0 = 0.0, time.perf_counter()
        for s in range(steps):
            idx = perm[(s * world + rank) * a.batch:(s * world + rank + 1) * a.batch]
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched:
                sched.step()
            total += loss.item()
        acc = evaluate(model.module, xt, yt)
        row = {"epoch": epoch + 1, "loss": total / steps, "test_accuracy": acc, "seconds": time.perf_counter() - t0,
               "hook": a.hook, "codec": a.codec if a.hook == "lockstep" else "fp32", "world": world}
        history.append(row)
        if rank == 0:
            print(json.dumps(row) if a.json else
                  f"epoch {row['epoch']}: loss {row['loss']:.4f}, test accuracy {acc:.2f} %, {row['seconds']:.0f} s",
                  flush=True)
    return history


def spawned(rank, world, folder, a):
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    train(rank, world, a)
    dist.destroy_process_group()  # its Gloo threads joined now, not while the interpreter exits


def main():
    ap = argparse.ArgumentParser(description="Fashion-MNIST DDP with lockstep's all-reduce hook")
    ap.add_argument("--world", type=int, default=4, help="ranks to spawn here (ignored under torchrun)")
    ap.add_argument("--hook", choices=["lockstep", "default"], default="lockstep")
    ap.add_argument("--codec", default="dyntree8")
    ap.add_argument("--topology", default="torus2d")
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--data", default=DATA, help="folder of the four Fashion-MNIST .gz files (IDX format)")
    ap.add_argument("--images", type=int, default=0, help="first N training images (0: all)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="cosine", help="learning rate over the run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    for name in ("world", "epochs", "batch", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(a, name)}")
    if a.images < 0:
        ap.error(f"--images must be 0 (all) or more, not {a.images}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), a)
        dist.destroy_process_group()
        return
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="train_ddp_") as folder:
        mp.spawn(spawned, args=(a.world, folder, a), nprocs=a.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
