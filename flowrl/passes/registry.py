"""The pass registry (flowrl.passes): each pass module registers its pass here under its kebab-case name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from flowrl.ir.graph import Graph


class Pass(Protocol):
    """A pass returns the rewritten graph and notes saying what it changed and why (or why it refused)."""

    def __call__(self, graph: Graph) -> tuple[Graph, list[str]]: ...


@dataclass(frozen=True)
class RegisteredPass:
    name: str  # kebab-case, as on the command line
    fn: Pass
    doc: str
    default: bool = True  # on unless switched off


REGISTRY: list[RegisteredPass] = []


def register(name: str, doc: str, *, default: bool = True) -> Callable[[Pass], Pass]:
    """Add a pass to the registry (its place in the pipeline: `builtin.PIPELINE`, see `_load_builtin`)."""

    def wrap(fn: Pass) -> Pass:
        if any(p.name == name for p in REGISTRY):
            raise ValueError(f"pass {name!r} registered twice")
        REGISTRY.append(RegisteredPass(name, fn, doc, default))
        return fn

    return wrap
