"""The simulator against real runs, out of sample: each run's step time predicted from its flow, the model and
cluster description and a calibration fitted on the OTHER flows' runs only (leave one flow out).

    python bench/sim_validate.py [--steps 6] [--out bench/out/sim_validate] [--remeasure NAME ... | all]
                                 [--clock wall | cpu]

Runs (the local backend on this machine, one after another, `--steps` each; a run already measured in `--out` is
reused unless named in `--remeasure`): the calibration sweep of bench/calib/ (GRPO and PPO, long-tailed prompts
with a shared prefix and short arithmetic ones, model widths 32-160, 1-8 samples, caps 3-64), the shipped
examples, and bench/flows/'s variants (other batch sizes, mini-batches, epochs, response caps, PPO and GRPO),
which no calibration was ever fitted on. Each run uses one thread (OMP_NUM_THREADS=1: on a shared 2-core
machine a run's second thread mostly waits for the core), and its load average is kept in load.json. For each run, the cost factors (`flowrl calibrate`) are fitted on every
run of the other flows (a calib flow's other sweep points left out too), and the controller's time per sample
(rewards, advantage functions, data: user code no cost model knows) is taken, node kind by node kind (a reward
by its function, a function by its name), from those runs' measured times; a kind no other flow runs is
charged the mean of the other runs' nodes of its op. The run's own measured times are never read.

Two predictions per run, under the `serverful` policy on the `cpu` cluster (the local backend runs every call
in turn on one device): "trace" replays the run's own lengths (lengths.jsonl: what was generated, not how
long it took); "flow" knows only what the flow says (its data and `max_tokens`; `--lengths max`, an upper bound
for a random-initialised model that stops early). The error is the predicted mean step time (first step out)
over the measured one.

`--clock cpu` runs every timer of the runs on the process's CPU time (`time.perf_counter` is
`time.process_time` in them): on a machine shared with other work a single-threaded run's CPU time is close to
what its wall time would be alone, so calibration and validation see the model's error without the machine's
contention (rewards computed in worker processes, math_word's, are then not counted). Wall clock is the default
and what the product reports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowrl.backends.sim.calibrate import calibrate  # noqa: E402
from flowrl.backends.sim.costs import CostModel  # noqa: E402
from flowrl.backends.sim.hardware import load_cluster  # noqa: E402
from flowrl.backends.sim.simulate import simulate  # noqa: E402
from flowrl.backends.sim.work import FlowWork, flow_work  # noqa: E402
from flowrl.backends.sim.workload import Lengths, data_prompts, from_flow, read_metrics, replay  # noqa: E402


@dataclass(frozen=True)
class Run:
    name: str
    flow: str
    sets: tuple[str, ...] = ()
    kind: str = "calib"  # calib | example | variant


def _calib(i: int, flow: str, *sets: str) -> Run:
    return Run(f"calib{i}", f"bench/calib/{flow}.flow", sets)


RUNS = [
    _calib(0, "calib_grpo", "actor.dim=64", "prompts.batch=8", "use.max_tokens=4"),
    _calib(1, "calib_grpo", "actor.dim=96", "prompts.batch=16", "use.max_tokens=64"),
    _calib(2, "calib_grpo", "actor.dim=160", "prompts.batch=12", "use.group=8", "use.mini_batches=2"),
    _calib(3, "calib_grpo", "actor.dim=32", "prompts.batch=32", "use.max_tokens=12"),
    _calib(4, "calib_ppo", "actor.dim=64", "prompts.batch=24", "use.max_tokens=24", "use.group=2"),
    _calib(5, "calib_ppo", "actor.dim=128", "prompts.batch=16", "use.group=4"),
    _calib(6, "calib_ppo", "actor.dim=96", "prompts.batch=8", "use.mini_batches=2", "use.group=8"),
    _calib(7, "calib_ppo", "actor.dim=48", "prompts.batch=32", "use.max_tokens=6", "use.group=4"),
    _calib(8, "calib_short", "actor.dim=48", "prompts.batch=24", "use.max_tokens=3", "use.group=6"),
    _calib(9, "calib_short", "actor.dim=80", "prompts.batch=12", "use.max_tokens=6", "use.group=4"),
    _calib(10, "calib_short_ppo", "actor.dim=80", "prompts.batch=24", "use.max_tokens=3", "use.group=4"),
    _calib(11, "calib_short_ppo", "actor.dim=48", "prompts.batch=12", "use.max_tokens=8", "use.group=6"),
    *[Run(n, f"examples/{n}.flow", kind="example")
      for n in ("longtail_grpo", "longtail_ppo", "grpo_arith", "ppo_arith", "math_word")],
    *[Run(n, f"bench/flows/{n}.flow", kind="variant")
      for n in ("grpo_mb2_short", "ppo_b24_mb2", "grpo_wide_b32", "ppo_group4_long")],
]


CPU_CLOCK = ("import runpy, sys, time; time.perf_counter = time.process_time; sys.argv[0] = 'flowrl'; "
             "runpy.run_module('flowrl', run_name='__main__', alter_sys=True)")


def measure(run: Run, out: Path, steps: int, again: bool, clock: str = "wall") -> Path:
    d = out / run.name
    if not again and len(read_metrics(d)) >= steps:
        return d
    load = os.getloadavg()[0]
    launch = ["-m", "flowrl"] if clock == "wall" else ["-c", CPU_CLOCK]
    cmd = [sys.executable, *launch, "run", run.flow, "--steps", str(steps), "--out", str(d), "--overwrite",
           "--quiet", *[a for s in run.sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    (d / "load.json").write_text(json.dumps({"before": load, "after": os.getloadavg()[0], "clock": clock}))
    print(f"measured {run.name} (load {load:.1f})", flush=True)
    return d


def controller_kinds(graph: dict) -> dict[str, str]:
    """Controller node id -> its kind: op, and the reward's or function's name."""
    return {str(n["id"]): f"{n['op']}:{n.get('attrs', {}).get('fn') or n.get('attrs', {}).get('reward') or ''}"
            for n in graph["nodes"] if n.get("worker_group") == "controller"}


def per_sample(d: Path) -> dict[str, float]:
    """A run's measured controller seconds per sample, by node kind (first step out)."""
    graph = json.loads((d / "graph.json").read_text())
    rows = read_metrics(d)[1:]
    samples = sum(len(w.responses) for w in replay(d)[0])
    return {kind: sum(float(r.get(f"time/{node}", 0.0)) for r in rows) / len(rows) / samples
            for node, kind in controller_kinds(graph).items()}


