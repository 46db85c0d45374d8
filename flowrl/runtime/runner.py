"""`run()`: a compiled graph to a finished run directory — the loop that `flowrl run` calls.

It starts the backend's worker groups, drives the controller step by step, writes metrics, the trace and
checkpoints as it goes (so an interrupted run loses at most `checkpoint_every` steps), and resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowrl.data.jsonl import PromptLoader, split_held_out
from flowrl.data.tables import read_data
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_json_text, to_text
from flowrl.runtime import carry, cost, interrupt, report
from flowrl.runtime.ahead import Ahead, async_node
from flowrl.runtime.controller import Controller, Span
from flowrl.runtime.export import EXPORT_DIR, export_at_checkpoint
from flowrl.runtime.protocol import Backend, WorkerGroup
from flowrl.runtime.scoring import Scorer, make_scorer

CKPT_DIR = "checkpoints"


@dataclass(frozen=True)
class RunResult:
    out_dir: Path
    metrics: list[dict[str, Any]]
    steps: int
    cost: dict[str, Any] = field(default_factory=dict)  # device-seconds per pool (flowrl.runtime.cost.summary)


def last_checkpoint(out_dir: Path) -> Path | None:
    found = sorted((out_dir / CKPT_DIR).glob("step_*.pt"))
    return found[-1] if found else None


def scorers_of(graph: Graph) -> dict[str, Scorer]:
    """A scorer per reward (by its target, as reward nodes name it); worker processes start now, warm by the
    first step. Close them with `close_scorers`."""
    folder = os.path.dirname(os.path.abspath(graph.path)) if graph.path else "."
    return {r.target: make_scorer(r, imports=graph.imports, folder=folder) for r in graph.rewards}


def close_scorers(scorers: Mapping[str, Scorer]) -> None:
    for s in scorers.values():
        s.close()


def loaders_of(graph: Graph, seed: int) -> dict[str, PromptLoader]:
    loaders = {}
    for d in graph.data:
        opts: dict[str, Any] = dict(d.options)
        key = str(opts.get("prompt_key", "prompt"))
        rows = read_data(d.kind, d.path, key)
        limit = int(opts.get("limit", 0) or 0)
        train, held = split_held_out(rows[:limit] if limit else rows, opts.get("held_out"), d.path)
        loaders[d.name] = PromptLoader(train, int(opts.get("batch", 8)), bool(opts.get("shuffle", True)), seed, key,
                                       held_out=held)
    return loaders


def run(graph: Graph, *, out_dir: str | Path, backend: Backend, steps: int | None = None,
        seed: int | None = None, resume: bool = False, overwrite: bool = False, device: str | None = None,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        init_weights: Mapping[str, Mapping[str, Any]] | None = None) -> RunResult:
    """Train `graph` on `backend` (not started yet; shut down at the end, whatever happens) for `steps` steps
    (default: `run { steps }`) and return the metrics of every step. `flowrl.run` makes the backend by name.

    A directory that already holds a run is continued with `resume=True` or replaced with `overwrite=True`;
    otherwise it is an error, so an earlier run's checkpoints are never mixed up or lost.

    `init_weights` (model -> weights, as `runtime.carry` fits them) replace models' initial weights right after the
    backend starts, before a checkpoint is resumed: a pipeline's stage starts from the stages before it."""
    out = Path(out_dir)
    _claim(out, resume, overwrite)
    settings: dict[str, Any] = dict(graph.run)
    total = int(steps if steps is not None else settings.get("steps", 100))
    seed = int(seed if seed is not None else settings.get("seed", 0))
    dev = str(device or settings.get("device", "auto"))
    every = int(settings.get("checkpoint_every", 0) or 0)
    torch.manual_seed(seed)

    (out / "graph.txt").write_text(to_text(graph), encoding="utf-8")
    (out / "graph.json").write_text(to_json_text(graph), encoding="utf-8")
    loaders = loaders_of(graph, seed)
    metrics_path, trace_path, lengths_path = out / "metrics.jsonl", out / "trace.json", out / "lengths.jsonl"

    be = backend
    t0 = time.perf_counter()
    rewards: dict[str, Scorer] = {}
    ahead: Ahead | None = None
    pools: list[cost.Pool] = []
    meter: cost.CostMeter | None = None
    try:
        rewards = scorers_of(graph)
        starting = time.perf_counter()
        groups = be.start(graph, seed=seed, device=dev)
        starting = time.perf_counter() - starting
        pools = cost.pools_of(graph, groups)
        if init_weights:
            carry.load_into(groups, init_weights)
        start = 0
        events: list[dict[str, Any]] = []
        ckpt = last_checkpoint(out) if resume else None
        kept: dict[str, Any] = {}
        if ckpt is not None:
            start, kept = _load_checkpoint(ckpt, groups, loaders)
            report.truncate_metrics(metrics_path, start)
            report.truncate_metrics(lengths_path, start)
            events = [e for e in report.load_trace(trace_path) if e.get("ph") == "X" and e["args"]["step"] <= start]
            t0 -= max((e["ts"] + e["dur"]) / 1e6 for e in events if e.get("ph") == "X") if events else 0.0
        about: dict[str, Any] = {"flow": graph.path, "backend": be.name, "seed": seed, "steps": total, "device": dev}
        (out / "run.json").write_text(json.dumps(about, indent=2), encoding="utf-8")
        ctl = Controller(graph, groups, loaders, rewards, seed=seed, clock_start=t0, after_update=be.after_update)
        ctl.lengths.load_state_dict(kept.get("lengths", {}))
        gen = async_node(graph)
        if gen is not None and be.why_not_async:  # the graph is asynchronous, this backend can't be
            about["synchronous"] = f"max_staleness = {gen.attrs['max_staleness']} not applied: {be.why_not_async}"
            (out / "run.json").write_text(json.dumps(about, indent=2), encoding="utf-8")
        elif gen is not None:
            ahead = Ahead(ctl, be, first=start + 1, last=total, state=kept.get("ahead"))
        tb = report.TensorBoard(out / "tb")
        group_names = ["controller", *[w.name for w in graph.worker_groups]]
        spans: list[Span] = []
        wall0 = time.time() - time.perf_counter()  # wall clock minus perf_counter: instance tasks report wall time
        meter = cost.CostMeter(pools, starting_s=starting, clock=time.perf_counter(), wall=wall0,
                               reserving=be if isinstance(be, cost.Reserving) else None)
        for step in range(start + 1, total + 1):
            interrupt.check()  # Ctrl-C whose KeyboardInterrupt a library swallowed still ends the run here
            began = time.perf_counter()
            be.begin_step(step)
            res = ahead.step(step) if ahead is not None else ctl.step(step)
            row: dict[str, Any] = {"step": step, **res.metrics, "step_time_s": time.perf_counter() - began}
            row["tokens_per_s"] = row.get("gen_tokens", 0.0) / max(row["step_time_s"], 1e-9)
            row.update(be.metrics())
            used = be.usage()
            row.update(meter.step(res.spans, time.perf_counter(), used))
            res.spans.extend(cost.instance_spans(used or [], step, wall0 + t0))
            report.append_metrics(metrics_path, row)
            for trace_row in res.lengths:
                report.append_metrics(lengths_path, trace_row)
            tb.log(step, row)
            spans.extend(res.spans)
            if on_step is not None:
                on_step(step, row)
            if (every and step % every == 0) or step == total:
                with ahead.paused() if ahead is not None else nullcontext():  # groups idle while read
                    extra = {"lengths": ctl.lengths.state_dict()}
                    if ahead is not None:
                        extra["ahead"] = ahead.state_dict()
                    _save_checkpoint(out, step, groups, loaders, extra)
                report.write_trace(trace_path, report.trace_events(spans, group_names, prior=events))
                export_at_checkpoint(graph, out, last_checkpoint(out), final=step == total)  # run { export }
        tb.close()
        if ctl.declined:  # fused stages this backend ran unfused, and why
            about["unfused"] = dict(ctl.declined)
            (out / "run.json").write_text(json.dumps(about, indent=2), encoding="utf-8")
    finally:
        if ahead is not None:
            ahead.close()
        close_scorers(rewards)
        be.shutdown()
    metrics = report.read_metrics(metrics_path)
    if metrics:
        report.plot_rewards(metrics, out / "reward.png", graph.flow)
    # after the last step's row: reserved pools' teardown; an elastic backend's tasks (the final checkpoint,
    # released instances) and the devices its processes kept to the end
    tail = be.usage()
    ended = meter.ended(time.perf_counter(), tail) if meter is not None else []
    spent = cost.summary(metrics + ended, pools, float(str(graph.run.get("gpu_hour", 0.0))),
                         float(str(graph.run.get("cpu_hour", 0.0)))) if pools else {}
    if spent:
        (out / "cost.json").write_text(json.dumps(spent, indent=2), encoding="utf-8")
    return RunResult(out, metrics, total, spent)


