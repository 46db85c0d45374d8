"""The serverless backend vs the Ray backend's fixed pools: device-seconds held and step time, same seeds.

Workload: examples/longtail_grpo.flow (split placement: pool `rollout` generates, pool `train` runs the forwards
and the update; one device each, the serverless pools' upper sizes equal to the fixed ones), `--steps` steps,
the first `--skip` left out. The backends alternate within each round. Reported per run: the median step time,
the median device-seconds held and busy per step (`cost/held_s`, `cost/busy_s`: fixed pools hold both devices
the whole step; serverless instances only while their task runs), and the mean reward (the same samples on
both: one instance per pool draws with rank 0's seed, as the Ray backend does).

    python bench/serverless.py --rounds 2 --steps 16
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


def measure(backend: str, steps: int, skip: int, out: Path) -> dict[str, Any]:
    graph = flowrl.load(str(FLOW), overrides={"run.checkpoint_every": "0"})
    rows = flowrl.run(graph, out_dir=out, backend=backend, steps=steps, overwrite=True).metrics[skip:]
    return {"backend": backend, "step_s": statistics.median(r["step_time_s"] for r in rows),
            "held_s": statistics.median(r["cost/held_s"] for r in rows),
            "busy_s": statistics.median(r["cost/busy_s"] for r in rows),
            "reward": statistics.mean(r["reward_mean"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "serverless"))
    args = p.parse_args()
    rows = []
    for r in range(args.rounds):
        for be in (("ray", "serverless") if r % 2 == 0 else ("serverless", "ray")):
            row = {"round": r + 1, **measure(be, args.steps, args.skip, Path(args.out) / f"{be}_{r + 1}")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| round | backend | step, median | held device-s / step | busy device-s / step | reward |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['round']} | {row['backend']} | {row['step_s']:.3f} s | {row['held_s']:.3f} | "
              f"{row['busy_s']:.3f} | {row['reward']:.3f} |")
    for r in range(1, args.rounds + 1):
        ray_row = next(x for x in rows if x["round"] == r and x["backend"] == "ray")
        sl = next(x for x in rows if x["round"] == r and x["backend"] == "serverless")
        print(f"round {r}: serverless held {1 - sl['held_s'] / ray_row['held_s']:.0%} less, "
              f"step {sl['step_s'] / ray_row['step_s']:.2f}x the Ray backend's")


if __name__ == "__main__":
    main()
