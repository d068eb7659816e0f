#!/usr/bin/env bash
# tests/sample_cli.sh TRAINER [MPIRUN]: lockstep-train-fashion's answers to bad input (found by a
# review): non-finite and fractional numbers and malformed torus shapes are flag errors (status 2,
# a sentence naming the flag), and under mpirun a rank that fails before any collective (here its
# data folder is missing) stops the whole job at once, every rank saying why, instead of leaving the
# others in the flag check with nothing printed.
set -u
trainer=$1
mpirun=${2:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

expect_flag_error() {  # WORDS ARGS...: status 2 and WORDS on stderr
  local words=$1; shift
  timeout 120 "$trainer" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -qF -- "$words" "$tmp/err"; then
    echo "FAIL: $* -> status $rc, wanted 2 and '$words'"; cat "$tmp/err"; failed=1
  else
    echo "ok: $* -> $(head -1 "$tmp/err")"
  fi
}
small=(--epochs 1 --train-limit 128 --test-limit 64 --batch 64 --out "$tmp/o")
expect_flag_error "is not a finite number" --lr nan "${small[@]}"
expect_flag_error "is not a finite number" --momentum inf "${small[@]}"
expect_flag_error "is not a whole number" --batch 64.7 --epochs 1
expect_flag_error "is not a whole number" --batch 1e12 --epochs 1
expect_flag_error "is not a whole number" --seed -1 --epochs 1
for t in torus2d:foo torus2d:2x2junk torus2dxyz torus2d:0x0; do
  expect_flag_error "--topology must be ring, torus2d or torus2d:RxC" --ranks 2 --topology "$t" "${small[@]}"
done

data=/usr/share/datasets/fashion-mnist
if [[ -n $mpirun && -f $data/train-images-idx3-ubyte.gz ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  start=$(date +%s)
  timeout 120 "$mpirun" --oversubscribe --mca mpi_yield_when_idle 1 \
    -np 1 "$trainer" --data "$data" "${small[@]}" : \
    -np 1 "$trainer" --data "$tmp/no-such-folder" "${small[@]}" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  took=$(( $(date +%s) - start ))
  if [[ $rc -eq 0 || $rc -eq 124 ]] || ! grep -qF "rank 1: " "$tmp/err" || ! grep -qF "no-such-folder" "$tmp/err" ||
     ! grep -qi "abort" "$tmp/err"; then
    echo "FAIL: mpirun with rank 1's data missing -> status $rc after ${took} s"; cat "$tmp/err"; failed=1
  else
    echo "ok: mpirun with rank 1's data missing -> status $rc after ${took} s:"; grep -F "lockstep-train-fashion" "$tmp/err"
  fi
else
  echo "(mpirun or $data absent: the mpirun case is not run)"
fi
exit $failed
