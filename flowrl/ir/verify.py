"""Structural checks on a `Graph`, run after lowering and after every pass (like torch.fx's lint)."""

from __future__ import annotations

from flowrl.ir.graph import CONTROLLER, DISPATCH_MODES, OPS, ROLES, Graph


class GraphError(Exception):
    """An internal invariant broke (a compiler bug, not a user error); the message includes the graph."""


def verify(g: Graph) -> Graph:
    """Raise GraphError if `g` is malformed; return it unchanged otherwise (so passes can chain it)."""
    problems: list[str] = []
    models = {m.name: m for m in g.models}
    if len(models) != len(g.models):
        problems.append("duplicate model names")
    for m in g.models:
        if m.role not in ROLES:
            problems.append(f"model {m.name}: unknown role {m.role!r}")
        if m.source_model is not None and m.source_model not in models:
            problems.append(f"model {m.name}: source model {m.source_model!r} is not declared")
    groups = {w.name for w in g.worker_groups} | {CONTROLLER}
    seen: set[str] = set()
    for n in g.nodes:
        if n.id in seen:
            problems.append(f"node {n.id}: defined twice")
        if n.op not in OPS:
            problems.append(f"node {n.id}: unknown op {n.op!r}")
        if n.dispatch not in DISPATCH_MODES:
            problems.append(f"node {n.id}: unknown dispatch {n.dispatch!r}")
        if n.worker_group not in groups:
            problems.append(f"node {n.id}: worker group {n.worker_group!r} does not exist")
        if n.op in ("generate", "logprobs", "values", "score", "update") and n.model not in models:
            problems.append(f"node {n.id}: model {n.model!r} is not declared")
        if n.op in ("fn", "reward") and not n.attrs.get("fn"):
            problems.append(f"node {n.id}: {n.op} node without attrs.fn")
        for _, src in n.inputs:
            if src not in seen:  # nodes are kept in topological order
                problems.append(f"node {n.id}: input {src!r} is not defined before it")
        seen.add(n.id)
    if problems:
        from flowrl.ir.printer import to_text

        raise GraphError("invalid graph:\n  " + "\n  ".join(problems) + "\n\n" + to_text(g))
    return g
