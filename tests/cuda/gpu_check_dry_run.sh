#!/usr/bin/env bash
# scripts/gpu-check --dry-run as a test (suite gpu-check): fills a carried folder the way
# scripts/gpu-carry fills .gpu-carry for the device call, then configures a fresh build the way the
# lent GPU machine would (carried Catch2 and zlib, NCCL/cuDNN found as there), runs ninja -n, every
# compile command with -M and a load of every linked library, and lists lockstep_torch's torch_cuda
# test. No .cu is compiled: ~15 s here.
#
#   gpu_check_dry_run.sh SOURCE_ROOT WORK_DIR
set -u
root=$1 work=$2
rm -rf "$work"
mkdir -p "$work"
if ! "$root/scripts/gpu-carry" --no-install "$work/carry" > "$work/carry.log" 2>&1; then
  cat "$work/carry.log"
  exit 1
fi
# lockstep_torch's step wants a python3 with torch, as the lent machine's pip one: Debian's here
# (/usr/bin/python3; the PATH's python3 may be another). Without one the step is left out.
steps=tests,bench,train,resnet
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  export LOCKSTEP_PYTHON=/usr/bin/python3
  steps+=,torch
fi
exec "$root/scripts/gpu-check" --dry-run --steps "$steps" --carry "$work/carry" --build "$work/build" "$work/out"
