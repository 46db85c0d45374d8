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

from .ast import Module
from .lower import lower
from .parser import parse
from .templates import stdlib_names, template_source

__all__ = ["compile_flow", "load", "parse", "stdlib_names", "template_source"]


def compile_flow(text: str, path: str = "<string>", overrides: Mapping[str, str] | None = None) -> Graph:
    """Parse, check and lower flow `text`; `path` is used in messages and to resolve relative paths.

    `overrides` maps `MODEL.KEY`, `DATA.KEY`, `run.KEY` or `use.PARAM` to flow literal text (`"8"`,
    `"1e-4"`, `"true"`, `'"s"'`); they replace or add entries before anything is checked.
    """
    module: Module = parse(text, path)
    return verify(lower(module, overrides))


def load(path: str | Path, overrides: Mapping[str, str] | None = None) -> Graph:
    """Compile the flow file at `path` (a missing or unreadable file is a FlowError too)."""
    p = str(path)
    try:
        text = Path(p).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FlowError(Diagnostic(f"flow file not found: {p}")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlowError(Diagnostic(f"cannot read flow file {p}: {e}")) from None
    return compile_flow(text, p, overrides)
