"""Where dynamic sampling matters: DAPO with and without it on a mix of easy and out-of-reach sums, synchronously and
with `max_staleness = 1`, several seeds, arms alternated.

examples/dapo_mix.flow (examples/data/mix.jsonl: one prompt in three a one-digit sum the tiny model learns, two in
three a three-digit sum it cannot) on the process backend, generation and training on pools of their own. Two arms
that differ in `keep` alone: "ds" (dynamic sampling, `keep = "mixed"`: more prompts are drawn until 16 groups with
mixed rewards fill the batch, at most 10 draws) and "all" (`keep = "all"`: every drawn group trains, GRPO's batch;
the rest is DAPO's in both: clip-higher, token-mean, no KL). Each at K = 0 (synchronous) and K = 1 (the rollout
phase, with its refill draws, runs one step ahead). Every run is a `flowrl run` subprocess timed from outside.

Reported per arm (mean and spread over the seeds): the final reward (mean `reward_mean` of the last 20 steps: the
reward of every sample generated, all draws, an unbiased estimate of the policy's accuracy on the data), the
generated tokens and the wall time (outside clock), the draws a step (`filter/gen_rounds`), the steps short of 16
groups, the reward once a budget of generated tokens and of wall time is spent, and per step: generation seconds
(`time/rollout`, every draw), training seconds (`time/actor.update`) and the step's wall time.

    python bench/dapo_mix.py --seeds 0 1 2 --steps 150 --out /tmp/dapo_mix   # writes /tmp/dapo_mix/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLOW = ROOT / "examples" / "dapo_mix.flow"
LAST = 20  # steps the final reward is the mean of
ARMS = {"ds": '"mixed"', "all": '"all"'}


def run(arm: str, k: int, seed: int, steps: int, out: Path) -> dict[str, Any]:
    """One `flowrl run` of the arm; its metrics rows and its wall time on this process's clock."""
    cmd = [sys.executable, "-m", "flowrl", "run", str(FLOW), "--backend", "process", "--steps", str(steps),
           "--out", str(out), "--overwrite", "--quiet", "--set", f"use.keep={ARMS[arm]}",
           "--set", f"run.max_staleness={k}", "--set", f"run.seed={seed}", "--set", "run.checkpoint_every=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - began
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"arm": arm, "k": k, "seed": seed, "wall_s": wall, "rows": rows}


def at_budget(rows: list[dict[str, Any]], key: str, budget: float, window: int = 10) -> float | None:
    """The mean reward of the `window` steps before the cumulative `key` passes `budget` (None: never spent)."""
    spent = 0.0
    for i, r in enumerate(rows):
        spent += float(r.get(key, 0.0))
        if spent >= budget:
            return statistics.mean(x["reward_mean"] for x in rows[max(0, i - window + 1): i + 1])
    return None


