"""Where each finished step's row goes, one sink after another: metrics.jsonl, lengths.jsonl, TensorBoard, the
experiment trackers (`runtime.tracking`) and the rollout samples (samples.jsonl and the trackers' tables).

`runtime.runner` opens them once the run's groups have started, sends every step's row here (`write`) and closes
them at the end. An evaluation between steps sends its samples with `log_samples("eval/NAME", rows, step)` (before
the step's row is written) and puts its metrics in the step's row.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from flowrl.ir.graph import Graph
from flowrl.runtime import report
from flowrl.runtime.controller import StepResult
from flowrl.runtime.samples import SAMPLES, TRAIN, append_samples, step_samples, truncate_samples, with_kind
from flowrl.runtime.tracking import (
    SETTINGS,
    Draw,
    RunInfo,
    Tracker,
    loggers,
    read_ids,
    settings_of,
    write_ids,
)

METRICS, LENGTHS, TRACE = "metrics.jsonl", "lengths.jsonl", "trace.json"


class StepSinks:
    """The run directory's per-step outputs and the trackers `run { log }` asks for. `resumed_at`: the step a
    resumed run continues from (the rows after it go; the trackers continue their runs)."""

    def __init__(self, out: Path, graph: Graph, *, resumed_at: int | None = None, draw: Draw | None = None):
        self.out, self.graph = out, graph
        self.metrics_path, self.lengths_path, self.samples_path = out / METRICS, out / LENGTHS, out / SAMPLES
        if resumed_at is not None:  # a resumed run recomputes the steps after its checkpoint's
            report.truncate_metrics(self.metrics_path, resumed_at)
            report.truncate_metrics(self.lengths_path, resumed_at)
            truncate_samples(self.samples_path, resumed_at)
        self.k = int(str(graph.run.get("log_samples", 0) or 0))
        names = loggers(graph)
        self.tb = report.TensorBoard(out / "tb", required="tensorboard" in names)
        self.trackers: list[Tracker] = []
        self.closed = False
        if names:
            self._open(names, resumed_at is not None, draw)

    def _open(self, names: Sequence[str], resumed: bool, draw: Draw | None) -> None:
        files = self._run_files(draw)
        ids = read_ids(self.out) if resumed else {}
        run = self.graph.run
        base = RunInfo(self.out, str(run.get("project") or "flowrl"), str(run.get("name") or self.out.name),
                       settings_of(self.graph), files, tags={"flow": self.graph.flow})
        try:
            for name in names:
                if name != "tensorboard":  # the TensorBoard writer above
                    self.trackers.append(open_tracker(name, _with_id(base, ids.get(name))))
        except BaseException:
            self.close(ok=False)
            raise
        write_ids(self.out, self.trackers)
        if "tensorboard" in names:
            for path in files:
                if path.suffix != ".svg" and path.exists():
                    self.tb.text(path.name, path.read_text(encoding="utf-8"), 0)

    def _run_files(self, draw: Draw | None) -> tuple[Path, ...]:
        """The files every tracker gets at the start: the flow's text, graph.txt, the graph's drawing, the
        settings, run.json."""
        (self.out / SETTINGS).write_text(json.dumps(settings_of(self.graph), indent=2), encoding="utf-8")
        flow = Path(self.graph.path)
        drawn = draw(self.graph, self.out) if draw is not None else None
        if drawn is not None and drawn.suffix == ".dot":
            print(f"note: graphviz's `dot` is not on PATH: the trackers get the graph as {drawn.name}, not .svg",
                  file=sys.stderr)
        found = [flow] if flow.is_file() else []
        return (*found, self.out / "graph.txt", *([drawn] if drawn else []), self.out / SETTINGS,
                self.out / "run.json")

    def write(self, step: int, row: dict[str, Any], result: StepResult | None = None) -> None:
        """Step `step`'s row (and its lengths trace and first `log_samples` samples, from `result`) to every sink."""
        report.append_metrics(self.metrics_path, row)
        for trace_row in result.lengths if result is not None else ():
            report.append_metrics(self.lengths_path, trace_row)
        self.tb.log(step, row)
        if self.k and result is not None:
            samples = step_samples(self.graph, result.values, step, self.k)
            if samples:
                self.log_samples(TRAIN, samples, step)
        for t in self.trackers:
            t.log_metrics(step, row)

    def log_samples(self, kind: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """Sample rows (plain dicts: prompt, response, reward, ...) of `kind` ("train", "eval/NAME") at `step`:
        appended to samples.jsonl with their step and kind, and a table in each tracker."""
        tagged = with_kind(kind, rows, step)
        if not tagged:
            return
        append_samples(self.samples_path, tagged)
        self.tb.samples(kind, tagged, step)
        for t in self.trackers:
            t.log_samples(kind, tagged, step)

    def close(self, ok: bool = True) -> None:
        """At the end (`ok`), or after a failure: the trackers get run.json's last version and samples.jsonl, and
        their runs end as finished or failed."""
        if self.closed:
            return
        self.closed = True
        self.tb.close()
        failed: BaseException | None = None
        for t in self.trackers:  # each tracker's run ends, whatever another's did
            try:
                t.log_files([self.out / "run.json", self.samples_path])
                t.close(ok)
            except BaseException as e:
                failed = failed or e
        if failed is not None and ok:
            raise failed


def _with_id(info: RunInfo, run_id: str | None) -> RunInfo:
    return replace(info, resume_id=run_id)


def open_tracker(name: str, info: RunInfo) -> Tracker:
    """Start tracker `name` (wandb or mlflow; TensorBoard is the sinks' own writer), importing its module now."""
    if name == "wandb":
        from flowrl.runtime.track_wandb import WandbTracker

        return WandbTracker(info)
    if name == "mlflow":
        from flowrl.runtime.track_mlflow import MlflowTracker

        return MlflowTracker(info)
    raise ValueError(f"no tracker named {name!r}")
