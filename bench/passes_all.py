"""Every pass benchmark, several runs, into bench/RESULTS_passes.md (and bench/out/passes.json).

    .venv/bin/python bench/passes_all.py --runs 3 --steps 6

A run is each benchmark once (fresh processes and models, one warm-up step, `--steps` measured steps in
lockstep); the table gives, per configuration, the median over runs of each run's median ratio and the
range over all measured steps of all runs. Before each run it waits (up to --wait seconds) for the 1-minute
load average to drop under --load, because the machine is shared; the load seen is recorded with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import interference
import passes_fuse_gen
import passes_fuse_train
import passes_share_prefix
import torch
from passes_common import ROOT

BENCHES = {"share-prefix": passes_share_prefix, "fuse-gen-inference": passes_fuse_gen,
           "fuse-train": passes_fuse_train}
TARGETS = {"share-prefix": "rollout forwards >= 3x", "fuse-gen-inference": "step >= 1.2x with >= 2 workers",
           "fuse-train": "never > 5% slower"}


NOTES = [
    "## What was measured",
    "",
    "- **share-prefix** (`bench/passes_share_prefix.py`): a PPO step with a reward model, GPT-2 shaped models "
    "(4 layers, width 256), 8 random prompts of 65 tokens x n = 8 samples of exactly 16 tokens. Stage = the four "
    "forwards over the rollout (policy and reference log-probs, critic values, reward-model scores). "
    "fuse-gen-inference is off on both sides so that those forwards are separate nodes.",
    "- **fuse-gen-inference** (`bench/passes_fuse_gen.py`): `examples/longtail_grpo.flow` and "
    "`examples/longtail_ppo.flow` (128 samples a step, max_tokens 64, response lengths long-tailed: mean ~15-20 "
    "tokens, a few samples a step at 64; both flows train at lr 1e-5 so that shape holds while measured). Stage = "
    "generation plus the forwards over its rollout. *split, 2 workers*: the examples as written, with "
    "LANGUAGE.md's placement (`actor.generate -> rollout`; `actor.update` and the other models -> `train`), one "
    "rank process per pool (`ProcessBackend(1)`), the new actor weights sent to the rollout pool after each "
    "update; fused, the train pool scores chunks (fed at least every 8 decode steps, chunks that queued while it "
    "was busy taken in one call) while the rollout pool decodes; unfused, each pool idles while the other works. "
    "*colocated (forced)*: the flows without their placement block, where the pass declines; the fused stage is "
    "forced onto the graph as the pass would write it, on 1 and 2 rank processes holding every model (each rank "
    "scores its own chunks between decode steps), to measure why it declines. *split, tail scored as it grows*: "
    "the split stage with `--pass score-tail` against the same fused stage without it.",
    "- Two processes on this machine are not two devices: the host's 2 cores share caches and memory bandwidth, "
    "so a worker that decodes while another computes slows down (`bench/interference.py`, figures below). That "
    "bounds what any overlap can gain here; on separate GPUs the decoding worker keeps its speed.",
    "- **fuse-train** (`bench/passes_fuse_train.py`): longtail_ppo's actor and critic updates, micro_batch 32 "
    "(4 micro-batches each), interleaved on one worker. One CPU worker has no pipeline bubbles to fill, so the "
    "expected ratio is 1.0: this checks the schedule costs nothing.",
    "- Equality: every step of both sides is compared (all tensors of every node and every metric): <= 1e-5 in "
    "step 1 and <= 1e-3 later (AdamW's first steps turn 1e-7 rounding differences in tiny gradients into ~1e-5; "
    "see tests/passes/conftest.py). fuse-train is bit-identical.",
]


def wait_for_quiet(load: float, wait: float) -> float:
    deadline = time.monotonic() + wait
    while os.getloadavg()[0] > load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def table(rows: list[dict[str, Any]]) -> list[str]:
    keys: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        keys.setdefault((r["pass"], r["workload"], r.get("placement", "colocated"), r["workers"]), []).append(r)
    out = ["| pass | workload | placement | workers | stage off -> on (s) | stage x (runs; steps range) "
           "| step off -> on (s) | step x (runs; steps range) | equal (max diff step 1 / later) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (name, workload, placement, workers), rs in keys.items():
        def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(r[k] for r in rs)

        runs_stage = ", ".join(f"{r['stage_x']:.2f}" for r in rs)
        runs_step = ", ".join(f"{r['step_x']:.2f}" for r in rs)
        equal = all(r["equal"] for r in rs)
        out.append(
            f"| {name} | {workload} | {placement} | {workers} | {med('stage_off_s'):.3f} -> {med('stage_on_s'):.3f} "
            f"| **{med('stage_x'):.2f}x** ({runs_stage}; {min(r['stage_x_min'] for r in rs):.2f}.."
            f"{max(r['stage_x_max'] for r in rs):.2f}) | {med('step_off_s'):.3f} -> {med('step_on_s'):.3f} "
            f"| **{med('step_x'):.2f}x** ({runs_step}; {min(r['step_x_min'] for r in rs):.2f}.."
            f"{max(r['step_x_max'] for r in rs):.2f}) | {'yes' if equal else 'NO'} "
            f"({max(r['diff_step1'] for r in rs):.1e} / {max(r['diff_later'] for r in rs):.1e}) |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default=None, help="comma-separated passes to benchmark")
    p.add_argument("--load", type=float, default=1.5, help="wait for the 1-min load average to drop under this")
    p.add_argument("--wait", type=float, default=180.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "RESULTS_passes.md"))
    args = p.parse_args()
    torch.set_num_threads(1)  # one core per worker: the two-worker runs get one core each
    chosen = [b for b in BENCHES if args.only is None or b in args.only.split(",")]
    rows: list[dict[str, Any]] = []
    loads: list[str] = []
    slowdowns: list[dict[str, float]] = []
    for run in range(1, args.runs + 1):
        slowdowns.append(interference.measure())
        for name in chosen:
            before = wait_for_quiet(args.load, args.wait)
            for row in BENCHES[name].measure(args.steps):
                rows.append({**row, "run": run, "load_before": before, "load_after": os.getloadavg()[0]})
            loads.append(f"{name} run {run}: {before:.2f} -> {os.getloadavg()[0]:.2f}")
    (ROOT / "bench" / "out").mkdir(exist_ok=True)
    (ROOT / "bench" / "out" / "passes.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    Path(args.out).write_text(report(rows, loads, slowdowns, args), encoding="utf-8")
    print(f"wrote {args.out}")


def report(rows: list[dict[str, Any]], loads: list[str], slowdowns: list[dict[str, float]],
           args: argparse.Namespace) -> str:
    return "\n".join([
        "# Pass benchmarks: each pass on vs off, same seed, side by side",
        "",
        f"Generated by `bench/passes_all.py --runs {args.runs} --steps {args.steps}` on {time.strftime('%Y-%m-%d')}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        "one torch thread per worker. Ratios are off / on (> 1: the pass makes it faster). Each cell: the median "
        "over runs of each run's median ratio, then (each run's median; the range over every measured step).",
        "",
        *table(rows),
        "",
        "Targets: " + "; ".join(f"{k}: {v}" for k, v in TARGETS.items()) + ".",
        "",
        *NOTES,
        "",
        "Interference (`bench/interference.py`, once per run): generating one long-tail rollout alone vs beside a "
        "forward loop in a second process:",
        "",
        *[f"- run {i}: {d['generation_alone_s']:.3f} s alone, {d['generation_beside_forwards_s']:.3f} s beside "
          f"({d['slowdown']:.2f}x slower)" for i, d in enumerate(slowdowns, 1)],
        "",
        "1-minute load average before -> after each benchmark (the machine is shared with other work):",
        "",
        *[f"- {line}" for line in loads],
        "",
    ])


if __name__ == "__main__":
    main()