def _adder(figures: dict[str, list[float]]) -> Any:
    def add(name: str, value: float | None) -> None:
        if value is not None:
            figures.setdefault(name, []).append(value)
    return add


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and K: each figure's mean and (min, max) over the seeds."""
    tok_budgets = sorted({int(sum(r["gen_tokens"] for r in x["rows"])) for x in runs if x["arm"] == "all"})[:1]
    time_budgets = sorted({round(sum(r["step_time_s"] for r in x["rows"]), 1) for x in runs if x["arm"] == "all"})[:1]
    out: dict[str, Any] = {"token_budget": tok_budgets, "time_budget_s": time_budgets, "arms": {}}
    for arm in ARMS:
        for k in (0, 1):
            mine = [x for x in runs if x["arm"] == arm and x["k"] == k]
            if not mine:
                continue
            figures: dict[str, list[float]] = {}
            add = _adder(figures)
            for x in mine:
                rows = x["rows"]
                add("final_reward", statistics.mean(r["reward_mean"] for r in rows[-LAST:]))
                add("gen_tokens", sum(r["gen_tokens"] for r in rows))
                add("wall_s", x["wall_s"])
                add("steps_s", sum(r["step_time_s"] for r in rows))
                add("gen_rounds", statistics.mean(r.get("filter/gen_rounds", 1.0) for r in rows))
                add("short_steps", sum(r.get("filter/short_groups", 0.0) > 0 for r in rows))
                add("rollout_s_per_step", statistics.mean(r.get("time/rollout", 0.0) for r in rows))
                add("update_s_per_step", statistics.mean(r.get("time/actor.update", 0.0) for r in rows))
                add("step_s", statistics.mean(r["step_time_s"] for r in rows))
                add("train_idle_s", statistics.mean(r.get("async/train_idle_s", 0.0) for r in rows))
                for b in tok_budgets:
                    add(f"reward_at_{b}_tokens", at_budget(rows, "gen_tokens", b))
                for b in time_budgets:
                    add(f"reward_at_{b}_s", at_budget(rows, "step_time_s", b))
            out["arms"][f"{arm}/K={k}"] = {name: {"mean": statistics.mean(v), "min": min(v), "max": max(v),
                                                  "n": len(v)} for name, v in figures.items()}
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Reward (moving mean of 10 steps) against generated tokens and against wall time (cumulative step time), one
    thin line per seed, each arm in its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {("ds", 0): "#1c7ed6", ("all", 0): "#868e96", ("ds", 1): "#e8590c", ("all", 1): "#2b8a3e"}
    names = {"ds": "dynamic sampling", "all": "every group (GRPO's batch)"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    for (arm, k), colour in colours.items():
        mine = [x for x in runs if x["arm"] == arm and x["k"] == k]
        for i, x in enumerate(mine):
            rows = x["rows"]
            reward = [statistics.mean(r["reward_mean"] for r in rows[max(0, j - 9): j + 1]) for j in range(len(rows))]
            tokens, secs, t, s = [], [], 0.0, 0.0
            for r in rows:
                t += r["gen_tokens"]
                s += r["step_time_s"]
                tokens.append(t / 1000)
                secs.append(s)
            label = f"{names[arm]}, K = {k}" if i == 0 else None
            axes[0].plot(tokens, reward, color=colour, lw=1, alpha=0.8, label=label)
            axes[1].plot(secs, reward, color=colour, lw=1, alpha=0.8, label=label)
    axes[0].set_xlabel("generated tokens (thousands)")
    axes[1].set_xlabel("wall time of the steps (s, a shared 2-core machine)")
    for ax in axes:
        ax.set_ylabel("reward (all samples generated)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", type=Path, default=Path("/tmp/dapo_mix"))
    ap.add_argument("--plot", type=Path, default=None, help="draw the curves into this file (svg or png)")
    ap.add_argument("--also", type=Path, nargs="*", default=[],
                    help="other runs' results.json to draw too (a longer arm replaces that arm's shorter runs)")
    args = ap.parse_args()
    results = args.out / "results.json"
    runs: list[dict[str, Any]] = json.loads(results.read_text()) if results.exists() else []
    done = {(x["arm"], x["k"], x["seed"]) for x in runs}
    order = [(arm, k) for k in args.staleness for arm in args.arms]
    for i, seed in enumerate(args.seeds):
        turn = order[i % len(order):] + order[: i % len(order)]  # alternate which arm runs first
        for arm, k in turn:
            if (arm, k, seed) in done:
                continue
            x = run(arm, k, seed, args.steps, args.out / f"{arm}_k{k}_s{seed}")
            runs.append(x)
            results.write_text(json.dumps(runs))
            print(f"{arm} K={k} seed {seed}: final {statistics.mean(r['reward_mean'] for r in x['rows'][-LAST:]):.3f}"
                  f"  {sum(r['gen_tokens'] for r in x['rows']):.0f} tokens  {x['wall_s']:.0f} s", flush=True)
    if args.plot is not None:
        drawn = list(runs)
        for extra in args.also:
            more = json.loads(extra.read_text())
            arms = {(x["arm"], x["k"]) for x in more}
            drawn = [x for x in drawn if (x["arm"], x["k"]) not in arms] + more
        plot(drawn, args.plot)
    (args.out / "summary.json").write_text(json.dumps(summary(runs), indent=1))
    print(json.dumps(summary(runs), indent=1))


if __name__ == "__main__":
    main()
