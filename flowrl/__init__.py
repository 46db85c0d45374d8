"""flowrl: RLHF algorithms as small dataflow programs, compiled to a graph and run on any backend.

Scripting API: `load(path)` / `compile_flow(text, path=...)` return the compiled `Graph` after the default
passes (as `flowrl run` does; `passes=False` or `no_pass=[...]` to leave them out); `run(graph, ...)` trains it; `@reward` and `@function` register Python callables that flows name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowrl.errors import DataError, Diagnostic, ExecutionError, FlowError, RewardError
from flowrl.registry import function, reward

if TYPE_CHECKING:
    from flowrl.ir.graph import Graph
    from flowrl.runtime.runner import RunResult

__version__ = "0.1.0"


def load(path: str, overrides: dict[str, str] | None = None, *, passes: bool = True,
         no_pass: Sequence[str] = ()) -> Graph:
    """Parse, check and lower a `.flow` file, then run the default passes but `no_pass` (what `flowrl run`
    executes; `passes=False` returns the graph as written). Raises FlowError with every diagnostic of the file."""
    from flowrl.dsl import load as _load

    return _optimize(_load(path, overrides=overrides), passes, no_pass)


def compile_flow(text: str, path: str = "<string>", overrides: dict[str, str] | None = None, *,
                 passes: bool = True, no_pass: Sequence[str] = ()) -> Graph:
    """Like `load`, from text; `path` is used in diagnostics and to resolve relative data paths."""
    from flowrl.dsl import compile_flow as _compile

    return _optimize(_compile(text, path=path, overrides=overrides), passes, no_pass)


def _optimize(graph: Graph, passes: bool, no_pass: Sequence[str]) -> Graph:
    if not passes:
        return graph
    from flowrl.passes import PassSelectionError, run_passes, select

    try:
        chosen = select(None, list(no_pass))
    except PassSelectionError as e:
        raise FlowError(str(e)) from None
    return run_passes(graph, chosen)


def run(graph: Graph, **kwargs: Any) -> RunResult:
    """Train a compiled graph; see `flowrl.runtime.runner.run` for the options."""
    from flowrl.runtime.runner import run as _run

    return _run(graph, **kwargs)


__all__ = ["DataError", "Diagnostic", "ExecutionError", "FlowError", "RewardError", "compile_flow",
           "function", "load", "reward", "run"]
