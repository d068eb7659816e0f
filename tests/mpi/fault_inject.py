#!/usr/bin/env python3
"""tests/mpi/fault_inject.py: runs fault_inject (4 ranks under mpirun) with one fault and judges it.

  fault_inject.py MPIRUN EXE FAULT SHM [--np 4] [--timeout-ms 1500] [--json]

FAULT is kill, exit, stop, throw, mismatch, throw_rows or throw_cols (the victim throws in one of its
groups split from the whole: the others, waiting in any of theirs, must stop as fast); SHM is 1 (node-local peers through shared memory) or 0
(LOCKSTEP_MPI_SHM=0: everything through MPI). Passes when every rank but the victim stops with the
named error within the stated time, naming the victim, no result was wrong, the survivors' group
without the victim works, and (stop) the victim, continued, finds the group aborted too. Prints one
line per rank and the time to error; --json prints them as one JSON object (docs/reliability.md).

Stated times: 1 s from the fault for kill, exit, throw and mismatch (abort messages, shared-memory
flags, and the node-local peers' processes watched); for stop, the group's timeout plus 1 s (a
stopped process is alive: only the timeout can tell, and its message says the peer is stopped).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time


def main():
    args = sys.argv[1:]
    if len(args) < 4:
        print(__doc__)
        return 2
    mpirun, exe, fault, shm = args[:4]
    np_, timeout_ms, want_json = 4, 1500, False
    rest = args[4:]
    while rest:
        k = rest.pop(0)
        if k == "--np":
            np_ = int(rest.pop(0))
        elif k == "--timeout-ms":
            timeout_ms = int(rest.pop(0))
        elif k == "--json":
            want_json = True
        else:
            print(f"unknown option {k}")
            return 2
    victim = 1
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "--enable-recovery", "-x",
           f"LOCKSTEP_MPI_SHM={shm}", "-np", str(np_), exe, "--fault", fault, "--victim", str(victim),
           "--timeout-ms", str(timeout_ms)]
    started = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, fault_line, errors, regroups = [], None, {}, {}
    lock = threading.Lock()
    continued = [False]

    def read():
        for line in p.stdout:
            line = line.rstrip("\n")
            with lock:
                lines.append(line)
                w = line.split(" ", 5)
                if w[0] == "fault":
                    nonlocal fault_line
                    fault_line = w
                elif w[0] == "error" and len(w) >= 6:
                    errors[int(w[1])] = {"t_ns": int(w[2]), "errc": w[3], "peer": int(w[4].split(" ")[0]),
                                         "what": line.split(" ", 6)[-1]}
                elif w[0] == "regroup":
                    regroups[int(w[1])] = line

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # A stopped victim is continued once every other rank has reported, so that it finds out too.
    deadline = started + 60
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        with lock:
            if fault == "stop" and fault_line and not continued[0] and \
                    len([r for r in errors if r != victim]) == np_ - 1 and len(regroups) == np_ - 1:
                os.kill(int(fault_line[3]), signal.SIGCONT)
                continued[0] = True
    if p.poll() is None:
        p.kill()
        lines.append("fault_inject.py: mpirun still running after 60 s: killed (a hang)")
    p.wait()
    reader.join(timeout=5)

    problems = []
    if not fault_line:
        problems.append("the victim never printed its fault line")
    limit_ms = timeout_ms + 1000 if fault == "stop" else 1000
    want_code = {"stop": ("timeout", "aborted"), "mismatch": ("mismatch_between_ranks", "aborted")}.get(fault, ("aborted",))
    rows = []
    for r in range(np_):
        if r == victim and fault != "stop":
            continue
        e = errors.get(r)
        if not e:
            problems.append(f"rank {r} reported no error")
            continue
        ms = (e["t_ns"] - int(fault_line[2])) / 1e6 if fault_line else float("nan")
        rows.append({"rank": r, "errc": e["errc"], "peer": e["peer"], "ms": round(ms, 1), "what": e["what"]})
        if r == victim:  # the stopped victim, continued: the group it left is aborted
            if e["errc"] != "aborted":
                problems.append(f"victim {r}, continued, got {e['errc']} instead of aborted")
            continue
        if e["errc"] not in want_code:
            problems.append(f"rank {r}: {e['errc']}, expected {' or '.join(want_code)}")
        if not (ms <= limit_ms):
            problems.append(f"rank {r}: error {ms:.0f} ms after the fault, limit {limit_ms} ms")
        named = e["peer"] == victim or f"rank {victim} " in e["what"] or f"(peer {victim})" in e["what"]
        if not named:
            problems.append(f"rank {r}: the error does not name rank {victim}: {e['what']}")
        if fault == "stop" and "stopped" not in e["what"]:
            problems.append(f"rank {r}: a stalled peer's error does not say it is stopped: {e['what']}")
        if fault.startswith("throw") and "injected fault" not in e["what"]:
            problems.append(f"rank {r}: the victim's message is not in the error: {e['what']}")
        if r not in regroups or not regroups[r].endswith("ok"):
            problems.append(f"rank {r}: the group without rank {victim} did not work ({regroups.get(r)})")
    for line in lines:
        if line.startswith("wrong ") or line.startswith("done "):
            problems.append(f"unexpected: {line}")
    took = time.monotonic() - started

    if want_json:
        print(json.dumps({"fault": fault, "shm": shm, "np": np_, "timeout_ms": timeout_ms, "ranks": rows,
                          "seconds": round(took, 2), "ok": not problems, "problems": problems}))
    else:
        print(f"fault {fault}, LOCKSTEP_MPI_SHM={shm}, {np_} ranks, victim rank {victim}, group timeout {timeout_ms} ms")
        for row in rows:
            print(f"  rank {row['rank']}: {row['errc']:9s} peer {row['peer']:2d}  {row['ms']:8.1f} ms after the fault  {row['what']}")
        print(f"  whole run {took:.1f} s")
        if problems:
            print("output:")
            for line in lines:
                print("  | " + line)
            for pr in problems:
                print("FAIL: " + pr)
        else:
            print("ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
