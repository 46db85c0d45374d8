"""`run()`: a compiled graph to a finished run directory — the loop that `flowrl run` calls.

It starts the backend's worker groups, drives the controller step by step, sends each step's row to the sinks
(`runtime.sinks`: metrics.jsonl, lengths.jsonl, TensorBoard), writes the trace and checkpoints as it goes (so an
interrupted run loses at most `checkpoint_every` steps), and resumes. `run` reads top to bottom; a `_Session` holds
what a run in progress has started (setup, one step, a checkpoint, teardown).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowrl.data.jsonl import PromptLoader, split_held_out
from flowrl.data.paths import columns_of, with_columns
from flowrl.data.tables import read_data
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_json_text, to_text
from flowrl.runtime import carry, cost, interrupt, report, tracking
from flowrl.runtime.ahead import Ahead, async_node
from flowrl.runtime.controller import Controller, Span
from flowrl.runtime.evaluation import EvalStep, Evaluations
from flowrl.runtime.export import EXPORT_DIR, export_at_checkpoint
from flowrl.runtime.overlong import Overlong, filter_overlong
from flowrl.runtime.protocol import Backend, WorkerGroup
from flowrl.runtime.samples import SAMPLES
from flowrl.runtime.scoring import Scorer, make_scorer
from flowrl.runtime.sinks import METRICS, TRACE, StepSinks

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
        rows = with_columns(rows[:limit] if limit else rows, columns_of(opts.get("columns")), d.path)
        train, held = split_held_out(rows, opts.get("held_out"), d.path)
        loaders[d.name] = PromptLoader(train, int(opts.get("batch", 8)), bool(opts.get("shuffle", True)), seed, key,
                                       held_out=held)
    return loaders


def run(graph: Graph, *, out_dir: str | Path, backend: Backend, steps: int | None = None,
        seed: int | None = None, resume: bool = False, overwrite: bool = False, device: str | None = None,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        init_weights: Mapping[str, Mapping[str, Any]] | None = None, draw: tracking.Draw | None = None) -> RunResult:
    """Train `graph` on `backend` (not started yet; shut down at the end, whatever happens) for `steps` steps
    (default: `run { steps }`) and return the metrics of every step. `flowrl.run` makes the backend by name.

    A directory that already holds a run is continued with `resume=True` or replaced with `overwrite=True`;
    otherwise it is an error, so an earlier run's checkpoints are never mixed up or lost.

    `init_weights` (model -> weights, as `runtime.carry` fits them) replace models' initial weights right after the
    backend starts, before a checkpoint is resumed: a pipeline's stage starts from the stages before it.

    `run { log }` sends every row, the samples and the run's files to experiment trackers too (`runtime.tracking`;
    a missing extra is an error before the backend starts); `draw` draws the graph for them (`flowrl.run` gives
    flowrl.viz's)."""
    out = Path(out_dir)
    tracking.require(tracking.loggers(graph))
    _claim(out, resume, overwrite)
    plan = _plan(graph, steps, seed, device)
    torch.manual_seed(plan.seed)
    (out / "graph.txt").write_text(to_text(graph), encoding="utf-8")
    (out / "graph.json").write_text(to_json_text(graph), encoding="utf-8")
    loaders = loaders_of(graph, plan.seed)
    overlong = filter_overlong(graph, loaders)  # said now and kept in run.json (verl's filter_overlong_prompts)
    for left_out in overlong:
        print(f"warning: {left_out.message()}", file=sys.stderr, flush=True)
    session = _Session(graph, backend, out, plan, loaders, draw, overlong)
    try:
        session.start(resume, init_weights)
        at_start = session.evaluate_at_start()  # `eval { at_start = true }`: a step-0 row of its own
        if at_start is not None and on_step is not None:
            on_step(0, at_start)
        for step in range(session.first, plan.total + 1):
            row = session.step(step)
            if on_step is not None:
                on_step(step, row)
            if (plan.every and step % plan.every == 0) or step == plan.total:
                session.checkpoint(step)
        session.finish()
    finally:
        session.close()
    return session.result()


@dataclass(frozen=True)
class _Plan:
    """The run's settings: `run { ... }` with the caller's overrides applied."""

    total: int  # the last step
    seed: int
    device: str
    every: int  # checkpoint interval (0: only at the last step)


def _plan(graph: Graph, steps: int | None, seed: int | None, device: str | None) -> _Plan:
    settings: dict[str, Any] = dict(graph.run)
    return _Plan(total=int(steps if steps is not None else settings.get("steps", 100)),
                 seed=int(seed if seed is not None else settings.get("seed", 0)),
                 device=str(device or settings.get("device", "auto")),
                 every=int(settings.get("checkpoint_every", 0) or 0))


class _Session:
    """One run in progress: `start` (worker groups, scorers, a resumed checkpoint, the controller), `step` (one
    training step and its row through every sink), `checkpoint`, `finish` (run.json's last notes), `close` (always:
    the scorers and the backend), then `result` (reward.png, cost.json)."""

    def __init__(self, graph: Graph, backend: Backend, out: Path, plan: _Plan, loaders: dict[str, PromptLoader],
                 draw: tracking.Draw | None = None, overlong: Sequence[Overlong] = ()):
        self.graph, self.be, self.out, self.plan, self.loaders, self.draw = graph, backend, out, plan, loaders, draw
        self.t0 = time.perf_counter()
        self.rewards: dict[str, Scorer] = {}
        self.ahead: Ahead | None = None
        self.evals: Evaluations | None = None
        self.pools: list[cost.Pool] = []
        self.meter: cost.CostMeter | None = None
        self.sinks: StepSinks | None = None
        self.first = 1  # the first step this session runs (a resumed run's: its checkpoint's + 1)
        self.events: list[dict[str, Any]] = []  # trace events of the steps before a resume
        self.spans: list[Span] = []
        self.about: dict[str, Any] = {}  # run.json
        self.overlong = list(overlong)  # prompts left out as longer than the context (flowrl.runtime.overlong)
        # rows a step draws: a step on data alone (SFT, RM, DPO) shows rows/s
        self.data_rows = sum(loaders[n.id].batch for n in graph.nodes if n.op == "data" and n.id in loaders)

    def start(self, resume: bool, init_weights: Mapping[str, Mapping[str, Any]] | None) -> None:
        graph, be, out, plan = self.graph, self.be, self.out, self.plan
        self.rewards = scorers_of(graph)
        starting = time.perf_counter()
        self.groups = be.start(graph, seed=plan.seed, device=plan.device)
        starting = time.perf_counter() - starting
        self.pools = cost.pools_of(graph, self.groups)
        if init_weights:
            carry.load_into(self.groups, init_weights)
        ckpt = last_checkpoint(out) if resume else None
        kept: dict[str, Any] = {}
        if ckpt is not None:
            start, kept = _load_checkpoint(ckpt, self.groups, self.loaders)
            self.first = start + 1
            self.events = [e for e in report.load_trace(out / TRACE) if e.get("ph") == "X"
                           and e["args"]["step"] <= start]
            self.t0 -= max((e["ts"] + e["dur"]) / 1e6 for e in self.events) if self.events else 0.0
        self.about = {"flow": graph.path, "backend": be.name, "seed": plan.seed, "steps": plan.total,
                      "device": plan.device}
        if self.overlong:
            self.about["overlong_prompts"] = [o.to_json() for o in self.overlong]
        self._write_about()
        self.sinks = StepSinks(out, graph, resumed_at=self.first - 1 if ckpt is not None else None, draw=self.draw)
        self.ctl = Controller(graph, self.groups, self.loaders, self.rewards, seed=plan.seed, clock_start=self.t0,
                              after_update=be.after_update)
        self.ctl.lengths.load_state_dict(kept.get("lengths", {}))
        gen = async_node(graph)
        if gen is not None and be.why_not_async:  # the graph is asynchronous, this backend can't be
            self.about["synchronous"] = f"max_staleness = {gen.attrs['max_staleness']} not applied: {be.why_not_async}"
            self._write_about()
        elif gen is not None:
            self.ahead = Ahead(self.ctl, be, first=self.first, last=plan.total, state=kept.get("ahead"))
        self.ctl.last_step = plan.total  # a preference update's held-out rows are scored at the last step too
        self.evals = Evaluations(graph, self.groups, seed=plan.seed, last=plan.total, clock_start=self.t0,
                                 asynchronous=self.ahead is not None)
        self.group_names = ["controller", *[w.name for w in graph.worker_groups]]
        self.wall0 = time.time() - time.perf_counter()  # wall clock minus perf_counter: instance tasks report wall time
        self.meter = cost.CostMeter(self.pools, starting_s=starting, clock=time.perf_counter(), wall=self.wall0,
                                    reserving=be if isinstance(be, cost.Reserving) else None)

    def evaluate_at_start(self) -> dict[str, Any] | None:
        """A fresh run's step-0 evaluations (`at_start`), their row `{"step": 0, "eval/...": ...}` sent to the sinks
        (no training step: no step time, tokens or cost); None when there are none."""
        assert self.evals is not None and self.sinks is not None  # started
        if self.first != 1 or not self.evals.due(0):
            return None
        held = self.evals.run(0)
        row: dict[str, Any] = {"step": 0, **held.metrics}
        self._log_evaluated(0, held)
        self.sinks.write(0, row)
        self.spans.extend(held.spans)
        return row

    def _log_evaluated(self, step: int, held: EvalStep) -> None:
        assert self.sinks is not None
        for name, rows in held.samples.items():  # samples.jsonl (kind "eval/NAME") and the trackers' tables
            self.sinks.log_samples(f"eval/{name}", rows, step)

    def step(self, step: int) -> dict[str, Any]:
        """Train step `step` and send its row (metrics, step time, the backend's figures, device cost) to the
        sinks; returns the row."""
        assert self.meter is not None and self.sinks is not None and self.evals is not None  # started
        be = self.be
        interrupt.check()  # Ctrl-C whose KeyboardInterrupt a library swallowed still ends the run here
        began = time.perf_counter()
        be.begin_step(step)
        res = self.ahead.step(step) if self.ahead is not None else self.ctl.step(step)
        row: dict[str, Any] = {"step": step, **res.metrics, "step_time_s": time.perf_counter() - began}
        row["tokens_per_s"] = row.get("gen_tokens", 0.0) / max(row["step_time_s"], 1e-9)
        if not row.get("gen_tokens") and self.data_rows:  # a step on data alone (SFT, RM, DPO): progress shows rows/s
            row["data_rows"] = float(self.data_rows)
        held = self.evals.run(step)  # `eval` blocks due now: after the step's own figures (its time and tokens)
        row.update(held.metrics)
        res.spans.extend(held.spans)
        self._log_evaluated(step, held)
        row.update(be.metrics())
        used = be.usage()
        row.update(self.meter.step(res.spans, time.perf_counter(), used))
        res.spans.extend(cost.instance_spans(used or [], step, self.wall0 + self.t0))
        self.sinks.write(step, row, res)
        self.spans.extend(res.spans)
        return row

    def checkpoint(self, step: int) -> None:
        """Models, optimizers, loaders and the controller's state at `step`, then the trace so far."""
        with self.ahead.paused() if self.ahead is not None else nullcontext():  # groups idle while read
            extra = {"lengths": self.ctl.lengths.state_dict()}
            if self.ahead is not None:
                extra["ahead"] = self.ahead.state_dict()
            _save_checkpoint(self.out, step, self.groups, self.loaders, extra)
        report.write_trace(self.out / TRACE, report.trace_events(self.spans, self.group_names, prior=self.events))
        export_at_checkpoint(self.graph, self.out, last_checkpoint(self.out), final=step == self.plan.total)  # run { export }

    def finish(self) -> None:
        """After the last step: run.json says which fused stages this backend ran unfused, and why; the sinks
        close."""
        if self.ctl.declined:
            self.about["unfused"] = dict(self.ctl.declined)
            self._write_about()
        if self.sinks is not None:
            self.sinks.close()

    def close(self) -> None:
        """Whatever happened: the sinks (if a step failed), the rollout thread, the scorers' processes, the
        backend."""
        if self.sinks is not None:
            self.sinks.close(ok=False)
        if self.ahead is not None:
            self.ahead.close()
        if self.evals is not None:
            self.evals.close()
        close_scorers(self.rewards)
        self.be.shutdown()

    def result(self) -> RunResult:
        """Every step's metrics (a resumed run's earlier ones too), the reward curve and the device cost."""
        metrics = report.read_metrics(self.out / METRICS)
        if metrics:
            report.plot_headline(metrics, self.out, self.graph.flow)
        # after the last step's row: reserved pools' teardown; an elastic backend's tasks (the final checkpoint,
        # released instances) and the devices its processes kept to the end
        tail = self.be.usage()
        ended = self.meter.ended(time.perf_counter(), tail) if self.meter is not None else []
        run = self.graph.run
        spent = cost.summary(metrics + ended, self.pools, float(str(run.get("gpu_hour", 0.0))),
                             float(str(run.get("cpu_hour", 0.0)))) if self.pools else {}
        if spent:
            (self.out / "cost.json").write_text(json.dumps(spent, indent=2), encoding="utf-8")
        return RunResult(self.out, metrics, self.plan.total, spent)

    def _write_about(self) -> None:
        (self.out / "run.json").write_text(json.dumps(self.about, indent=2), encoding="utf-8")


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
        for name in ("metrics.jsonl", "lengths.jsonl", "trace.json", *report.PLOTS.values(), "cost.json", SAMPLES,
                     tracking.IDS):
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
