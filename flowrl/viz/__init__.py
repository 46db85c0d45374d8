"""`flowrl viz`: draw a compiled flow with graphviz, at one of three stages (parsed, optimized, placed).

`render(path, output, ...)` compiles a `.flow` file and writes OUT (.svg, .png, .pdf, or .dot which needs
no graphviz binary); `render_graph(graph, output, ...)` does the same for a `Graph` already in hand.
`flowrl timeline` lives in `flowrl.viz.timeline`.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import graphviz

from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.viz.timings import Timings, load_timings
from flowrl.viz.views import STAGES, draw

FORMATS = ("svg", "png", "pdf", "dot")
INSTALL_HINT = ("install graphviz (`apt-get install graphviz` or `brew install graphviz`), "
                "or write DOT source with `-o NAME.dot`, which needs no binary")


def output_format(output: str | Path) -> str:
    """The format named by OUT's suffix; FlowError for any other suffix."""
    suffix = Path(output).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise FlowError(Diagnostic(
            f"cannot draw to '{output}': the output must end in {', '.join('.' + f for f in FORMATS)}",
            hint="for example `-o graph.svg`"))
    return suffix


def require_dot(fmt: str) -> None:
    """FlowError saying how to install graphviz when the `dot` binary is missing (not needed for .dot)."""
    if fmt != "dot" and shutil.which("dot") is None:
        raise FlowError(Diagnostic(f"drawing .{fmt} needs the graphviz `dot` program, which is not on PATH",
                                   hint=INSTALL_HINT))


def write(dot: graphviz.Digraph, output: str | Path) -> Path:
    out = Path(output)
    fmt = output_format(out)
    require_dot(fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        out.write_text(dot.source, encoding="utf-8")
        return out
    try:
        out.write_bytes(dot.pipe(format=fmt))
    except graphviz.ExecutableNotFound:
        raise FlowError(Diagnostic("graphviz's `dot` program could not be run", hint=INSTALL_HINT)) from None
    except graphviz.CalledProcessError as e:
        detail = (e.stderr or b"").decode("utf-8", "replace").strip() if isinstance(e.stderr, bytes) else ""
        raise FlowError(f"graphviz failed to draw {out}: {detail or e}") from None
    return out


def _stage(stage: str) -> str:
    if stage not in STAGES:
        raise FlowError(f"unknown stage '{stage}' (stages: {', '.join(STAGES)})")
    return stage


def render_graph(graph: Graph, output: str | Path, stage: str = "optimized",
                 timings: str | Path | Timings | None = None) -> Path:
    """Draw `graph` at `stage` into OUT. `timings` is a run directory (or loaded `Timings`)."""
    require_dot(output_format(output))
    loaded = load_timings(timings) if isinstance(timings, (str, Path)) else timings
    return write(draw(graph, _stage(stage), loaded), output)


def draw_into(graph: Graph, folder: str | Path) -> Path:
    """graph.svg (the optimized view) in `folder`, or its DOT source graph.dot where graphviz's `dot` program is
    missing: the drawing a run's experiment trackers get (`run { log }`, flowrl.runtime.tracking)."""
    fmt = "svg" if shutil.which("dot") is not None else "dot"
    return write(draw(graph, "optimized"), Path(folder) / f"graph.{fmt}")


def render(path: str, output: str | Path, stage: str = "optimized", timings: str | Path | None = None,
           sets: Sequence[str] = ()) -> Path:
    """Compile the flow at `path` (no passes for the parsed stage) and draw it into OUT; a flow with `stage`
    blocks is drawn as its stages left to right, each with its graph (`flowrl.viz.stages`)."""
    require_dot(output_format(output))  # before compiling: a wrong -o fails fast
    _stage(stage)
    from flowrl.compiler import compile_any, parse_sets
    from flowrl.dsl.stages import Pipeline
    from flowrl.viz.stages import draw_pipeline

    flow = compile_any(path, parse_sets(sets), passes=[] if stage == "parsed" else None)
    if isinstance(flow, Pipeline):
        if timings is not None:
            raise FlowError(Diagnostic("--timings colours one graph: this flow has stages",
                                       hint="stage graphs are drawn without timings; a stage's run is in "
                                            "RUN_DIR/stages/NAME"))
        return write(draw_pipeline(flow, stage), output)
    return render_graph(flow, output, stage, timings)


__all__ = ["FORMATS", "STAGES", "draw", "draw_into", "render", "render_graph", "write"]
