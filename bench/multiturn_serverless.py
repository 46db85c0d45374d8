"""Multi-turn rollouts with slow environments on serverless pools vs the Ray backend's fixed pools (issue 26 item 3):
device-seconds held per trajectory, counted as the cluster counts them, same seeds.

The workload: grpo with an environment whose every step waits a lognormal time (examples/envs/latency.py, median
`--median` s, sigma 0.8: p99/p50 = 6.4), `--turns` steps a trajectory, split placement (pool `rollout`
generates, pool `train` runs the reference forward and the update). Three sides a round, alternated (reversed every
other round): `ray` (fixed pools, one rank each, held from their placement groups' creation to their removal),
`serverless` (elastic pools `gpus = 0..1`; a generation instance gives its device back while every live trajectory
waits on environments predicted to answer later than a warm round costs, its rows resuming on the next instance:
backends/serverless/env_release.py) and `serverless -env_release` (the same, instances holding their devices
through the waits). Serverless held device-time is the instance tasks' from Ray's task events
(backends/serverless/held.py; tests/ray/test_serverless_env_held.py checks it against a second driver sampling
the cluster's free slots over a run that released). Reported per run: held device-seconds in all and per
trajectory, the median step time (steps after `--skip`), the environment waits held with a device
(`cost/env_wait_held_s`), parks and resumed rows.

    python bench/multiturn_serverless.py --rounds 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import flowrl

ROOT = Path(__file__).resolve().parents[1]
FLOW = """\
flow multiturn_serverless
model actor : policy {{ source = "tiny:gpt2", layers = 2, dim = 64, heads = 4, charset = "0123456789+=;",
                        lr = 1e-5, context = 128 }}
model ref : reference {{ source = actor }}
env game = "envs.latency.Latency" {{ max_turns = {turns}, workers = 8, timeout = 60, median = {median},
                                     sigma = 0.8, turns = {turns}, obs = "12+34=;" }}
data prompts = jsonl("data.jsonl") {{ batch = {batch}, shuffle = false }}
use grpo(group = {group}, max_tokens = {tokens}, env = game)
placement {{
    pool rollout {{ {pool} }}
    pool train   {{ {pool} }}
    actor.generate -> rollout
    actor.update, ref -> train
}}
run {{ seed = 0, checkpoint_every = 0 }}
"""


def flow_file(out: Path, backend: str, args: argparse.Namespace) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "envs").mkdir(exist_ok=True)
    shutil.copy(ROOT / "examples" / "envs" / "latency.py", out / "envs" / "latency.py")
    (out / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i % 90 + 10}+{(7 * i) % 90 + 10}=", "id": i})
                                            + "\n" for i in range(64)))
    pool = "gpus = 1" if backend == "ray" else "gpus = 0..1, elastic = true"
    path = out / "multiturn.flow"
    path.write_text(FLOW.format(turns=args.turns, median=args.median, batch=args.batch, group=args.group,
                                tokens=args.tokens, pool=pool))
    return path


def measure(side: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from flowrl.backends.ray import RayBackend
    from flowrl.backends.serverless import ServerlessBackend

    backend = "ray" if side == "ray" else "serverless"
    graph = flowrl.load(str(flow_file(out, backend, args)))
    be: Any = RayBackend() if side == "ray" else ServerlessBackend(
        ablate=("env_release",) if side.endswith("-env_release") else ())
    res = flowrl.run(graph, out_dir=out / "run", backend=be, steps=args.steps, overwrite=True)
    rows = res.metrics
    held = sum(r.held_s() for r in be.reserved) if side == "ray" else be.held_total_s
    trajectories = args.steps * args.batch * args.group
    return {"side": side, "held_s": round(held, 2), "held_per_traj_s": round(held / trajectories, 4),
            "step_s": round(statistics.median(r["step_time_s"] for r in rows[args.skip:]), 3),
            # the generation loops' seconds with nothing to do while environments were pending, devices held
            "env_wait_held_s": round(sum(r["cost/env_wait_held_s"] for r in rows), 2),
            "idle_frac": round(statistics.mean(r["env/idle_frac"] for r in rows), 3),
            "parks": sum(r.get("env/parks", 0.0) for r in rows),
            "resumed_rows": sum(r.get("env/resumed_rows", 0.0) for r in rows),
            "turns_mean": round(statistics.mean(r["env/turns_mean"] for r in rows), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2, help="steps left out of the median step time")
    p.add_argument("--batch", type=int, default=4, help="prompts a step")
    p.add_argument("--group", type=int, default=4, help="trajectories a prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8, help="tokens a turn")
    p.add_argument("--median", type=float, default=0.5, help="median environment step seconds")
    p.add_argument("--out", default="/tmp/flowrl_bench_multiturn_serverless")
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sides = ["ray", "serverless", "serverless -env_release"]
    rows = []
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            row = {"round": r + 1, **measure(side, Path(args.out) / f"r{r}_{side.replace(' ', '')}", args)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| side | held device-s (rounds) | per trajectory | step time (median) | env waits held | parks / rows resumed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for side in sides:
        mine = [x for x in rows if x["side"] == side]
        print(f"| {side} | {statistics.median(x['held_s'] for x in mine):.1f} "
              f"({', '.join(str(x['held_s']) for x in mine)}) | {statistics.median(x['held_per_traj_s'] for x in mine):.3f} s "
              f"| {statistics.median(x['step_s'] for x in mine):.2f} s | "
              f"{statistics.median(x['env_wait_held_s'] for x in mine):.1f} s | "
              f"{statistics.median(x['parks'] for x in mine):.0f} / {statistics.median(x['resumed_rows'] for x in mine):.0f} |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "examples"))
    main()
