"""The simulator's verbs of the `flowrl` command line: simulate, calibrate, plan (flowrl.backends.sim).

`flowrl.cli` adds these to its parser and dispatches to them; the work is in the modules beside this one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from flowrl.elastic import LATE_SHARE
from flowrl.errors import Diagnostic, FlowError

if TYPE_CHECKING:
    from flowrl.backends.sim.costs import CostModel
    from flowrl.backends.sim.work import FlowWork
    from flowrl.backends.sim.workload import Step

Verb = Callable[[str, str, str], argparse.ArgumentParser]


def add_verbs(verb: Verb) -> None:
    c = verb("simulate", "Simulate a flow's steps on a described cluster under a scheduling policy: step time, "
             "device-seconds, money, utilisation per pool, and a trace `flowrl timeline` draws.",
             "flowrl simulate examples/longtail_grpo.flow --cluster l40s:2 --model actor=qwen2.5-3b "
             "--policy serverful,rlhfless --prompts 128 --max-tokens 2048")
    _workload_args(c)
    c.add_argument("--policy", default="serverful", metavar="P[,P...]",
                   help="serverful | rlhfuse | rlhfless | pipe-rlhf, several comma-separated to compare")
    c.add_argument("--cost-weight", type=float, default=0.5, help="rlhfless: weight of time vs device-seconds")
    c.add_argument("--tau", type=float, default=0.7, help="rlhfless: cut-and-migrate threshold")
    c.add_argument("--rt", type=float, default=0.2, help="rlhfuse: migrate when this fraction is unfinished")
    c.add_argument("--gen-tp", type=int, default=None, help="devices per generation instance")
    c.add_argument("--dedup", default="auto", choices=["auto", "handover", "local", "off"],
                   help="rlhfless: deduplicated prefill of the prompts' shared prefix (as run { dedup_prefill })")
    c.add_argument("--late", type=float, default=LATE_SHARE,
                   help="rlhfless: a fused stage's forwards start this share of their learned slack late (0: off)")
    c.add_argument("--out", default=None, metavar="DIR", help="write trace.json and simulation.json here")
    c.add_argument("--json", action="store_true", help="print the summaries as JSON")

    c = verb("calibrate", "Fit the simulator's cost factors on measured local runs and report the fit's error.",
             "flowrl calibrate runs/longtail_grpo runs/grpo_arith -o calibration.json")
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    c.add_argument("--cluster", default="cpu", help="the device the runs ran on (default: cpu)")
    c.add_argument("-o", "--output", default=None, metavar="FILE", help="write the factors as JSON")

    c = verb("plan", "Search per-stage plans (placement, pool sizes, TP/PP/DP, micro-batches) for a flow on a "
             "described cluster and print the best with predicted time and cost.",
             "flowrl plan examples/ppo_arith.flow --cluster h100:128 --model actor=llama-2-70b "
             "--model critic=llama-2-13b --prompts 512 --samples 1 --max-tokens 1024")
    _workload_args(c)
    c.add_argument("--objective", default="time", choices=["time", "cost"])
    c.add_argument("--top", type=int, default=5)


def _workload_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("file", metavar="FILE")
    c.add_argument("--cluster", required=True, help="built-in (h100, h800, a100-80g, l40s, cpu) with :NODES, "
                   "or a TOML file")
    c.add_argument("--model", action="append", default=[], metavar="NAME=SHAPE",
                   help="a model's shape: a built-in name (qwen2.5-7b, llama-2-70b, ...) or an HF directory")
    c.add_argument("--trace", default=None, metavar="RUN_DIR",
                   help="replay a run's lengths.jsonl (and its rewards' measured time per sample)")
    c.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the flow's batch)")
    c.add_argument("--samples", type=int, default=None, help="samples per prompt (default: the flow's n)")
    c.add_argument("--max-tokens", type=int, default=None, help="response cap (default: the flow's)")
    c.add_argument("--lengths", default=None, metavar="SPEC",
                   help="without --trace: response lengths, cut at max-tokens: max (the default: every response "
                   "runs to the cap), fixed:N, uniform:LO:HI, geometric:MEAN, lognormal:MEDIAN[:BETWEEN[:WITHIN]]")
    c.add_argument("--median", type=float, default=None,
                   help="without --trace: the same as --lengths lognormal:MEDIAN")
    c.add_argument("--stretch", type=float, default=1.0, help="--trace: multiply its response lengths")
    c.add_argument("--steps", type=int, default=12)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--calibration", default=None, metavar="FILE", help="cost factors from `flowrl calibrate`")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a flow key")


def _setup(args: argparse.Namespace) -> tuple[CostModel, FlowWork, list[Step]]:
    from flowrl.backends.sim.costs import CostModel, Factors
    from flowrl.backends.sim.hardware import load_cluster
    from flowrl.backends.sim.shapes import resolve
    from flowrl.backends.sim.work import controller_times, flow_work
    from flowrl.backends.sim.workload import (
        Lengths,
        data_prompts,
        from_flow,
        parse_lengths,
        prefix_tokens,
        read_metrics,
        replay,
        stretch,
        tile,
    )
    from flowrl.compiler import compile_file, parse_sets
    from flowrl.ir.printer import to_json

    for n in ("prompts", "samples", "max_tokens", "steps"):
        if getattr(args, n) is not None and getattr(args, n) < 1:
            raise FlowError(Diagnostic(f"--{n.replace('_', '-')} must be at least 1, got {getattr(args, n)}"))
    overrides = {}
    for item in args.model:
        name, eq, spec = item.partition("=")
        if not eq or not name or not spec:
            raise FlowError(Diagnostic(f"--model {item!r}: expected NAME=SHAPE", hint="e.g. --model actor=qwen2.5-7b"))
        overrides[name] = resolve(spec)
    graph = to_json(compile_file(args.file, parse_sets(args.set)))
    cost = CostModel(load_cluster(args.cluster), Factors.load(args.calibration) if args.calibration else None)
    texts = data_prompts(graph)  # the flow's prompts: their lengths and shared opening
    min_prefix = next((int(n.get("attrs", {}).get("prefix_min_len", 0)) for n in graph["nodes"]
                       if n["op"] == "generate"), 0)
    if args.trace:
        steps = replay(args.trace)
        if (prefix := prefix_tokens(texts, min_prefix)):  # a trace has the lengths, the data the shared opening
            steps = [tuple(replace(w, prefix_len=prefix) for w in s) for s in steps]
        samples = sum(len(w.responses) for w in steps[0])  # a step of the run, before tiling
        if args.stretch != 1.0:
            steps = stretch(steps, args.stretch, args.max_tokens or max(n for s in steps for w in s
                                                                        for n in w.responses))
        if args.prompts:
            steps = tile(steps, args.prompts)
        steps = [steps[i % len(steps)] for i in range(args.steps)]
        longest = max(n for s in steps for w in s for n in w.responses)
        work = controller_times(flow_work(graph, overrides, prompts=len(steps[0]),
                                          samples=len(steps[0][0].responses),
                                          max_tokens=max(args.max_tokens or 0, longest)),
                                read_metrics(args.trace), samples)
    else:
        work = flow_work(graph, overrides, args.prompts, args.samples, args.max_tokens)
        lengths = parse_lengths(args.lengths) if args.lengths else \
            Lengths("lognormal", (args.median,)) if args.median else Lengths()
        steps = from_flow(lengths, work.prompts, work.samples, work.max_tokens, args.steps, texts, min_prefix,
                          seed=args.seed)
    return cost, work, steps


def cmd_simulate(args: argparse.Namespace) -> int:
    from flowrl.backends.sim.policies import Options
    from flowrl.backends.sim.registry import POLICIES
    from flowrl.backends.sim.simulate import report, simulate, write_trace

    names = [p for p in args.policy.split(",") if p]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise FlowError(Diagnostic(f"--policy {args.policy!r}: unknown {', '.join(bad) or 'empty'}",
                                   hint=f"one or more of {', '.join(POLICIES)}, comma-separated"))
    if not 0.0 <= args.cost_weight <= 1.0 or not 0.0 < args.tau <= 1.0 or not 0.0 < args.rt < 1.0:
        raise FlowError(Diagnostic("--cost-weight must be in [0, 1], --tau in (0, 1], --rt in (0, 1)"))
    cost, work, steps = _setup(args)
    opts = Options(gen_tp=args.gen_tp, cost_weight=args.cost_weight, tau=args.tau, rt=args.rt, dedup=args.dedup,
                   late=args.late)
    results = [simulate(p, cost, work, steps, opts) for p in names]
    if args.json:
        print(json.dumps([r.summary() for r in results], indent=2))
    else:
        print("\n\n".join(report(r, work) for r in results))
        if len(results) > 1:
            base = results[0]
            print(f"\nagainst {base.policy}:")
            for r in results[1:]:
                print(f"  {r.policy:<10} {versus(base.step_s, r.step_s, base.held_s, r.held_s)}")
    if args.out:
        for r in results:
            out = args.out if len(results) == 1 else f"{args.out}/{r.policy}"
            print(f"wrote {write_trace(r, out)}")
    return 0


def versus(base_step: float, step: float, base_held: float, held: float) -> str:
    """One policy against the first: 'step 1.42x faster, 29.5% fewer device-seconds'; slower and more said as
    such, and 'same' where the printed figure would be 1.00x or 0.0%."""
    speed = base_step / step
    if f"{speed:.2f}" == "1.00":
        pace = "same step time"
    else:
        pace = f"step {speed:.2f}x faster" if speed > 1 else f"step {1 / speed:.2f}x slower"
    saved = 1 - held / base_held
    if f"{abs(saved):.1%}" == "0.0%":
        return f"{pace}, same device-seconds"
    return f"{pace}, {abs(saved):.1%} {'fewer' if saved > 0 else 'more'} device-seconds"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from flowrl.backends.sim.calibrate import calibrate, save
    from flowrl.backends.sim.hardware import load_cluster

    factors, info = calibrate(args.run_dirs, load_cluster(args.cluster))
    print("fitted factors: " + ", ".join(f"{k} {v:.4g}" for k, v in factors.to_json().items()
                                         if isinstance(v, float)))
    print("fit error (mean |predicted - measured| / measured): " +
          ", ".join(f"{k} {v:.1%}" for k, v in info["calls"].items()))
    for run, s in info["steps"].items():
        print(f"  {run}: step {s['measured_s']:.3f} s measured, {s['predicted_s']:.3f} s predicted "
              f"({s['error']:+.1%})")
    if args.output:
        print(f"wrote {save(factors, info, args.output)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from flowrl.backends.sim.plan import best

    cost, work, steps = _setup(args)
    found = best(cost, work, steps[0], args.objective, args.top)
    print(work.describe())
    print(f"best {len(found)} plans on {cost.cluster.name} ({cost.cluster.devices} x {cost.dev.name}) by "
          f"{args.objective}:")
    print(f"{'step s':>8} {'dev-s':>9} {'money':>8}  {'gen':>6} {'fwd':>6} {'train':>6} {'sync':>5}  plan")
    for p in found:
        print(f"{p.time_s:>8.2f} {p.device_s:>9.0f} {cost.cluster.money(p.device_s):>8.3f}  {p.gen_s:>6.1f} "
              f"{p.fwd_s:>6.1f} {p.train_s:>6.1f} {p.sync_s:>5.1f}  {p.describe()}")
    return 0


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": cmd_simulate, "calibrate": cmd_calibrate, "plan": cmd_plan}
