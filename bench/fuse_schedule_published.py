"""`flowrl fuse-schedule` on the 12 experiment instances RLHFuse published with its solver (FlexFusion's
get-lower-bound.py: pipeline stages, micro-batches, forward time and activation memory per micro-batch of each
model; seed_papers.md §2.4), both phases (makespan, then peak memory at that makespan).

    python bench/fuse_schedule_published.py
"""

from __future__ import annotations

import time

from flowrl.planner.fuse_schedule import Problem, solve

# (pp0, pp1, m0, m1, f0, f1, mem0, mem1), as published: three micro-batch counts per pipeline pair
INSTANCES = [(8, 4, m, m // 2, 5, 4, 1.95, 2) for m in (32, 16, 8)] + \
    [(8, 8, m, m, 5, 2, 1.95, 1) for m in (32, 16, 8)] + \
    [(16, 8, m, m // 2, 2, 2, 1.64, 2) for m in (64, 32, 16)] + \
    [(16, 16, m, m, 2, 1, 1.64, 1) for m in (64, 32, 16)]

print("| A | B | M0 | M1 | F0 | F1 | solved / lower bound | peak memory (max over nodes) | seconds |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for a, b, m0, m1, f0, f1, p0, p1 in INSTANCES:
    t = time.perf_counter()
    s = solve(Problem(a, b, (m0, m1), (f0, f1), (p0, p1)), seed=0)
    print(f"| {a} | {b} | {m0} | {m1} | {f0} | {f1} | {s.makespan / s.lower_bound:.3f} | {max(s.peak_memory):.2f} | "
          f"{time.perf_counter() - t:.1f} |", flush=True)
