"""flowrl: RLHF algorithms as small dataflow programs, compiled to a graph and run on any backend.

Scripting API: `load(path)` / `compile_flow(text, path=...)` return the compiled `Graph`; `run(graph, ...)`
trains it; `@reward` and `@function` register Python callables that flows name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.errors import DataError, Diagnostic, ExecutionError, FlowError, RewardError
from flowrl.registry import function, reward

if TYPE_CHECKING:
    from flowrl.ir.graph import Graph
    from flowrl.runtime.runner import RunResult

__version__ = "0.1.0"


def load(path: str, overrides: dict[str, str] | None = None) -> Graph:
    """Parse, check and lower a `.flow` file; raises FlowError with every diagnostic of the file."""
    from flowrl.dsl import load as _load

    return _load(path, overrides=overrides)


def compile_flow(text: str, path: str = "<string>", overrides: dict[str, str] | None = None) -> Graph:
    """Like `load`, from text; `path` is used in diagnostics and to resolve relative data paths."""
    from flowrl.dsl import compile_flow as _compile

    return _compile(text, path=path, overrides=overrides)


def run(graph: Graph, **kwargs: Any) -> RunResult:
    """Train a compiled graph; see `flowrl.runtime.runner.run` for the options."""
    from flowrl.runtime.runner import run as _run

    return _run(graph, **kwargs)


__all__ = ["DataError", "Diagnostic", "ExecutionError", "FlowError", "RewardError", "compile_flow",
           "function", "load", "reward", "run"]
