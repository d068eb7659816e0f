#!/usr/bin/python3
# Debian's interpreter on purpose: python3-torch, python3-torchvision and python3-pil are installed
# for it, not for a python3 that a version manager may put first on PATH.
"""torchvision peer of lockstep-bench-input-pipeline: ImageNet-style training input with PIL.

ImageFolder(DIR/train) + RandomResizedCrop(size) + RandomHorizontalFlip() + ToTensor() +
Normalize(ImageNet mean, std), batched by a DataLoader (batch, shuffle, drop_last, num_workers=0:
decoding in this process), torch limited to one thread and the process to one core (--cpu). Times
--batches batches after one warm-up batch, --rounds times, and prints one JSON line per round:

    {"peer": "torchvision", "images": N, "seconds": S, "images_per_s": R, "cpu_seconds": C,
     "images_per_cpu_s": N / C, ...versions}

images_per_cpu_s counts the process's CPU time (user + system, time.process_time), which a busy
neighbour on a shared core inflates far less than the wall time.

Run by hand:  /usr/bin/python3 bench/input_pipeline_torch.py --dir /tmp/fashion-jpeg --batches 8
"""
import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="ImageNet-layout folder (its train/ split is read)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=16, help="timed batches per round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=-1, help="pin to this core (-1: leave the affinity alone)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.cpu >= 0:
        os.sched_setaffinity(0, {a.cpu})
    try:
        import PIL
        import torch
        import torchvision
        from torchvision import datasets, transforms
    except ImportError as e:
        print(json.dumps({"peer": "torchvision", "error": "%s cannot import torch/torchvision/PIL: %s" % (sys.executable, e)}),
              flush=True)
        return 3
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    tf = transforms.Compose([
        transforms.RandomResizedCrop(a.size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(os.path.join(a.dir, "train"), transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=0, drop_last=True)
    if len(loader) < a.batches + 1:
        print(json.dumps({"peer": "torchvision", "error": "%d images give %d batches of %d; need %d" %
                          (len(ds), len(loader), a.batch, a.batches + 1)}), flush=True)
        return 2
    for _ in range(a.rounds):
        it = iter(loader)
        images, labels = next(it)  # warm-up: first file reads, allocator
        assert images.shape == (a.batch, 3, a.size, a.size) and images.dtype == torch.float32
        t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        for _ in range(a.batches):
            images, labels = next(it)
            n += images.shape[0]
        s, c = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"peer": "torchvision", "images": n, "seconds": s, "images_per_s": n / s,
                          "cpu_seconds": c, "images_per_cpu_s": n / c,
                          "torch": torch.__version__, "torchvision": torchvision.__version__, "pil": PIL.__version__,
                          "threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
