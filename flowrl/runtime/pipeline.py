"""`run_pipeline()`: a staged flow (`dsl.stages.Pipeline`) run stage after stage — what `flowrl run` calls for one.

Each stage is a run of its own (`runtime.runner.run`, a fresh backend) in OUT/stages/NAME/ (metrics.jsonl,
checkpoints, graph.txt, trace.json); at its end its models' weights are saved to OUT/stages/NAME/models.pt. A model
keeps its weights from the end of the last stage that had it; a model first used in a stage with `source = other`
starts from `other`'s weights at the start of that stage (a critic or reward model takes their backbone); a model
a stage declares but does not build (pass drop-reference) ends it with the weights it started with; optimizer
state does not carry over. OUT/metrics.jsonl holds every stage's rows with "stage", "stage_step" and a pipeline-wide
"step"; OUT/pipeline.json the stages, which are done, and notes.

`resume=True` skips finished stages (reading their models.pt), resumes the unfinished one from its last
checkpoint and runs the later ones: the metrics equal an uninterrupted run's. `only=NAME` runs that stage alone,
from the earlier stages' models.pt where OUT has them (else from initial weights, with a note and a warning).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowrl.dsl.stages import Pipeline, Stage
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.runtime import report
from flowrl.runtime.carry import Weights, checkpoint_weights
from flowrl.runtime.model_init import init_model
from flowrl.runtime.protocol import Backend
from flowrl.runtime.runner import last_checkpoint, run
from flowrl.runtime.tracking import Draw

STAGES_DIR = "stages"
MODELS = "models.pt"
STATE = "pipeline.json"

StepFn = Callable[[int, dict[str, Any]], None]


@dataclass(frozen=True)
class PipelineResult:
    out_dir: Path
    metrics: list[dict[str, Any]]  # every stage's rows, as OUT/metrics.jsonl holds them
    ran: tuple[str, ...]  # the stages run (or resumed) this time
    notes: tuple[str, ...] = ()


def stage_dir(out: Path, name: str) -> Path:
    return out / STAGES_DIR / name


@contextmanager
def _no_bar(stage: Stage) -> Iterator[StepFn | None]:
    yield None


def run_pipeline(pipe: Pipeline, *, out_dir: str | Path, backend: Callable[[Stage], Backend],
                 seed: int | None = None, resume: bool = False, overwrite: bool = False, device: str | None = None,
                 only: str | None = None,
                 bar: Callable[[Stage], AbstractContextManager[StepFn | None]] = _no_bar,
                 draw: Draw | None = None) -> PipelineResult:
    """Run `pipe`'s stages in order (`backend(stage)` makes each stage's backend, not started); `bar(stage)` gives
    a context whose value is called with each step's row (a progress bar per stage); `draw` draws a stage's graph
    for its experiment trackers (`runner.run`'s)."""
    out = Path(out_dir)
    order = pipe.names
    if only is not None:
        pipe.stage(only)  # a FlowError naming the stages when there is no such stage
    state = _claim(out, pipe, resume, overwrite, only)
    carried: dict[str, Weights] = {}
    before: list[dict[str, Any]] = []  # the top-level rows of the stages before the current one
    ran: list[str] = []
    notes: list[str] = list(state.get("notes", [])) if only is None else []
    offset = 0
    for stage in pipe.stages:
        sdir = stage_dir(out, stage.name)
        entry = state["stages"].setdefault(stage.name, {"steps": stage.steps, "done": False})
        if only is not None and stage.name != only:
            if order.index(stage.name) < order.index(only):
                if _finished(sdir, entry, stage):
                    carried.update(_models(sdir))
                    before.extend(_tagged(stage, offset, report.read_metrics(sdir / "metrics.jsonl")))
                else:
                    note = (f"stage `{only}` starts from initial weights for the models of stage `{stage.name}`: "
                            f"{sdir / MODELS} is missing (run it first, or the whole pipeline)")
                    notes.append(note)
                    print(f"warning: {note}", file=sys.stderr)
            elif ran:  # a later stage: what it started from has changed
                entry["done"] = False
            offset += stage.steps
            continue
        if resume and not ran and _finished(sdir, entry, stage):
            carried.update(_models(sdir))
            before.extend(_tagged(stage, offset, report.read_metrics(sdir / "metrics.jsonl")))
            offset += stage.steps
            continue
        ckpt = last_checkpoint(sdir) if resume and not ran else None
        if only is not None and ckpt is None and not overwrite and (sdir / "metrics.jsonl").exists():
            raise FlowError(Diagnostic(f"{sdir} already holds a run of stage `{only}`",
                                       hint="run it again with --overwrite, or continue it with --resume"))
        kept = [] if ckpt is None else [r for r in report.read_metrics(sdir / "metrics.jsonl")
                                        if r["step"] <= _ckpt_step(ckpt)]
        _write_rows(out / "metrics.jsonl", [*before, *_tagged(stage, offset, kept)])
        entry.update(steps=stage.steps, done=False)
        _save_state(out, pipe, state, notes)
        init = start_weights(stage.graph, carried)
        rows = _run_stage(stage, out, offset, backend(stage), init=init,
                          resume=ckpt is not None, seed=seed, device=device,
                          bar=bar, draw=draw)
        weights: dict[str, Weights] = {**checkpoint_weights(_final_checkpoint(sdir))}
        later = {m.name for s in pipe.stages[order.index(stage.name) + 1:] for m in s.graph.models}
        weights.update(unbuilt_weights(stage.graph, init, seed, later))
        _save_models(sdir, weights)
        carried.update(weights)
        before.extend(_tagged(stage, offset, rows))
        entry["done"] = True
        _save_state(out, pipe, state, notes)
        ran.append(stage.name)
        offset += stage.steps
    _write_rows(out / "metrics.jsonl", before)
    return PipelineResult(out, before, tuple(ran), tuple(notes))


def start_weights(graph: Graph, carried: Mapping[str, Weights]) -> dict[str, Weights]:
    """The weights each of `graph`'s models starts the stage from: its own from the last stage that had it, else
    (a model first used now) its `source` model's at the start of this stage; none for a model nothing came before."""
    decls = {m.name: m for m in graph.models}

    def at_start(name: str) -> Weights | None:
        if name in carried:
            return carried[name]
        source = decls[name].source_model if name in decls else None
        return at_start(source) if source is not None else None

    return {m: w for m in decls if (w := at_start(m)) is not None}


def unbuilt_weights(graph: Graph, start: Mapping[str, Weights], seed: int | None,
                    later: set[str]) -> dict[str, Weights]:
    """The weights a stage ends with for its models that no worker group built (pass drop-reference took an unread
    reference out): those it started from, as an untrained model ends its stage. One that started from nothing
    carried but `source = other`'s step-0 weights, and that a `later` stage holds, is rebuilt here on the
    controller (`init_model`), so that stage starts it from them and not from `other`'s trained ones; one
    without a source needs nothing, as a later stage rebuilds the same weights from the seed."""
    built = {m for g in graph.worker_groups for m in g.models}
    decls = {m.name: m for m in graph.models}
    out: dict[str, Weights] = {}
    for m in graph.models:
        if m.name in built:
            continue
        if m.name in start:
            out[m.name] = start[m.name]
        elif m.source_model is not None and m.name in later:
            run_seed = int(seed if seed is not None else str(graph.run.get("seed", 0)))
            module = init_model(m, decls, run_seed).module
            out[m.name] = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return out


def _run_stage(stage: Stage, out: Path, offset: int, backend: Backend, *, init: Mapping[str, Weights], resume: bool,
               seed: int | None, device: str | None,
               bar: Callable[[Stage], AbstractContextManager[StepFn | None]],
               draw: Draw | None = None) -> list[dict[str, Any]]:
    top = out / "metrics.jsonl"
    with bar(stage) as shown:
        def on_step(step: int, row: dict[str, Any]) -> None:
            report.append_metrics(top, _tagged(stage, offset, [row])[0])
            if shown is not None:
                shown(step, row)

        result = run(stage.graph, out_dir=stage_dir(out, stage.name), backend=backend, seed=seed, resume=resume,
                     overwrite=not resume, device=device, on_step=on_step, init_weights=init, draw=draw)
    return result.metrics


def _tagged(stage: Stage, offset: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stage's rows as the pipeline's metrics hold them: the pipeline-wide step, the stage and its own step."""
    return [{"step": offset + int(r["step"]), "stage": stage.name, "stage_step": int(r["step"]),
             **{k: v for k, v in r.items() if k != "step"}} for r in rows]


def _finished(sdir: Path, entry: Mapping[str, Any], stage: Stage) -> bool:
    return bool(entry.get("done")) and int(entry.get("steps", -1)) == stage.steps and (sdir / MODELS).exists()


def _models(sdir: Path) -> dict[str, Weights]:
    models: dict[str, Weights] = torch.load(sdir / MODELS, map_location="cpu", weights_only=True)
    return models


def _save_models(sdir: Path, weights: Mapping[str, Weights]) -> None:
    tmp = sdir / (MODELS + ".tmp")
    torch.save(dict(weights), tmp)
    os.replace(tmp, sdir / MODELS)


def _ckpt_step(path: Path) -> int:
    return int(path.stem.removeprefix("step_"))


def _final_checkpoint(sdir: Path) -> Path:
    ckpt = last_checkpoint(sdir)
    if ckpt is None:  # the runner writes one at the last step, always
        raise FlowError(Diagnostic(f"stage finished without a checkpoint in {sdir}"))
    return ckpt


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def _claim(out: Path, pipe: Pipeline, resume: bool, overwrite: bool, only: str | None) -> dict[str, Any]:
    """The pipeline state to continue (resume, --stage) or a fresh one; never silently over an earlier run."""
    path = out / STATE
    has_run = path.exists() or (out / "metrics.jsonl").exists()
    if resume and not path.exists():
        raise FlowError(Diagnostic(f"--resume: no pipeline run in {out} ({STATE} is missing)"))
    if has_run and (resume or only is not None):
        state: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        state["stages"] = {s["name"]: s for s in state.get("stages", [])}
        return state
    if has_run and not overwrite:
        raise FlowError(Diagnostic(f"{out} already holds a run",
                                   hint="continue it with --resume, replace it with --overwrite, "
                                        "run one stage with --stage NAME, or choose another --out"))
    if has_run:
        shutil.rmtree(out / STAGES_DIR, ignore_errors=True)
        for name in (STATE, "metrics.jsonl"):
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return {"stages": {}}


def _save_state(out: Path, pipe: Pipeline, state: Mapping[str, Any], notes: list[str]) -> None:
    stages = [{"name": s.name, "steps": int(state["stages"].get(s.name, {}).get("steps", s.steps)),
               "done": bool(state["stages"].get(s.name, {}).get("done", False)),
               "dir": str(Path(STAGES_DIR) / s.name)} for s in pipe.stages]
    body = {"flow": pipe.flow, "path": pipe.path, "stages": stages, "notes": notes}
    tmp = out / (STATE + ".tmp")
    tmp.write_text(json.dumps(body, indent=2), encoding="utf-8")
    os.replace(tmp, out / STATE)
