"""The command line's verbs on a flow with `stage` blocks (a `Pipeline`): check, compile, run and timeline each
stage; `flowrl.cli` hands a pipeline here and keeps its single-graph path as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowrl.dsl.stages import Pipeline, Stage
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph


def check(f: str, pipe: Pipeline, notes: Callable[[Graph], list[str]],
          warnings: Callable[[Graph], list[Diagnostic]] | None) -> None:
    """`flowrl check` on a pipeline that compiled: ok, its warnings, then each stage's notes and (with --backend)
    what that backend cannot do of it."""
    from flowrl.compiler import optimize

    print(f"{f}: ok ({len(pipe.stages)} stages: {', '.join(pipe.names)})")
    for w in pipe.warnings:
        print(w.render(), file=sys.stderr)
    for s in pipe.stages:
        optimized = optimize(s.graph)
        for note in notes(optimized):
            print(f"{f}: stage {s.name}: note: {note}")
        for w in warnings(optimized) if warnings is not None else []:
            print(f"{f}: stage {s.name}: {w.render()}", file=sys.stderr)


def compile_text(pipe: Pipeline, as_json: bool, explain: Callable[[Graph], str] | None) -> str:
    """Each stage's graph under a `stage NAME` header (text), or one JSON object with every stage's graph."""
    from flowrl.ir.printer import to_json, to_text

    if as_json:
        return json.dumps({"flow": pipe.flow, "path": pipe.path,
                           "stages": [{"name": s.name, "graph": to_json(s.graph)} for s in pipe.stages]}, indent=2)
    parts = []
    for s in pipe.stages:
        body = to_text(s.graph)
        if explain is not None:
            body += explain(s.graph) + "\n"
        parts.append(f"stage {s.name}  ({s.steps} steps)\n" + "".join(f"  {line}\n" if line else "\n"
                                                                      for line in body.splitlines()))
    return "\n".join(parts)


def run(args: argparse.Namespace, pipe: Pipeline, out: Path, warnings: Callable[[Graph], list[Diagnostic]],
        options: Callable[[Path], dict[str, Any]]) -> int:
    """`flowrl run` on a pipeline: a backend per stage (`options(stage_dir)` its keyword arguments), a progress
    bar per stage, `--stage NAME` for one of them."""
    from flowrl import backends
    from flowrl.runtime.pipeline import run_pipeline, stage_dir
    from flowrl.runtime.progress import Progress, summary
    from flowrl.viz import draw_into

    for w in [*pipe.warnings, *(d for s in pipe.stages for d in warnings(s.graph))]:
        print(w.render(), file=sys.stderr)

    def backend(stage: Stage) -> Any:
        return backends.make(args.backend, **options(stage_dir(out, stage.name)))

    @contextmanager
    def bar(stage: Stage) -> Iterator[Callable[[int, dict[str, Any]], None]]:
        if not args.quiet:
            i = pipe.names.index(stage.name) + 1
            print(f"stage {stage.name} ({i}/{len(pipe.stages)}): {stage.steps} steps", file=sys.stderr, flush=True)
        every = int(str(stage.run.get("log_every", 10) or 10))
        with Progress(stage.steps, enabled=not args.quiet, every=every) as shown:
            yield shown.update

    result = run_pipeline(pipe, out_dir=out, backend=backend, seed=args.seed, resume=args.resume,
                          overwrite=args.overwrite, device=args.device, only=args.stage, bar=bar,
                          draw=draw_into)
    for name in pipe.names:
        rows = [r for r in result.metrics if r["stage"] == name][-5:]
        if rows:
            print(f"stage {name}: {rows[-1]['stage_step']} steps, {summary(rows)}")
    skipped = [n for n in pipe.names if n not in result.ran and (args.stage is None or n == args.stage)]
    if skipped:
        print(f"skipped (finished earlier): {', '.join(skipped)}")
    print(f"done: ran {', '.join(result.ran) or 'no stage'}; outputs in {out}")
    return 0


def timeline(run_dir: Path, output: str, stage: str | None, last_steps: int) -> list[Path]:
    """`flowrl timeline` on a pipeline's run directory: one stage's (`stage`), or every stage's that ran, each to
    OUT with the stage's name before the suffix."""
    from flowrl.viz.timeline import timeline as draw

    state = json.loads((run_dir / "pipeline.json").read_text(encoding="utf-8"))
    names = [s["name"] for s in state["stages"]]
    if stage is not None and stage not in names:
        from flowrl.dsl.diagnostics import did_you_mean

        raise FlowError(Diagnostic(f"no stage named `{stage}` in {run_dir}",
                                   hint=did_you_mean(stage, names) or f"stages: {', '.join(names)}"))
    ran = [n for n in names if (run_dir / "stages" / n / "trace.json").exists()]
    chosen = [stage] if stage is not None else ran
    if not chosen:
        raise FlowError(Diagnostic(f"no stage of {run_dir} has run yet (no stages/NAME/trace.json)"))
    out = Path(output)
    return [draw(run_dir / "stages" / n, out if stage is not None else out.with_name(f"{out.stem}-{n}{out.suffix}"),
                 last_steps=last_steps) for n in chosen]
