"""The flow language front end: `.flow` text -> AST (`parse`) -> verified `flowrl.ir.Graph` (`compile_flow`).

    graph = flowrl.dsl.load("examples/grpo_arith.flow", overrides={"run.steps": "10"})

Every user mistake raises `flowrl.errors.FlowError` carrying all the diagnostics of the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.ir.verify import verify

from .ast import Module, StageDecl
from .diagnostics import Source
from .lower import lower
from .parser import parse
from .stages import Pipeline, Stage, has_stages, lower_pipeline
from .templates import leading_comment, stdlib_names, template_source, template_summary

__all__ = ["Pipeline", "Stage", "compile_any", "compile_flow", "leading_comment", "load", "load_any", "parse",
           "stdlib_names", "template_source", "template_summary"]


def compile_flow(text: str, path: str = "<string>", overrides: Mapping[str, str] | None = None) -> Graph:
    """Parse, check and lower flow `text`; `path` is used in messages and to resolve relative paths.

    `overrides` maps `MODEL.KEY`, `DATA.KEY`, `run.KEY` or `use.PARAM` to flow literal text (`"8"`,
    `"1e-4"`, `"true"`, `'"s"'`); they replace or add entries before anything is checked.
    """
    module: Module = parse(text, path)
    stage = next((d for d in module.decls if isinstance(d, StageDecl)), None)
    if stage is not None:
        raise FlowError(Source(path, text).error(
            "this flow has stages: it compiles to a pipeline of graphs, not one graph", stage.name,
            hint="`flowrl run` / `flowrl compile` take it as it is; in Python use flowrl.compiler.compile_any"))
    return verify(lower(module, overrides))


def compile_any(text: str, path: str = "<string>", overrides: Mapping[str, str] | None = None) -> Graph | Pipeline:
    """Like `compile_flow`, and a flow with `stage` blocks gives a Pipeline (a graph per stage, `dsl.stages`)."""
    module: Module = parse(text, path)
    return lower_pipeline(module, overrides) if has_stages(module) else verify(lower(module, overrides))


def load_any(path: str | Path, overrides: Mapping[str, str] | None = None) -> Graph | Pipeline:
    """Like `load`, and a flow with `stage` blocks gives a Pipeline."""
    return compile_any(_read(str(path)), str(path), overrides)


def load(path: str | Path, overrides: Mapping[str, str] | None = None) -> Graph:
    """Compile the flow file at `path` (a missing or unreadable file is a FlowError too)."""
    p = str(path)
    return compile_flow(_read(p), p, overrides)


def _read(p: str) -> str:
    try:
        text = Path(p).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FlowError(Diagnostic(f"flow file not found: {p}")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlowError(Diagnostic(f"cannot read flow file {p}: {e}")) from None
    return text
