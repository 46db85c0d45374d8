"""What `flowrl export RUN_DIR` exports (flowrl.runtime): the run, or the stage of a pipeline's run, that holds the
model; the checkpoint of the step asked for (default: the last); the model (default: the policy the run trains). A
miss of each is an error a user can act on (a did-you-mean for a model or stage name, the steps there are). The
export itself is flowrl.runtime.export's.

In a pipeline's run (OUT/pipeline.json, OUT/stages/NAME/), the model is taken from the last stage that holds it and
has a checkpoint (a model keeps its weights from the last stage that had it, flowrl.runtime.pipeline), or from
`stage`; `step` counts that stage's own steps, as its checkpoints do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.dsl.diagnostics import did_you_mean, one_of
from flowrl.errors import Diagnostic, FlowError
from flowrl.models.export import Exported, check_out
from flowrl.runtime.export import default_model, export_checkpoint, trained_models
from flowrl.runtime.pipeline import STATE, stage_dir
from flowrl.runtime.runner import CKPT_DIR

__all__ = ["RunModel", "export_run", "find_model"]


@dataclass(frozen=True)
class RunModel:
    """A model of a run at one of its checkpoints: what `export_run` writes."""

    run_dir: Path  # the run's directory (a pipeline's stage's: OUT/stages/NAME)
    model: str
    checkpoint: Path
    step: int
    stage: str | None  # the pipeline's stage, or None for a run of one graph
    graph: Mapping[str, Any]  # the run's graph.json


def export_run(run_dir: str | Path, out: str | Path, *, model: str | None = None, step: int | None = None,
               stage: str | None = None, overwrite: bool = False, adapter: bool = False) -> tuple[RunModel, Exported]:
    """Write `model` (default: the policy the run trains) of the run in `run_dir` at `step` (default: its last
    checkpoint) to `out` as a Hugging Face directory (flowrl.models.export); `adapter`: a LoRA model's adapters as a
    peft adapter directory instead of merged into its base."""
    found = find_model(run_dir, model=model, step=step, stage=stage)
    check_out(Path(out), overwrite)  # before the checkpoint is read
    return found, export_checkpoint(found.graph, found.checkpoint, found.model, out, overwrite=overwrite,
                                    adapter=adapter)


def find_model(run_dir: str | Path, *, model: str | None = None, step: int | None = None,
               stage: str | None = None) -> RunModel:
    """The run, checkpoint and model `export_run` takes (see the module docstring); `FlowError` for each miss."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FlowError(Diagnostic(f"no run directory at {root}", hint="give the --out directory of `flowrl run`"))
    if (root / STATE).is_file():
        return _in_pipeline(root, model, step, stage)
    if stage is not None:
        raise FlowError(Diagnostic(f"--stage picks a stage of a pipeline's run; {root} holds one run "
                                   f"(no {STATE})"))
    graph = _graph(root)
    if graph is None:
        raise FlowError(Diagnostic(f"{root} holds no run (no graph.json)",
                                   hint="give the --out directory of `flowrl run`"))
    name = model if model is not None else default_model(graph)
    names = [str(m["name"]) for m in graph.get("models", [])]
    if name is None or name not in names:
        raise FlowError(Diagnostic(f"no model named `{name}` in the run in {root} (its models: {one_of(names)})",
                                   hint=did_you_mean(str(name), names)))
    return _at_step(root, graph, name, step, None)


def _in_pipeline(root: Path, model: str | None, step: int | None, stage: str | None) -> RunModel:
    state = json.loads((root / STATE).read_text(encoding="utf-8"))
    names = [str(s["name"]) for s in state.get("stages", [])]
    if stage is not None and stage not in names:
        raise FlowError(Diagnostic(f"no stage named `{stage}` in the pipeline's run in {root} (its stages: "
                                   f"{one_of(names)})", hint=did_you_mean(stage, names)))
    # the stages that ran far enough to write a checkpoint, the last first
    ran = [(n, g) for n in reversed(names if stage is None else [stage])
           if (g := _graph(stage_dir(root, n))) is not None and _checkpoints(stage_dir(root, n))]
    if not ran:
        where = f"stage `{stage}`" if stage is not None else "no stage"
        raise FlowError(Diagnostic(f"{where} of the pipeline's run in {root} has written a checkpoint yet",
                                   hint="a stage writes one every `checkpoint_every` steps and at its last step"))
    if model is None:
        policies = [m for _, g in ran for m in trained_models(g)
                    if any(e["name"] == m and e["role"] == "policy" for e in g.get("models", []))]
        model = policies[0] if policies else default_model(ran[0][1])
    holding = [(n, g) for n, g in ran if any(e["name"] == model for e in g.get("models", []))]
    if not holding:
        every = sorted({str(e["name"]) for _, g in ran for e in g.get("models", [])})
        raise FlowError(Diagnostic(f"no model named `{model}` in {'stage `' + stage + '` of ' if stage else ''}the "
                                   f"pipeline's run in {root} (its models: {one_of(every)})",
                                   hint=did_you_mean(str(model), every)))
    name, graph = holding[0]
    return _at_step(stage_dir(root, name), graph, str(model), step, name)


def _at_step(run_dir: Path, graph: Mapping[str, Any], model: str, step: int | None, stage: str | None) -> RunModel:
    steps = _checkpoints(run_dir)
    what = f"stage `{stage}` ({run_dir})" if stage is not None else str(run_dir)
    if not steps:
        raise FlowError(Diagnostic(f"{what} holds no checkpoint ({CKPT_DIR}/step_*.pt)",
                                   hint="a run writes one every `checkpoint_every` steps and at its last step"))
    if step is not None and step not in steps:
        shown = ", ".join(map(str, list(steps)[-10:]))
        raise FlowError(Diagnostic(f"{what} holds no checkpoint of step {step} (it has steps {shown})",
                                   hint="leave --step out for the last"))
    chosen = max(steps) if step is None else step
    return RunModel(run_dir, model, steps[chosen], chosen, stage, graph)


def _checkpoints(run_dir: Path) -> dict[int, Path]:
    """Step -> checkpoint of a run's directory (runner._save_checkpoint's step_NNNNNN.pt), by step."""
    found = {int(p.stem.removeprefix("step_")): p for p in (run_dir / CKPT_DIR).glob("step_*.pt")
             if p.stem.removeprefix("step_").isdigit()}
    return dict(sorted(found.items()))


def _graph(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "graph.json"
    if not path.is_file():
        return None
    body = json.loads(path.read_text(encoding="utf-8"))
    return body if isinstance(body, dict) else None
