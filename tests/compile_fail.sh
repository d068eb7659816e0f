#!/bin/sh
# Must-not-compile check: compile_fail.sh EXPECTED SOURCE COMPILER [ARGS...]
# Passes when the compiler rejects SOURCE and its messages contain EXPECTED.
expected=$1
src=$2
shift 2
if out=$("$@" -fsyntax-only "$src" 2>&1); then
  echo "$src compiled, but must not"
  exit 1
fi
if ! printf '%s\n' "$out" | grep -qF -- "$expected"; then
  printf '%s\n' "$out" | head -40
  echo "the compiler's messages lack: $expected"
  exit 1
fi
echo "rejected with: $expected"