def _claim(out: Path, resume: bool, overwrite: bool) -> None:
    has_run = last_checkpoint(out) is not None or (out / "metrics.jsonl").exists()
    if resume and last_checkpoint(out) is None:
        raise FlowError(Diagnostic(f"--resume: no checkpoints in {out}"))
    if has_run and not resume:
        if not overwrite:
            raise FlowError(Diagnostic(f"{out} already holds a run",
                                       hint="continue it with --resume, replace it with --overwrite, "
                                            "or choose another --out"))
        shutil.rmtree(out / CKPT_DIR, ignore_errors=True)
        for name in ("metrics.jsonl", "lengths.jsonl", "trace.json", "reward.png", "cost.json"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "tb", ignore_errors=True)
        shutil.rmtree(out / EXPORT_DIR, ignore_errors=True)  # the replaced run's `run { export }`
    out.mkdir(parents=True, exist_ok=True)


def _save_checkpoint(out: Path, step: int, groups: dict[str, WorkerGroup], loaders: dict[str, PromptLoader],
                     extra: Mapping[str, Any]) -> None:
    """Models, optimizers, data-loader positions, and `extra`: the length predictors' history ("lengths") and an
    asynchronous run's queue, versions and pending snapshots ("ahead"). Sampling RNG is derived from (seed,
    step), so the step number restores it. Written to a temp file and renamed so a crash never leaves a torn
    checkpoint."""
    state = {
        "step": step,
        "groups": {name: g.state_dict() for name, g in groups.items()},
        "loaders": {name: ld.state_dict() for name, ld in loaders.items()},
        **extra,
    }
    path = out / CKPT_DIR / f"step_{step:06d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, groups: dict[str, WorkerGroup],
                     loaders: dict[str, PromptLoader]) -> tuple[int, dict[str, Any]]:
    """Restores groups and loaders; returns the step and what else was kept ("lengths", "ahead"; absent in
    checkpoints written before they were)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    for name, g in groups.items():
        g.load_state_dict(state["groups"][name])
    for name, ld in loaders.items():
        ld.load_state_dict(state["loaders"][name])
    return int(state["step"]), {k: state[k] for k in ("lengths", "ahead") if k in state}
