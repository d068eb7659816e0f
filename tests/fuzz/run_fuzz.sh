#!/bin/sh
# tests/fuzz/run_fuzz.sh: one fuzz target as a Meson test (suite 'fuzz').
#
#   run_fuzz.sh TARGET CORPUS ARTIFACTS   replays every input in CORPUS, then fuzzes from it for
#                                         $LOCKSTEP_FUZZ_SECONDS seconds (default 5; 0: replay only);
#                                         a failing input is kept in ARTIFACTS
#   run_fuzz.sh --skip REASON             reports the test skipped (exit 77)
#
# New inputs go to a scratch folder, never into the committed corpus. Fails when the target
# crashes, hangs (10 s on one input), exceeds 2 GiB, trips a sanitizer, or did not run at all.
if [ "$1" = "--skip" ]; then
  echo "skipped: $2"
  exit 77
fi
target=$1 corpus=$2 artifacts=$3
seconds=${LOCKSTEP_FUZZ_SECONDS:-5}
case $seconds in '' | *[!0-9]*) echo "LOCKSTEP_FUZZ_SECONDS=$seconds is not a whole number of seconds"; exit 1 ;; esac
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$artifacts" || exit 1
flags="-timeout=10 -rss_limit_mb=2048 -artifact_prefix=$artifacts/ -print_final_stats=1"

# shellcheck disable=SC2086
"$target" -runs=0 $flags "$corpus" > "$work/replay.log" 2>&1
rc=$?
tail -n 3 "$work/replay.log"
[ $rc -eq 0 ] || { cat "$work/replay.log"; echo "a committed input fails (rc $rc)"; exit 1; }
grep -q "INITED" "$work/replay.log" || { echo "the replay ran no input"; exit 1; }
[ "$seconds" -gt 0 ] || exit 0

# shellcheck disable=SC2086
timeout $((seconds + 120)) "$target" -max_total_time="$seconds" $flags "$work/corpus" "$corpus" > "$work/fuzz.log" 2>&1
rc=$?
grep -E "^Done|stat::number_of_executed_units" "$work/fuzz.log"
if [ $rc -ne 0 ]; then
  tail -n 60 "$work/fuzz.log"
  echo "fuzzing failed (rc $rc); the input is in $artifacts"
  exit 1
fi
runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$work/fuzz.log")
[ "${runs:-0}" -gt 0 ] || { echo "libFuzzer reported no runs"; exit 1; }
