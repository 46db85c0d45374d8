"""The one compile entry point: flow text or file -> checked graph -> the selected passes (what `flowrl compile`,
`flowrl run`, `flowrl viz` and `flowrl.load` all call).

Pass selection: `passes=None` runs the default passes, a sequence runs exactly those (`[]`: the graph as
written); `no_pass` switches defaults off and `with_pass` switches on passes that are off by default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from flowrl.dsl.stages import Pipeline
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph


def compile_file(path: str, overrides: Mapping[str, str] | None = None, *, passes: Sequence[str] | None = None,
                 no_pass: Sequence[str] = (), with_pass: Sequence[str] = ()) -> Graph:
    """Parse, check and lower a `.flow` file (FlowError with every diagnostic of the file), then run passes."""
    from flowrl.dsl import load

    return optimize(load(path, overrides=overrides), passes=passes, no_pass=no_pass, with_pass=with_pass)


def compile_text(text: str, path: str = "<string>", overrides: Mapping[str, str] | None = None, *,
                 passes: Sequence[str] | None = None, no_pass: Sequence[str] = (),
                 with_pass: Sequence[str] = ()) -> Graph:
    """Like `compile_file`, from text; `path` is used in diagnostics and to resolve relative data paths."""
    from flowrl.dsl import compile_flow

    return optimize(compile_flow(text, path=path, overrides=overrides), passes=passes, no_pass=no_pass,
                    with_pass=with_pass)


def compile_any(path: str, overrides: Mapping[str, str] | None = None, *, passes: Sequence[str] | None = None,
                no_pass: Sequence[str] = (), with_pass: Sequence[str] = ()) -> Graph | Pipeline:
    """Like `compile_file`; a flow with `stage` blocks gives a Pipeline, the passes run on each stage's graph."""
    from flowrl.dsl import load_any

    return optimize_any(load_any(path, overrides=overrides), passes=passes, no_pass=no_pass, with_pass=with_pass)


def optimize_any(flow: Graph | Pipeline, *, passes: Sequence[str] | None = None, no_pass: Sequence[str] = (),
                 with_pass: Sequence[str] = ()) -> Graph | Pipeline:
    """`optimize` a graph, or each stage's graph of a pipeline."""
    if isinstance(flow, Graph):
        return optimize(flow, passes=passes, no_pass=no_pass, with_pass=with_pass)
    stages = tuple(replace(s, graph=optimize(s.graph, passes=passes, no_pass=no_pass, with_pass=with_pass))
                   for s in flow.stages)
    return replace(flow, stages=stages)


def optimize(graph: Graph, *, passes: Sequence[str] | None = None, no_pass: Sequence[str] = (),
             with_pass: Sequence[str] = ()) -> Graph:
    from flowrl.passes import PassSelectionError, run_passes, select

    try:
        chosen = select(list(passes) if passes is not None else None, list(no_pass), list(with_pass))
    except PassSelectionError as e:
        raise FlowError(str(e)) from None
    return run_passes(graph, chosen)


def parse_sets(items: Sequence[str]) -> dict[str, str]:
    """`--set KEY=VALUE` items as overrides."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlowError(f"--set expects KEY=VALUE, got '{item}'")
        out[key.strip()] = value.strip()
    return out
