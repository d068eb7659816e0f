#!/usr/bin/env bash
# Compiles every public header on its own, once with the host compiler and once with nvcc, so that
# no header leans on an include it does not make itself, and every header works in a .cu file.
#
#   compile_headers.sh INCLUDE_DIR CXX NVCC [NVCC_ARCH]
#
# Under nvcc, headers that define kernels (device/, and the two device transports) are compiled to
# device code; the rest go through nvcc's front end only (-cuda).
# Headers that define kernels (they include lockstep/device/config.hpp) must not compile under the
# host compiler: there they must stop with lockstep's own "compile it with nvcc" sentence, which
# this script checks. The MPI transports (mpi.hpp, mpi_p2p.hpp, routed.hpp) are compiled with the flags `mpicxx --showme:compile` prints
# (skipped under a compiler when that fails). Exit 0 when everything behaved, 1 otherwise.
set -u
inc=$1 cxx=$2 nvcc=$3 arch=${4:-80}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cuda_inc=$(dirname "$(dirname "$(command -v "$nvcc")")")/include
mpi_flags=$(mpicxx --showme:compile 2>/dev/null || true)
export inc cxx nvcc arch work cuda_inc mpi_flags

# One header, both compilers; prints its lines, exits 1 on a failure. Its own files: the headers
# run two at a time (the machine's two cores; the test took 337 s one at a time).
check_one() {
  local h=$1 n=$2 extra="" out mode fail=0
  case $h in lockstep/transport/mpi.hpp|lockstep/transport/mpi_p2p.hpp|lockstep/transport/routed.hpp) [ -n "$mpi_flags" ] || { echo "skip  $h (no mpicxx)"; return 0; }; extra=$mpi_flags ;; esac
  printf '#include <%s>\n#include <%s>\n' "$h" "$h" > "$work/$n.cpp"   # twice: include guards work
  cp "$work/$n.cpp" "$work/$n.cu"

  if out=$("$cxx" -std=c++20 -fsyntax-only -Wall -Wextra -I"$inc" -I"$cuda_inc" $extra "$work/$n.cpp" 2>&1); then
    echo "ok    g++   $h"
  elif grep -q "compile it with nvcc" <<<"$out"; then
    echo "ok    g++   $h (refuses: needs nvcc, as it should)"
  else
    echo "FAIL  g++   $h"; echo "$out" | head -20; fail=1
  fi

  # Headers with kernels are compiled through to device code; the others only through nvcc's front
  # end (-cuda: parsing and host/device checks, about half the time), since g++ above already
  # compiled their host side. 49 headers took 18 min of full nvcc compiles on 2 busy cores.
  case $h in lockstep/device/*|lockstep/transport/inproc_device.hpp|lockstep/transport/nccl.hpp) mode="-c" ;; *) mode="-cuda" ;; esac
  if out=$("$nvcc" -std=c++20 --expt-relaxed-constexpr -arch=sm_$arch -I"$inc" $extra $mode "$work/$n.cu" -o "$work/$n.o" 2>&1); then
    echo "ok    nvcc  $h"
  else
    echo "FAIL  nvcc  $h"; echo "$out" | head -20; fail=1
  fi
  return $fail
}
export -f check_one

cd "$inc" || exit 1
headers=$(find lockstep -name '*.hpp' | sort)
count=$(wc -l <<<"$headers")
# Each header's lines go to a file of their own and are printed in order afterwards.
n=0
for h in $headers; do n=$((n + 1)); echo "$n $h"; done |
  xargs -P "${JOBS:-2}" -L 1 bash -c 'check_one "$2" "$1" > "$work/$1.log" 2>&1 || touch "$work/$1.failed"' _
fail=0
for i in $(seq 1 "$count"); do
  cat "$work/$i.log"
  [ -e "$work/$i.failed" ] && fail=1
done
echo "$count headers checked"
exit $fail
