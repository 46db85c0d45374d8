"""The serverless backend vs the Ray backend's fixed pools: device-seconds held and step time, same seeds.

Held device-time is counted as the cluster counts it, on both sides, over whole runs (start-up and the final
checkpoint included): the serverless run's instance tasks from the grant of their device slot to its return, as
Ray's task events record them (backends/serverless/held.py, `ServerlessBackend.held_total_s`); the Ray backend's
placement groups from their creation to their removal (`RayBackend.reserved`), ranks times life.

Workload: examples/longtail_grpo.flow (split placement: pool `rollout` generates, pool `train` runs the forwards
and the update). `--upper N`: the serverless pools are `gpus = 0..N, elastic = true` (scale to zero: a lower
bound above 0 is kept warm, held and counted, all along); the fixed run gets their upper sizes (N ranks a pool:
the actor's `replicas = N`, which both of its groups take). `--steps` steps a run,
the backends alternating within each round (reversed every other round). Reported per run: the whole run's held
device-seconds and their share against the fixed run of the same round, the median step time (steps after
`--skip`) and its ratio, the device-seconds held a step (whole run / steps) and the mean reward. Issue 24's
target: at least 30% fewer device-seconds at most 1.05x the step time.

    python bench/serverless.py --rounds 3 --steps 40
    python bench/serverless.py --rounds 3 --steps 40 --ablate late   # and a serverless run a round with `late` off

`--curve`: the same workload with the generation pool elastic at 0..2 instances (the Ray backend's fixed pool
at 2), serverless at cost_weight (lambda) 0, 0.5 and 1, and at 0.5 with each of the mechanisms switched off one
at a time (ServerlessBackend(ablate=...): length prediction, length-ranked assignment, the deduplicated prefill,
cut-and-migrate, the cost-aware count); configurations alternate in order within each round, reversed every other round.

    python bench/serverless.py --curve --rounds 2 --steps 12

`--dedup`: the deduplicated prefill. Every prompt of examples/data/longtail.jsonl opens with the same 15
characters (16 tokens with BOS, the share-prefix pass's minimum), so with two generation instances (the count
switched off) the common prefix is on both. `run { dedup_prefill }` "off" (every prompt prefills it),
"local" (each instance computes it once), "handover" (the first computes it and the other takes its keys and
values from the object store) and "auto" (the measured choice), alternated as above. Reported: step and
generation time, held device-seconds, prefix tokens computed and saved a step, and the measured prefill and
handover seconds (per instance and step).

    python bench/serverless.py --dedup --rounds 3 --steps 12
    python bench/serverless.py --dedup --rounds 2 --steps 10 --preamble 240   # a longer shared opening
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


def upper_flow(out: Path, backend: str, upper: int) -> Path:
    """examples/longtail_grpo.flow for one side of the comparison: elastic pools `gpus = 0..upper` (serverless)
    or `upper` ranks each (the Ray backend's fixed pools)."""
    if backend == "ray":
        path = flow_file(out, "gpus = 1")
        if upper > 1:
            path.write_text(path.read_text().replace('source  = "tiny:gpt2"', f'source  = "tiny:gpt2"\n    replicas = {upper}'))
        return path
    path = flow_file(out, f"gpus = 0..{upper}, elastic = true")
    path.write_text(path.read_text().replace("pool train   { gpus = 1 }", f"pool train   {{ gpus = 0..{upper}, elastic = true }}"))
    return path


def measure(backend: str, upper: int, steps: int, skip: int, out: Path, ablate: tuple[str, ...] = (),
            late: float | None = None) -> dict[str, Any]:
    """One whole run -> its held device-seconds as the cluster counts them, step time and reward (`ablate`: the
    serverless mechanisms switched off; `late`: the late start's share, when not the default)."""
    from flowrl.backends.ray import RayBackend
    from flowrl.backends.serverless import ServerlessBackend

    graph = flowrl.load(str(upper_flow(out, backend, upper)), overrides={"run.checkpoint_every": "0"})
    be: Any = RayBackend() if backend == "ray" else ServerlessBackend(ablate=ablate, late=late)
    res = flowrl.run(graph, out_dir=out, backend=be, steps=steps, overwrite=True)
    rows = res.metrics
    if backend == "ray":
        held, ranks = sum(r.held_s() for r in be.reserved), "+".join(str(r.ranks) for r in be.reserved)
    else:
        held, ranks = be.held_total_s, "+".join(f"0..{upper}" for _ in graph.worker_groups)
    name = backend + "".join(f" -{a}" for a in ablate) + (f" late {late:g}" if late is not None else "")
    return {"backend": name, "ranks": ranks, "steps": steps, "held_s": held, "held_step_s": held / steps,
            "report_held_s": res.cost.get("held_s", 0.0),
            "step_s": statistics.median(r["step_time_s"] for r in rows[skip:]),
            # steady state, start-up aside: device-seconds held per second of stepping over the measured steps
            # (a fixed pool's is its ranks), less swayed by the machine's load than whole-run totals
            "devices": sum(r["cost/held_s"] for r in rows[skip:]) / sum(r["step_time_s"] for r in rows[skip:]),
            "reward": statistics.mean(r["reward_mean"] for r in rows)}


def flow_file(out: Path, rollout: str) -> Path:
    """examples/longtail_grpo.flow with pool rollout's `gpus` set to `rollout` (its data path made absolute)."""
    text = FLOW.read_text().replace("pool rollout { gpus = 1 }", f"pool rollout {{ {rollout} }}")
    text = text.replace('jsonl("data/longtail.jsonl")', f'jsonl("{FLOW.parent / "data" / "longtail.jsonl"}")')
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"longtail_{rollout.split()[2].replace('..', '_')}.flow"
    path.write_text(text)
    return path


CURVE = [("ray (fixed pools)", "ray", 0.5, ()), ("serverless lambda 0", "serverless", 0.0, ()),
         ("serverless lambda 0.5", "serverless", 0.5, ()), ("serverless lambda 1", "serverless", 1.0, ()),
         ("lambda 0.5, no prediction", "serverless", 0.5, ("predict",)),
         ("lambda 0.5, no ranked assignment", "serverless", 0.5, ("assign",)),
         ("lambda 0.5, no deduplicated prefill", "serverless", 0.5, ("dedup",)),
         ("lambda 0.5, no migration", "serverless", 0.5, ("migrate",)),
         ("lambda 0.5, no cost-aware count", "serverless", 0.5, ("scale",))]


def curve(args: argparse.Namespace) -> None:
    from flowrl.backends.serverless import ServerlessBackend

    out = Path(args.out) / "curve"
    fixed, elastic = flow_file(out, "gpus = 2"), flow_file(out, "gpus = 0..2, elastic = true")
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name, be, lam, off in (CURVE if r % 2 == 0 else CURVE[::-1]):
            graph = flowrl.load(str(fixed if be == "ray" else elastic),
                                overrides={"run.checkpoint_every": "0", "run.cost_weight": str(lam)})
            backend: Any = be if be == "ray" else ServerlessBackend(ablate=off)
            res = flowrl.run(graph, out_dir=out / f"{len(rows)}", backend=backend, steps=args.steps,
                             overwrite=True).metrics[args.skip:]
            row = {"round": r + 1, "config": name, "step_s": statistics.median(x["step_time_s"] for x in res),
                   "held_s": statistics.median(x["cost/held_s"] for x in res),
                   "instances": statistics.mean(x.get("scale/rollout/instances", 2.0) for x in res),
                   "moved": statistics.mean(x.get("migrate/rollout/moved", 0.0) for x in res),
                   "reward": statistics.mean(x["reward_mean"] for x in res)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| configuration | step, median (rounds) | held device-s / step (rounds) | vs fixed: step, held | "
          "instances | moved rows / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = [x for x in rows if x["config"] == CURVE[0][0]]
    for name, *_ in CURVE:
        mine = [x for x in rows if x["config"] == name]
        step = statistics.mean(x["step_s"] for x in mine) / statistics.mean(x["step_s"] for x in base)
        held = statistics.mean(x["held_s"] for x in mine) / statistics.mean(x["held_s"] for x in base)
        steps = ", ".join(f"{x['step_s']:.3f}" for x in mine)
        helds = ", ".join(f"{x['held_s']:.3f}" for x in mine)
        print(f"| {name} | {steps} s | {helds} | {step:.2f}x, {held - 1:+.0%} | "
              f"{statistics.mean(x['instances'] for x in mine):.2f} | {statistics.mean(x['moved'] for x in mine):.1f} |")


DEDUP = ("off", "local", "handover", "auto")


def preamble_data(out: Path, chars: int) -> Path:
    """examples/data/longtail.jsonl with its shared 15-character opening made `chars` characters long."""
    system = "12+34+56+78+90="
    longer = (system * (chars // len(system) + 1))[:chars]
    rows = [json.loads(line) for line in (FLOW.parent / "data" / "longtail.jsonl").read_text().splitlines()]
    path = out / f"longtail_preamble_{chars}.jsonl"
    path.write_text("".join(json.dumps({**r, "prompt": longer + r["prompt"][len(system):]}) + "\n" for r in rows))
    return path


def dedup(args: argparse.Namespace) -> None:
    from flowrl.backends.serverless import ServerlessBackend

    out = Path(args.out) / f"dedup_{args.preamble}"
    elastic = flow_file(out, "gpus = 0..2, elastic = true")
    if args.preamble != 15:
        data = preamble_data(out, args.preamble)
        elastic.write_text(elastic.read_text().replace(str(FLOW.parent / "data" / "longtail.jsonl"), str(data)))
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for mode in (DEDUP if r % 2 == 0 else DEDUP[::-1]):
            graph = flowrl.load(str(elastic), overrides={"run.checkpoint_every": "0", "run.migrate_at": "1.0",
                                                         "run.dedup_prefill": f'"{mode}"'})
            res = flowrl.run(graph, out_dir=out / f"{len(rows)}", backend=ServerlessBackend(ablate={"scale"}),
                             steps=args.steps, overwrite=True).metrics[args.skip:]

            def mean(key: str, rows_: list[dict[str, Any]] = res) -> float:
                return statistics.mean(x.get(key, 0.0) for x in rows_)

            row = {"round": r + 1, "mode": mode, "step_s": statistics.median(x["step_time_s"] for x in res),
                   "gen_s": statistics.median(x["scale/rollout/measured_T_s"] for x in res),
                   "held_s": statistics.median(x["cost/held_s"] for x in res),
                   "computed": mean("prefill/rollout/computed_tokens"), "saved": mean("prefill/rollout/saved_tokens"),
                   "prefill_s": mean("prefill/rollout/prefill_s"), "handover_s": mean("prefill/rollout/handover_s"),
                   "handed": mean("prefill/rollout/handover"), "reward": mean("reward_mean")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| dedup_prefill | step, median (rounds) | generation, median (rounds) | held device-s / step | "
          "prefix tokens computed / saved a step | prefill s / handover s a step | handed over |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in DEDUP:
        mine = [x for x in rows if x["mode"] == mode]
        steps = ", ".join(f"{x['step_s']:.3f}" for x in mine)
        gens = ", ".join(f"{x['gen_s']:.3f}" for x in mine)
        print(f"| {mode} | {steps} s | {gens} s | {statistics.mean(x['held_s'] for x in mine):.3f} | "
              f"{statistics.mean(x['computed'] for x in mine):.0f} / {statistics.mean(x['saved'] for x in mine):.0f} | "
              f"{statistics.mean(x['prefill_s'] for x in mine) * 1e3:.1f} ms / "
              f"{statistics.mean(x['handover_s'] for x in mine) * 1e3:.1f} ms | "
              f"{statistics.mean(x['handed'] for x in mine):.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "serverless"))
    p.add_argument("--curve", action="store_true", help="the lambda curve and the ablation (see above)")
    p.add_argument("--dedup", action="store_true", help="the deduplicated prefill's modes (see above)")
    p.add_argument("--preamble", type=int, default=15, help="--dedup: characters every prompt opens with")
    p.add_argument("--upper", type=int, default=1, help="the serverless pools' upper size (the fixed run's ranks)")
    p.add_argument("--ablate", action="append", default=[], choices=["predict", "assign", "dedup", "migrate",
                                                                     "scale", "prewarm", "late"],
                   help="compare: one more serverless run a round with this mechanism off (repeatable)")
    p.add_argument("--late", action="append", default=[], type=float,
                   help="compare: one more serverless run a round with this share of the late start (repeatable)")
    args = p.parse_args()
    if args.curve:
        curve(args)
        return
    if args.dedup:
        dedup(args)
        return
    compare(args)


def compare(args: argparse.Namespace) -> None:
    """Serverless against fixed pools at its upper sizes, alternated; the table for the README."""
    rows = []
    sides: list[tuple[str, tuple[str, ...], float | None]] = [("ray", (), None), ("serverless", (), None)]
    sides += [("serverless", (a,), None) for a in args.ablate] + [("serverless", (), x) for x in args.late]
    for r in range(args.rounds):
        for be, off, late in (sides if r % 2 == 0 else sides[::-1]):
            name = be + "".join(f"_no_{a}" for a in off) + (f"_late{late:g}" if late is not None else "")
            row = {"round": r + 1, **measure(be, args.upper, args.steps, args.skip,
                                             Path(args.out) / f"{name}_{args.upper}_{r + 1}", off, late)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n`python bench/serverless.py --rounds {args.rounds} --steps {args.steps} --upper {args.upper}`"
          f" (step time: median of steps {args.skip + 1}..{args.steps}; held: whole runs, start-up included)\n")
    print("| round | backend | ranks | held device-s, whole run | held / step | step, median | vs fixed: held, step "
          "| devices held while stepping | reward |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        fixed = next(x for x in rows if x["round"] == row["round"] and x["backend"] == "ray")
        vs = (f"{row['held_s'] / fixed['held_s'] - 1:+.0%}, {row['step_s'] / fixed['step_s']:.2f}x"
              if row["backend"] != "ray" else "")
        print(f"| {row['round']} | {'ray (fixed pools)' if row['backend'] == 'ray' else row['backend']} | "
              f"{row['ranks']} | {row['held_s']:.1f} | {row['held_step_s']:.3f} | {row['step_s']:.3f} s | {vs} | "
              f"{row['devices']:.2f} | {row['reward']:.3f} |")
    less = [1 - sl["held_s"] / f["held_s"] for sl, f in _pairs(rows)]
    ratio = [sl["step_s"] / f["step_s"] for sl, f in _pairs(rows)]
    met = all(x >= 0.30 for x in less) and all(x <= 1.05 for x in ratio)
    print(f"\nserverless held {', '.join(f'{x:.0%}' for x in less)} less, at "
          f"{', '.join(f'{x:.2f}x' for x in ratio)} the step time (target: >= 30% less at <= 1.05x): "
          f"{'met in every round' if met else 'NOT met in every round'}")


def _pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(serverless, fixed) of each round (the serverless run with every mechanism on)."""
    return [(next(x for x in rows if x["round"] == r and x["backend"] == "serverless"),
             next(x for x in rows if x["round"] == r and x["backend"] == "ray"))
            for r in sorted({x["round"] for x in rows})]


if __name__ == "__main__":
    main()
