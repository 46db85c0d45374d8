"""`flowrl fuse-schedule` on RLHFuse's experiment shapes: makespan / lower bound for large-model PP 8 or 16, small
model PP half or equal, 8-64 micro-batches each, small-model forward 0.5x or 1x the large one's per stage.

    python bench/fuse_schedule_sweep.py
"""

from __future__ import annotations

import time

from flowrl.planner.fuse_schedule import Problem, solve

print("| A | B | M0 = M1 | F1 / F0 | one list schedule (backwards first) / LB | solved / LB | seconds |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for a, b in [(8, 4), (8, 8), (16, 8), (16, 16)]:
    for m in (8, 16, 32, 64):
        for f1 in (0.5, 1.0):
            p = Problem(a, b, (m, m), (1.0, f1))
            t = time.perf_counter()
            plain = solve(p, seed=0, iters=0, restarts=0, memory=False)
            s = solve(p, seed=0, memory=False)
            print(f"| {a} | {b} | {m} | {f1} | {plain.makespan / plain.lower_bound:.3f} | "
                  f"{s.makespan / s.lower_bound:.3f} | {time.perf_counter() - t:.1f} |", flush=True)
