"""flowrl: RLHF algorithms as small dataflow programs, compiled to a graph and run on any backend.

Scripting API: `load(path)` / `compile_flow(text, path=...)` return the compiled `Graph` after the default
passes (as `flowrl run` does; `passes=False` or `no_pass=[...]` to leave them out); `run(graph, ...)` trains it;
`evaluate(run_dir, data=...)` scores a run's policy on held-out prompts (`flowrl eval`); `@reward` and `@function`
register Python callables that flows name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.errors import DataError, Diagnostic, ExecutionError, FlowError, RewardError
from flowrl.registry import function, reward

if TYPE_CHECKING:
    from flowrl.ir.graph import Graph
    from flowrl.runtime.batch import Batch
    from flowrl.runtime.eval_run import Evaluated
    from flowrl.runtime.protocol import Backend
    from flowrl.runtime.runner import RunResult

__version__ = "0.1.0"

# An override's value: flow literal text as `--set` takes it (`"8"`, `"1e-4"`, `'"tiny:gpt2"'`, `"2..16"`), or a
# Python number, bool or None, written as the flow would write it.
Value = str | bool | int | float | None


def _flow_text(overrides: Mapping[str, Value] | None) -> dict[str, str] | None:
    if overrides is None:
        return None
    out = {}
    for key, value in overrides.items():
        if isinstance(value, bool) or value is None:
            out[key] = {True: "true", False: "false", None: "none"}[value]
        elif isinstance(value, (int, float)):
            out[key] = repr(value)
        elif isinstance(value, str):
            out[key] = value
        else:
            raise FlowError(Diagnostic(f"override `{key}`: a {type(value).__name__} is not a flow value",
                                       hint="a number, a bool, None, or flow literal text as a string"))
    return out


def load(path: str, overrides: Mapping[str, Value] | None = None, *, passes: bool = True,
         no_pass: Sequence[str] = ()) -> Graph:
    """Parse, check and lower a `.flow` file with `overrides` (`--set`'s keys: `{"run.steps": 50, "actor.lr": 3e-4}`),
    then run the default passes but `no_pass` (what `flowrl run` executes; `passes=False` returns the graph as
    written). Raises FlowError with every diagnostic of the file."""
    from flowrl.compiler import compile_file

    return compile_file(path, _flow_text(overrides), passes=None if passes else [], no_pass=no_pass)


def compile_flow(text: str, path: str = "<string>", overrides: Mapping[str, Value] | None = None, *,
                 passes: bool = True, no_pass: Sequence[str] = ()) -> Graph:
    """Like `load`, from text; `path` is used in diagnostics and to resolve relative data paths."""
    from flowrl.compiler import compile_text

    return compile_text(text, path, _flow_text(overrides), passes=None if passes else [], no_pass=no_pass)


def run(graph: Graph, *, backend: str | Backend = "local", backend_options: dict[str, Any] | None = None,
        **kwargs: Any) -> RunResult:
    """Train a compiled graph on `backend` (a name from `flowrl.backends.names()`, made with `backend_options`,
    or a Backend not started yet); see `flowrl.runtime.runner.run` for the other options."""
    from flowrl import backends
    from flowrl.runtime.runner import run as _run

    be = backends.make(backend, **(backend_options or {})) if isinstance(backend, str) else backend
    kwargs.setdefault("draw", _draw)
    return _run(graph, backend=be, **kwargs)


def evaluate(run_dir: str, *, data: str, **kwargs: Any) -> Evaluated:
    """A run's policy (its last checkpoint; `step=S`, or `init=True` for the step-0 weights) evaluated on `data` as
    an `eval` block evaluates: `.metrics` holds mean@K, pass@k, maj@K, `.samples` every answer scored. Keywords:
    `reward`, `model`, `n`, `temperature`, `max_tokens`, `samples` (a JSONL path), `device`
    (see `flowrl.runtime.eval_run.evaluate`)."""
    from flowrl.runtime.eval_run import evaluate as _evaluate

    return _evaluate(run_dir, data=data, **kwargs)
def _draw(graph: Graph, folder: Path) -> Path:
    """The graph's drawing for a run's trackers (flowrl.viz, imported only when a run has trackers)."""
    from flowrl.viz import draw_into

    return draw_into(graph, folder)


def __getattr__(name: str) -> Any:
    # `flowrl.Batch` is imported on first use, so that `import flowrl` (and the CLI's `check`) stays free of torch.
    if name == "Batch":
        from flowrl.runtime.batch import Batch

        return Batch
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


__all__ = ["Batch", "DataError", "Diagnostic", "ExecutionError", "FlowError", "RewardError", "compile_flow",
           "evaluate", "function", "load", "reward", "run"]
