#!/usr/bin/python3
"""tests/resnet_torch_ref.py: the PyTorch reference of tests/test_resnet_torch.cpp.

  resnet_torch_ref.py net DIR     torchvision.models.resnet50(num_classes) in float64, train mode
  resnet_torch_ref.py block DIR   torchvision.models.resnet.Bottleneck in float64, train mode

DIR holds what the test wrote: config.txt (key=value lines), names.txt (the sample's tensor names
in layout order), params.f32 (the flat parameter block), running.f32 (running mean then var of each
batch norm, layout order), input.f32 (N, C, H, W) and labels.i32 (net) or r.f32 (block: the loss is
sum(out * r), r NCHW). The parameters are loaded into the torch module in named_parameters() order
after checking that the names agree. Writes out.f32 (logits, or the block's output, NCHW),
loss.f64, grads.f32 (the gradient block in the sample's layout), dinput.f32 (block: NCHW) and
running_after.f32. Exit status 77: torch or torchvision missing.
"""
import os
import sys

import numpy as np

try:
    import torch
    import torchvision
except ImportError:
    sys.exit(77)


def main():
    mode, d = sys.argv[1], sys.argv[2]
    cfg = dict(line.strip().split("=", 1) for line in open(os.path.join(d, "config.txt")) if "=" in line)
    names = [n.strip() for n in open(os.path.join(d, "names.txt")) if n.strip()]
    torch.manual_seed(0)
    if mode == "net":
        m = torchvision.models.resnet50(num_classes=int(cfg["classes"]))
    else:
        inp, planes, stride = int(cfg["cin"]), int(cfg["width"]), int(cfg["stride"])
        down = None
        if int(cfg["down"]):
            down = torch.nn.Sequential(torch.nn.Conv2d(inp, planes * 4, 1, stride, bias=False),
                                       torch.nn.BatchNorm2d(planes * 4))
        m = torchvision.models.resnet.Bottleneck(inp, planes, stride, down)
    m = m.double().train()
    params = np.fromfile(os.path.join(d, "params.f32"), dtype=np.float32)
    running = np.fromfile(os.path.join(d, "running.f32"), dtype=np.float32)
    tnames = [n for n, _ in m.named_parameters()]
    if tnames != names:
        print("tensor names differ:", [(a, b) for a, b in zip(tnames, names) if a != b][:5], len(tnames), len(names))
        sys.exit(1)
    off = 0
    with torch.no_grad():
        for _, p in m.named_parameters():
            n = p.numel()
            p.copy_(torch.from_numpy(params[off:off + n].astype(np.float64)).view_as(p))
            off += n
        assert off == params.size, (off, params.size)
        roff = 0
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                k = mod.num_features
                mod.running_mean.copy_(torch.from_numpy(running[roff:roff + k].astype(np.float64)))
                mod.running_var.copy_(torch.from_numpy(running[roff + k:roff + 2 * k].astype(np.float64)))
                roff += 2 * k
        assert roff == running.size, (roff, running.size)
    shape = [int(v) for v in cfg["input_shape"].split(",")]
    x = torch.from_numpy(np.fromfile(os.path.join(d, "input.f32"), dtype=np.float32).reshape(shape).astype(np.float64))
    x.requires_grad_(mode == "block")
    out = m(x)
    if mode == "net":
        labels = torch.from_numpy(np.fromfile(os.path.join(d, "labels.i32"), dtype=np.int32).astype(np.int64))
        loss = torch.nn.functional.cross_entropy(out, labels, label_smoothing=float(cfg["smoothing"]))
    else:
        r = torch.from_numpy(np.fromfile(os.path.join(d, "r.f32"), dtype=np.float32).reshape(out.shape).astype(np.float64))
        loss = (out * r).sum()
    loss.backward()
    out.detach().numpy().astype(np.float32).tofile(os.path.join(d, "out.f32"))
    np.array([loss.item()], dtype=np.float64).tofile(os.path.join(d, "loss.f64"))
    np.concatenate([p.grad.numpy().ravel() for _, p in m.named_parameters()]).astype(np.float32).tofile(
        os.path.join(d, "grads.f32"))
    if mode == "block":
        x.grad.numpy().astype(np.float32).tofile(os.path.join(d, "dinput.f32"))
    run = []
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            run += [mod.running_mean.numpy(), mod.running_var.numpy()]
    np.concatenate(run).astype(np.float32).tofile(os.path.join(d, "running_after.f32"))


if __name__ == "__main__":
    main()
