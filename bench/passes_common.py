"""Shared harness of the pass benchmarks (bench/passes_*.py): one pass on vs off, side by side, same seed.

Two controllers are built from the same flow, one compiled with every default pass and one with the pass under
test switched off (`--no-pass NAME`). They run the same steps in lockstep, alternating which goes first, so
the machine's load drifts onto both alike; each pair of steps must compute the same numbers (checked every
step: all tensors and metrics, <= 1e-5 in the first step, <= 1e-3 later as tests/passes explains). Reported:
the median time of the affected stage and of the whole step, their ratio (off / on, > 1 = the pass is faster),
and the spread (min..max of the per-step ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowrl.compiler import compile_file, parse_sets  # noqa: E402
from flowrl.ir.graph import Graph  # noqa: E402
from flowrl.runtime.controller import Controller, StepResult  # noqa: E402
from flowrl.runtime.runner import loaders_of, scorers_of  # noqa: E402


@dataclass
class Side:
    """One configuration: its controller and the per-step times."""

    name: str
    graph: Graph
    ctl: Controller
    backend: Any
    stage_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


def make_side(name: str, graph: Graph, backend: Any, seed: int = 0) -> Side:
    torch.manual_seed(seed)
    groups = backend.start(graph, seed=seed, device="cpu")
    ctl = Controller(graph, groups, loaders_of(graph, seed), scorers_of(graph), seed=seed,
                     after_update=getattr(backend, "after_update", None))  # split placement's weight sync
    return Side(name, graph, ctl, backend)


def stage_time(res: StepResult, nodes: Sequence[str]) -> float:
    """Wall time from the first of `nodes` starting to the last ending (fused members overlap)."""
    spans = [s for s in res.spans if s.node in nodes]
    return max(s.start + s.dur for s in spans) - min(s.start for s in spans)


def max_diff(a: StepResult, b: StepResult) -> float:
    worst = 0.0
    for node, batch in a.values.items():
        for key, t in batch.tensors.items():
            u = b.values[node].tensors[key]
            if t.shape != u.shape:
                return float("inf")
            worst = max(worst, float((t.float() - u.float()).abs().max()) if t.numel() else 0.0)
    for k, v in a.metrics.items():
        if not k.startswith(("time/", "fusion/")):
            worst = max(worst, abs(v - b.metrics[k]))
    return worst


@dataclass
class Report:
    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, **row: Any) -> None:
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def lockstep(on: Side, off: Side, stage: Sequence[str], steps: int, warmup: int = 1,
             extra: Callable[[StepResult, StepResult], dict[str, float]] | None = None) -> dict[str, Any]:
    """Run `warmup + steps` steps on both sides; returns medians, ratios, spreads and the equality check.
    `extra(on_result, off_result)` adds medians of more per-step figures."""
    worst = [0.0, 0.0]  # first step, later steps
    extras: list[dict[str, float]] = []
    for step in range(1, warmup + steps + 1):
        order = (on, off) if step % 2 else (off, on)
        results: dict[str, StepResult] = {}
        for side in order:
            t0 = time.perf_counter()
            res = side.ctl.step(step)
            took = time.perf_counter() - t0
            results[side.name] = res
            if step > warmup:
                side.step_s.append(took)
                side.stage_s.append(stage_time(res, stage))
        diff = max_diff(results[on.name], results[off.name])
        worst[0 if step == 1 else 1] = max(worst[0 if step == 1 else 1], diff)
        if step > warmup and extra is not None:
            extras.append(extra(results[on.name], results[off.name]))
    stage_ratios = [b / a for a, b in zip(on.stage_s, off.stage_s, strict=True)]
    step_ratios = [b / a for a, b in zip(on.step_s, off.step_s, strict=True)]
    out = {
        "stage_on_s": statistics.median(on.stage_s), "stage_off_s": statistics.median(off.stage_s),
        "stage_x": statistics.median(stage_ratios), "stage_x_min": min(stage_ratios), "stage_x_max": max(stage_ratios),
        "step_on_s": statistics.median(on.step_s), "step_off_s": statistics.median(off.step_s),
        "step_x": statistics.median(step_ratios), "step_x_min": min(step_ratios), "step_x_max": max(step_ratios),
        "diff_step1": worst[0], "diff_later": worst[1],
        "equal": worst[0] <= 1e-5 and worst[1] <= 1e-3,
    }
    if extras:
        out.update({k: statistics.median(e[k] for e in extras) for k in extras[0]})
    return out


def compile_pair(flow: str, sets: Sequence[str], pass_name: str) -> tuple[Graph, Graph]:
    return compile_file(flow, parse_sets(sets)), compile_file(flow, parse_sets(sets), no_pass=[pass_name])


def cli(description: str, only: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    if only:
        p.add_argument("--only", default="", help="only the rows whose workload or placement starts with this")
    p.add_argument("--steps", type=int, default=6, help="measured steps per configuration")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def fmt(row: dict[str, Any]) -> str:
    return (f"stage {row['stage_off_s']:.3f}s -> {row['stage_on_s']:.3f}s = {row['stage_x']:.2f}x "
            f"[{row['stage_x_min']:.2f}..{row['stage_x_max']:.2f}]; step {row['step_off_s']:.3f}s -> "
            f"{row['step_on_s']:.3f}s = {row['step_x']:.2f}x [{row['step_x_min']:.2f}..{row['step_x_max']:.2f}]; "
            f"max diff {row['diff_step1']:.1e} / {row['diff_later']:.1e} ({'equal' if row['equal'] else 'DIFFERENT'})")


def save(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path:
        Path(path).write_text(json.dumps(rows, indent=2), encoding="utf-8")
