"""Asynchronous RL (run { max_staleness = K }) vs the synchronous step: steps per second and idle pools.

Workload: the long-tail GRPO flow (examples/longtail_grpo.flow: 16 prompts x 8 samples of 1..64 tokens) with one
optimizer step per rollout (`--set use.mini_batches=1`), so generation (~0.14 s a batch here) and training (the
reference forward and the update, ~0.18 s) take comparable time; split placement, one rank per pool, process
backend (the Ray backend runs the same code; its per-call overhead would blur a 0.3 s step). Modes: K = 0 (the
synchronous step with every default pass, fuse-gen-inference included: the best synchronous step flowrl has),
K = 1 and K = 2. Each round runs every mode once, the order rotating from round to round so the machine's load
drifts onto all alike. Reported per mode: steps per second over the measured steps (after `--skip` warm-up
steps), its ratio to K = 0 per round, and the share of the measured wall time each pool sat idle (1 - the union
of its nodes' spans in trace.json; a fused stage's forward spans from its first chunk to its last, so the
synchronous train pool's idle share is a lower bound), plus the last steps' mean reward.

    python bench/async_rl.py --rounds 3 --steps 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flowrl  # noqa: E402

FLOW = ROOT / "examples" / "longtail_grpo.flow"
MODES = (0, 1, 2)
POOLS = ("rollout", "train")


def union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one span."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def idle_shares(run_dir: Path, skip: int) -> dict[str, float]:
    events = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = [(e["args"]["step"], e["args"]["group"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events]
    # the measured window: from the first span of the train phase of step skip + 1 to the end of the last step
    lo = min(a for step, group, a, _ in spans if step == skip + 1 and group == "train")
    hi = max(b for *_, b in spans)
    return {p: 1.0 - union([(a, b) for _, g, a, b in spans if g == p], lo, hi) / (hi - lo) for p in POOLS}


def measure(k: int, steps: int, skip: int, out: Path) -> dict[str, Any]:
    graph = flowrl.load(str(FLOW), overrides={"use.mini_batches": "1", "run.max_staleness": str(k),
                                              "run.checkpoint_every": "0"})
    rows = flowrl.run(graph, out_dir=out, backend="process", steps=steps, overwrite=True).metrics
    measured = rows[skip:]
    idle = idle_shares(out, skip)
    return {"k": k, "steps_per_s": len(measured) / sum(r["step_time_s"] for r in measured),
            "idle_rollout": idle["rollout"], "idle_train": idle["train"],
            "staleness": statistics.mean(r.get("async/staleness_mean", 0.0) for r in measured),
            "reward_last": statistics.mean(r["reward_mean"] for r in rows[-8:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the figures")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "async"))
    args = p.parse_args()
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for k in order:
            row = {"round": r + 1, **measure(k, args.steps, args.skip, out / f"k{k}_r{r + 1}")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    print("\n| mode | steps/s (per round) | vs K = 0 (per round) | rollout pool idle | train pool idle | "
          "mean staleness | reward, last 8 steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = {row["round"]: row["steps_per_s"] for row in rows if row["k"] == 0}
    for k in MODES:
        mine = [row for row in rows if row["k"] == k]
        rates = [row["steps_per_s"] for row in mine]
        ratios = [row["steps_per_s"] / base[row["round"]] for row in mine]
        name = "K = 0 (synchronous)" if k == 0 else f"K = {k}"
        print(f"| {name} | {statistics.median(rates):.2f} ({', '.join(f'{x:.2f}' for x in rates)}) | "
              f"**{statistics.median(ratios):.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)}) | "
              f"{statistics.median(row['idle_rollout'] for row in mine):.0%} | "
              f"{statistics.median(row['idle_train'] for row in mine):.0%} | "
              f"{statistics.mean(row['staleness'] for row in mine):.2f} | "
              f"{statistics.mean(row['reward_last'] for row in mine):.3f} |")


if __name__ == "__main__":
    main()
