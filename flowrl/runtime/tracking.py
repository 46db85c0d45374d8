"""Experiment trackers (`run { log = [...] }`, `flowrl run --log`): Weights & Biases, MLflow and TensorBoard as sinks
of a run's rows (`runtime.sinks`).

Each tracker receives every metric row (an evaluation's `eval/...` metrics are in the same row), the rollout samples,
and at the start of the run the flow's text, the compiled graph (text, and a drawing: .svg, or .dot without
graphviz), the resolved settings (`settings_of`: every model, data, reward, run and step setting after `--set`) and
run.json (again at the end, with its last notes). wandb and MLflow are optional extras, imported only when a run
asks for them (`require` says which extra is missing before the backend starts). Their run ids are kept in
OUT/tracking.json so a resumed run continues the same tracked runs.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_json
from flowrl.ir.signatures import PASS_KEYS

IDS = "tracking.json"  # the tracked runs' ids, by tracker (a resumed run continues them)
SETTINGS = "settings.json"
# tracker -> (the module it needs, the pip extra that installs it)
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"),
          "tensorboard": ("tensorboard", "tensorboard")}

# Draws `graph` into the folder and returns the file written (graph.svg, or graph.dot where graphviz's `dot` is
# missing); the runner's caller supplies it (drawing lives in flowrl.viz, a layer above the runtime).
Draw = Callable[[Graph, Path], Path]


@dataclass(frozen=True)
class RunInfo:
    """What a tracker is opened with."""

    out: Path  # the run directory
    project: str  # run { project }: wandb's project, MLflow's experiment
    name: str  # run { name }, or the run directory's name
    settings: Mapping[str, Any]  # settings_of(graph)
    files: tuple[Path, ...]  # the flow's text, graph.txt, its drawing, settings.json, run.json
    resume_id: str | None = None  # the tracked run to continue (a resumed flowrl run)
    tags: Mapping[str, str] = field(default_factory=dict)


class Tracker(Protocol):
    """One experiment tracker; `run_id` is what `RunInfo.resume_id` takes to continue it."""

    name: str
    run_id: str

    def log_metrics(self, step: int, row: Mapping[str, Any]) -> None: ...

    def log_samples(self, kind: str, rows: Sequence[Mapping[str, Any]], step: int) -> None: ...

    def log_files(self, paths: Sequence[Path]) -> None: ...

    def close(self, ok: bool) -> None: ...


def loggers(graph: Graph) -> tuple[str, ...]:
    """The trackers a graph's run asks for (`run { log }`, checked at check time)."""
    value = graph.run.get("log", ())
    names = (value,) if isinstance(value, str) else value if isinstance(value, tuple) else ()
    return tuple(str(n) for n in names)


def missing_extra(name: str) -> str | None:
    """The pip extra to install for tracker `name` when its package is missing, else None (nothing imported)."""
    module, extra = EXTRAS[name]
    return None if importlib.util.find_spec(module) is not None else extra


def require(names: Sequence[str]) -> None:
    """FlowError naming the extra to install for each asked-for tracker whose package is missing."""
    missing = [(n, e) for n in names if (e := missing_extra(n)) is not None]
    if missing:
        extras = ",".join(e for _, e in missing)
        raise FlowError(Diagnostic(
            f"run {{ log }} asks for {', '.join(n for n, _ in missing)}, which {'is' if len(missing) == 1 else 'are'} "
            "not installed", hint=f"pip install -e '.[{extras}]' (or `pip install 'flowrl[{extras}]'`), "
                                  "or leave it out of `log` / `--log`"))


def settings_of(graph: Graph) -> dict[str, Any]:
    """The run's settings as one dict (the graph's, so `--set` overrides are applied): each model's, data set's,
    reward's and step node's (a `use`'s parameters are its nodes' attributes), and the run block."""
    j = to_json(graph)
    options = {m.name: dict(m.options) for m in graph.models}
    return json.loads(json.dumps({
        "flow": graph.flow, "template": graph.template,
        "model": {m["name"]: {**{k: v for k, v in m.items() if k not in ("name", "loc", "config")}, **m["config"],
                              **options[m["name"]]} for m in j["models"]},
        "data": {d["name"]: {"kind": d["kind"], "path": d["path"], **d["options"]} for d in j["data"]},
        "reward": {r["name"]: {"target": r["target"], "kind": r["kind"], **r["options"]} for r in j["rewards"]},
        "step": {n["id"]: {"op": n["op"], **({"model": n["model"]} if n["model"] else {}),
                           **{k: v for k, v in n["attrs"].items() if k not in PASS_KEYS}} for n in j["nodes"]},
        "run": j["run"],
    }, default=str))


def flat(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"actor": {"lr": 1e-3}}} -> {"model.actor.lr": 1e-3} (MLflow's params are flat)."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """A row's finite numeric metrics (not `step`)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))}


def table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, data) of `rows`: the columns in order of first appearance, a cell that is not a plain value as its
    JSON text (a tracker's table holds strings and numbers)."""
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    cell: Callable[[Any], Any] = lambda v: v if v is None or isinstance(v, (str, int, float, bool)) \
        else json.dumps(v, default=str)  # noqa: E731
    return columns, [[cell(r.get(c)) for c in columns] for r in rows]


def read_ids(out: Path) -> dict[str, str]:
    path = out / IDS
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else {}


def write_ids(out: Path, trackers: Sequence[Tracker]) -> None:
    (out / IDS).write_text(json.dumps({t.name: t.run_id for t in trackers}, indent=2), encoding="utf-8")
