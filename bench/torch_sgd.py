#!/usr/bin/python3
"""torch.optim.SGD(foreach=True) peer for lockstep-bench-optim, driven over stdin/stdout.

lockstep-bench-optim starts this script, sends the tensor sizes, then asks for one timed step at a
time, interleaved with its own measurements, so that a busy neighbour on a shared machine slows
both sides alike. Protocol (one line each):

    <- sizes N1 N2 ...        the parameter tensors (1-D; an elementwise update ignores shape)
    -> ready TORCH_VERSION THREADS
    <- step                   one optimizer.step(), timed
    -> time_us T
    <- quit

Run by hand:  printf 'sizes 1000 2000\\nstep\\nquit\\n' | python3 bench/torch_sgd.py --threads 2
"""
import argparse
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print("error torch not importable by %s: %s" % (sys.executable, e), flush=True)
        return 3
    torch.set_num_threads(args.threads)
    line = sys.stdin.readline().split()
    if not line or line[0] != "sizes":
        print("error expected 'sizes ...'", flush=True)
        return 2
    sizes = [int(x) for x in line[1:]]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 0.01
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                          foreach=True)
    opt.step()  # allocates the momentum buffers outside the timed steps
    print("ready %s %d" % (torch.__version__, torch.get_num_threads()), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            print("time_us %.1f" % ((t1 - t0) * 1e6), flush=True)
        elif cmd == "quit" or cmd == "":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
