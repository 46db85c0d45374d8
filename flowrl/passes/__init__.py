"""Graph -> Graph passes: one ordered registry, each pass switchable off and explained by `--explain`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from flowrl.ir.graph import Graph, PassRecord
from flowrl.ir.verify import verify
from flowrl.passes import builtin
from flowrl.passes.registry import REGISTRY, Pass, RegisteredPass, register

__all__ = ["REGISTRY", "Pass", "PassSelectionError", "RegisteredPass", "names", "register", "run_passes", "select"]


def _load_builtin() -> None:
    # Importing the pass modules registers them; `builtin.PIPELINE` fixes their order, whichever module a
    # caller happened to import first (passes registered elsewhere follow, in registration order).
    order = {name: i for i, name in enumerate(builtin.PIPELINE)}
    REGISTRY.sort(key=lambda p: order.get(p.name, len(order)))


def names() -> list[str]:
    _load_builtin()
    return [p.name for p in REGISTRY]


class PassSelectionError(ValueError):
    pass


def select(only: Sequence[str] | None = None, disabled: Sequence[str] = (),
           enabled: Sequence[str] = ()) -> list[RegisteredPass]:
    """The passes to run: `only` (in pipeline order) or the defaults plus `enabled`, minus `disabled`."""
    _load_builtin()
    known = {p.name for p in REGISTRY}
    for name in list(only or []) + list(disabled) + list(enabled):
        if name not in known:
            raise PassSelectionError(f"unknown pass '{name}' (passes: {', '.join(sorted(known)) or 'none'})")
    chosen = [p for p in REGISTRY if (p.name in only if only is not None else p.default or p.name in enabled)]
    return [p for p in chosen if p.name not in disabled]


def run_passes(graph: Graph, passes: Sequence[RegisteredPass]) -> Graph:
    """Run each pass, verify after each, and record what it did in `graph.passes`."""
    records = list(graph.passes)
    for p in passes:
        new, notes = p.fn(graph)
        verify(new)
        records.append(PassRecord(p.name, new != graph, tuple(notes)))
        graph = new
    return replace(graph, passes=tuple(records))