def controller_s(target: Path, others: list[Path]) -> float:
    """The target's controller seconds per sample from the other runs' measurements (see the docstring)."""
    theirs = [per_sample(d) for d in others]
    total = 0.0
    for kind in controller_kinds(json.loads((target / "graph.json").read_text())).values():
        same = [t[kind] for t in theirs if kind in t]
        op = kind.split(":")[0]
        alike = same or [v for t in theirs for k, v in t.items() if k.split(":")[0] == op]
        total += statistics.mean(alike) if alike else 0.0
    return total


def predict(target: Path, others: list[Path]) -> tuple[float, float, float]:
    """(measured, predicted from the trace's lengths, predicted from the flow alone) mean step seconds."""
    factors, _ = calibrate(others)
    cost = CostModel(load_cluster("cpu"), factors)
    graph = json.loads((target / "graph.json").read_text())
    steps = replay(target)
    rows = read_metrics(target)
    n = min(len(steps), len(rows))
    measured = statistics.mean(float(r["step_time_s"]) for r in rows[1:n])
    base: FlowWork = flow_work(graph, prompts=len(steps[0]))
    work = replace(base, controller_s=controller_s(target, others))
    traced = simulate("serverful", cost, work, steps[:n]).step_s
    gen = next(x for x in graph["nodes"] if x["op"] == "generate")
    flow_steps = from_flow(Lengths(), work.prompts, work.samples, work.max_tokens, n, data_prompts(graph),
                           int(gen.get("attrs", {}).get("prefix_min_len", 0)))
    flowonly = simulate("serverful", cost, work, flow_steps).step_s
    return measured, traced, flowonly


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench/out/sim_validate"))
    ap.add_argument("--remeasure", nargs="*", default=[], metavar="NAME",
                    help="run these again (names in RUNS, or all)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="the runs' timers (see above)")
    args = ap.parse_args()
    out = Path(args.out)
    again = {r.name for r in RUNS} if "all" in args.remeasure else set(args.remeasure)
    dirs = {r.name: measure(r, out, args.steps, r.name in again, args.clock) for r in RUNS}
    print("| flow | kind | calibrated on | measured step (s) | predicted, trace (s) | error | "
          "predicted, flow only (s) | error | load |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst: dict[str, float] = {}
    for r in RUNS:
        others = [dirs[o.name] for o in RUNS if o.flow != r.flow]
        m, t, f = predict(dirs[r.name], others)
        load = json.loads((dirs[r.name] / "load.json").read_text()) if (dirs[r.name] / "load.json").is_file() else {}
        label = r.name if not r.sets else f"{r.name} ({Path(r.flow).stem} {' '.join(r.sets)})"
        print(f"| {label} | {r.kind} | {len(others)} runs | {m:.4f} | {t:.4f} | {t / m - 1:+.1%} | {f:.4f} | "
              f"{f / m - 1:+.1%} | {load.get('before', float('nan')):.1f} |", flush=True)
        worst[r.kind] = max(worst.get(r.kind, 0.0), abs(t / m - 1))
    print("worst |error| with the trace's lengths: " + ", ".join(f"{k} {v:.1%}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
