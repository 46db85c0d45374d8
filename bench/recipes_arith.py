"""The recipes on the arithmetic example: examples/grpo_arith.flow with `use grpo(...)` swapped for each template.

    .venv/bin/python bench/recipes_arith.py --out bench/out/recipes [--templates grpo,gspo,dr_grpo,cispo] [--reuse]

Each template runs the flow's own line, `use NAME(reward = correct, group = 8, max_tokens = 2, kl_coef = 0.05,
temperature = 1.0)` (ppo: with `model critic : critic { source = actor }` added), for the flow's 300 steps at seed 0 on the local backend (`flowrl run`, one process each, one
after the other). Reported per template: mean reward over the first 10 and the last 10 steps, the first step at
which the mean over the 10 steps before it reaches 0.5, generated tokens, and the run's wall time (on this script's
clock). `--reuse` summarises run directories already in --out that hold all their steps.

`--example math_word --steps 300 --target 0.3` swaps the template of examples/math_word.flow the same way (its line
takes `prompts = problems` and `max_tokens = 4`; the table's second half in bench/RESULTS_recipes.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_arith.flow"
TARGET = 0.5
STEPS = 0  # 0: the flow's own


def flow_for(template: str, folder: Path) -> Path:
    """The example with its template swapped, written next to a link to its data (relative paths)."""
    text = EXAMPLE.read_text(encoding="utf-8").replace("use grpo(", f"use {template}(")
    if template == "ppo":  # the one template with a critic: the flow's comment says to declare it
        text = text.replace("model ref : reference { source = actor }\n",
                            "model ref : reference { source = actor }\nmodel critic : critic { source = actor }\n")
    data = folder / "data"
    if not data.exists():
        data.symlink_to(ROOT / "examples" / "data")
    path = folder / f"{EXAMPLE.stem}_{template}.flow"
    path.write_text(text, encoding="utf-8")
    return path


def run(template: str, out: Path, reuse: bool) -> tuple[list[dict[str, Any]], float | None]:
    run_dir = out / f"out_{template}"
    metrics = run_dir / "metrics.jsonl"
    if reuse and metrics.exists() and len(metrics.read_text().splitlines()) >= (STEPS or 300):
        return [json.loads(line) for line in metrics.read_text().splitlines()], None
    flow = flow_for(template, out)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    steps = ["--steps", str(STEPS)] if STEPS else []
    subprocess.run([sys.executable, "-m", "flowrl", "run", str(flow), "--out", str(run_dir), "--overwrite", "--quiet",
                    *steps], env=env, check=True)
    wall = time.perf_counter() - t0
    return [json.loads(line) for line in metrics.read_text().splitlines()], wall


def summary(rows: list[dict[str, Any]], wall: float | None) -> dict[str, Any]:
    rewards = [float(r["reward_mean"]) for r in rows]
    reached = next((i + 1 for i in range(9, len(rewards)) if sum(rewards[i - 9:i + 1]) / 10 >= TARGET), None)
    return {"steps": len(rows), "first10": sum(rewards[:10]) / 10, "last10": sum(rewards[-10:]) / 10,
            "steps_to_target": reached, "gen_tokens": sum(float(r["gen_tokens"]) for r in rows),
            "step_time_s": sum(float(r["step_time_s"]) for r in rows), "wall_s": wall}


def main() -> None:
    global EXAMPLE, TARGET, STEPS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "recipes")
    ap.add_argument("--templates", default="grpo,gspo,dr_grpo,cispo")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--example", default="grpo_arith", help="examples/NAME.flow (its `use grpo(` line is swapped)")
    ap.add_argument("--steps", type=int, default=0, help="steps of each run (0: the flow's own)")
    ap.add_argument("--target", type=float, default=TARGET, help="the reward whose first reach is reported")
    args = ap.parse_args()
    EXAMPLE, TARGET, STEPS = ROOT / "examples" / f"{args.example}.flow", args.target, args.steps
    args.out.mkdir(parents=True, exist_ok=True)
    table = {}
    for template in args.templates.split(","):
        table[template] = summary(*run(template, args.out, args.reuse))
        print(template, json.dumps(table[template]), flush=True)
    print(f"\n| template | reward, first 10 steps | last 10 | first step at a 10-step mean >= {TARGET} | "
          "generated tokens | time stepping (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, s in table.items():
        print(f"| `{name}` | {s['first10']:.3f} | {s['last10']:.3f} | {s['steps_to_target'] or 'not reached'} | "
              f"{s['gen_tokens']:,.0f} | {s['step_time_s']:.0f} |")
    (args.out / "recipes.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
