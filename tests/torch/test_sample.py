"""tests/torch/test_sample.py: runs the sample a PyTorch user copies, samples/torch_ddp/train_ddp.py,
on 2 processes with lockstep's hook (dyntree8, error feedback, torus2d), as a user would: once as
local processes (--world 2) and once under lockstep_torch.run (torchrun with its Python 3.11 fix,
--standalone --nproc_per_node 2).

Data: a synthetic Fashion-MNIST in the same IDX files (written here, so the test needs no data
set): class c is a horizontal (c even) or vertical (c odd) bar at offset 4 + 4*(c // 2) over
noise; 512 training images, 256 test images; batch 32 per rank, so 8 steps an epoch, 3 epochs.
Checks, each run:
  no error, 3 epoch rows from rank 0, each naming the lockstep hook and dyntree8;
  it trains: the mean training loss of epoch 3 below 0.8 x epoch 1's (label smoothing 0.1 keeps it
      above ~0.5) and the test accuracy after epoch 3 above 50 % (chance: 10 %);
and the two launches train the same run: their rows' losses and accuracies equal (the hook's
result does not depend on how the ranks were started).
"""
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile

from harness import skip_without_torch

here = os.path.dirname(os.path.abspath(__file__))
sample = os.path.join(os.path.dirname(os.path.dirname(here)), "samples", "torch_ddp", "train_ddp.py")
EPOCHS = 3


def write_idx(path, magic, dims, payload):
    head = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(head + payload)


def write_synthetic(folder, prefix, n, seed):
    g = random.Random(seed)
    images, labels = bytearray(), bytearray()
    for _ in range(n):
        c = g.randrange(10)
        at = 4 + 4 * (c // 2)
        for y in range(28):
            for x in range(28):
                bar = (at <= y < at + 3) if c % 2 == 0 else (at <= x < at + 3)
                images.append(min(255, g.randrange(61) + (180 if bar else 0)))
        labels.append(c)
    write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"), 0x803, [n, 28, 28], bytes(images))
    write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte.gz"), 0x801, [n], bytes(labels))


def run(launch, data):
    args = [sample, "--data", data, "--images", "512", "--batch", "32", "--epochs", str(EPOCHS), "--lr", "0.05",
            "--json"]
    cmd = [sys.executable] + (["-m", "lockstep_torch.run", "--standalone", "--nproc_per_node", "2"] + args
                              if launch == "lockstep_torch.run" else args + ["--world", "2"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    if p.returncode != 0:
        raise AssertionError(f"{launch}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == EPOCHS, f"{launch}: {len(rows)} epoch rows, expected {EPOCHS}:\n{p.stdout}\n{p.stderr[-2000:]}"
    for r in rows:
        assert r["hook"] == "lockstep" and r["codec"] == "dyntree8" and r["world"] == 2, f"{launch}: row {r}"
    first, last = rows[0], rows[-1]
    assert last["loss"] < 0.8 * first["loss"], f"{launch}: loss {first['loss']:.4f} -> {last['loss']:.4f}, did not fall"
    assert last["test_accuracy"] > 50.0, f"{launch}: test accuracy {last['test_accuracy']:.2f} % after {EPOCHS} epochs"
    return rows


def main():
    skip_without_torch()
    with tempfile.TemporaryDirectory(prefix="lockstep_sample_") as data:
        write_synthetic(data, "train", 512, 1)
        write_synthetic(data, "t10k", 256, 2)
        spawned = run("--world 2", data)
        launched = run("lockstep_torch.run", data)
    for a, b in zip(spawned, launched):
        assert (a["loss"], a["test_accuracy"]) == (b["loss"], b["test_accuracy"]), \
            f"epoch {a['epoch']}: local processes {a['loss']}, {a['test_accuracy']} %; lockstep_torch.run " \
            f"{b['loss']}, {b['test_accuracy']} %"
    print("train_ddp.py on 2 ranks, lockstep dyntree8 + ef: loss " +
          " -> ".join(f"{r['loss']:.4f}" for r in spawned) + f", test accuracy {spawned[-1]['test_accuracy']:.2f} %;"
          " the same under lockstep_torch.run")


if __name__ == "__main__":
    main()
