"""The simulator against real runs: calibrate its cost model on a sweep of calibration runs, then predict the
step time of the shipped example flows (none of them calibrated on) and compare with their measured runs.

    python bench/sim_validate.py [--steps 12] [--repeats 2] [--out bench/out/sim_validate]

Every run is the local backend on this machine, one after another (nothing else running). Calibration: the
four flows in bench/calib/ (GRPO and PPO, on long-tailed prompts with a shared prefix and on short arithmetic
ones) at several model widths, batches, samples per prompt and response caps (`CALIB` below). Validation: each
example flow run `--repeats` times, alternated; the simulator replays each run's own lengths (`--trace`: the
same content, and the rewards' measured time per sample, which is user code) on the `cpu` cluster under the
`serverful` policy with the calibrated factors, and its mean step time (first step out) is set beside the
measured mean step time (first step out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALIB = [("calib_grpo", ["actor.dim=64", "prompts.batch=8", "use.max_tokens=4"]),
         ("calib_grpo", ["actor.dim=96", "prompts.batch=16", "use.max_tokens=64"]),
         ("calib_grpo", ["actor.dim=160", "prompts.batch=12", "use.group=8", "use.mini_batches=2"]),
         ("calib_grpo", ["actor.dim=32", "prompts.batch=32", "use.max_tokens=12"]),
         ("calib_ppo", ["actor.dim=64", "prompts.batch=24", "use.max_tokens=24", "use.group=2"]),
         ("calib_ppo", ["actor.dim=128", "prompts.batch=16", "use.group=4"]),
         ("calib_ppo", ["actor.dim=96", "prompts.batch=8", "use.mini_batches=2", "use.group=8"]),
         ("calib_ppo", ["actor.dim=48", "prompts.batch=32", "use.max_tokens=6", "use.group=4"]),
         ("calib_short", ["actor.dim=48", "prompts.batch=24", "use.max_tokens=3", "use.group=6"]),
         ("calib_short", ["actor.dim=80", "prompts.batch=12", "use.max_tokens=6", "use.group=4"]),
         ("calib_short_ppo", ["actor.dim=80", "prompts.batch=24", "use.max_tokens=3", "use.group=4"]),
         ("calib_short_ppo", ["actor.dim=48", "prompts.batch=12", "use.max_tokens=8", "use.group=6"])]
EXAMPLES = ["longtail_grpo", "longtail_ppo", "grpo_arith", "ppo_arith", "math_word"]


def flowrl(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "flowrl", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"flowrl {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def run(flow: str, sets: list[str], out: Path, steps: int) -> Path:
    flowrl("run", str(flow), "--steps", str(steps), "--out", str(out), "--overwrite", "--quiet",
           *[a for s in sets for a in ("--set", s)])
    return out


def measured(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sum(r["step_time_s"] for r in rows[1:]) / len(rows[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/out/sim_validate"))
    args = ap.parse_args()
    out = Path(args.out)
    calib_dirs = [run(ROOT / f"bench/calib/{flow}.flow", sets, out / f"calib{i}", args.steps)
                  for i, (flow, sets) in enumerate(CALIB)]
    print(flowrl("calibrate", *map(str, calib_dirs), "-o", str(out / "calibration.json")))
    rows = []
    for rep in range(args.repeats):
        for name in EXAMPLES:
            d = run(ROOT / f"examples/{name}.flow", [], out / f"{name}.{rep}", args.steps)
            sim = json.loads(flowrl("simulate", f"examples/{name}.flow", "--cluster", "cpu", "--trace", str(d),
                                    "--steps", str(args.steps), "--calibration", str(out / "calibration.json"),
                                    "--json"))[0]
            rows.append((name, rep, measured(d), sim["step_s"]))
            print(f"{name:<14} run {rep}: measured {rows[-1][2]:.4f} s, predicted {rows[-1][3]:.4f} s "
                  f"({rows[-1][3] / rows[-1][2] - 1:+.1%})", flush=True)
    print("\n| flow | measured step (s) | predicted (s) | error |\n| --- | --- | --- | --- |")
    for name in EXAMPLES:
        mine = [r for r in rows if r[0] == name]
        m, p = sum(r[2] for r in mine) / len(mine), sum(r[3] for r in mine) / len(mine)
        print(f"| {name} | {m:.4f} | {p:.4f} | {p / m - 1:+.1%} |")


if __name__ == "__main__":
    main()
