"""A pipeline (a flow with `stage` blocks) drawn with graphviz: its stages left to right, one cluster each, holding
that stage's graph as `flowrl viz` draws a single graph (parsed, optimized or placed), joined by `then` arrows.

Stages reuse node names (`rollout` in two stages), so each cluster's names get the stage as a prefix (`_Prefixed`).
"""

from __future__ import annotations

from typing import Any

import graphviz

from flowrl.dsl.stages import Pipeline
from flowrl.viz import style
from flowrl.viz.views import CONTROLLER_NODE, draw


class _Prefixed(graphviz.Digraph):
    """A Digraph that prefixes its node names, edge ends and subgraph names (keeping `cluster` first). The prefix
    is a class attribute (`prefixed` makes the class) since graphviz makes subgraphs as `self.__class__(...)`."""

    prefix = ""

    def node(self, name: str, *args: Any, **kwargs: Any) -> None:
        super().node(self.prefix + name, *args, **kwargs)

    def edge(self, tail_name: str, head_name: str, *args: Any, **kwargs: Any) -> None:
        super().edge(self.prefix + tail_name, self.prefix + head_name, *args, **kwargs)

    def subgraph(self, graph: Any = None, name: str | None = None, **kwargs: Any) -> Any:
        if graph is None and name is not None:
            name = ("cluster_" + self.prefix + name.removeprefix("cluster").lstrip("_")
                    if name.startswith("cluster") else self.prefix + name)
        return super().subgraph(graph, name=name, **kwargs)


def prefixed(prefix: str) -> type[_Prefixed]:
    return type("_PrefixedStage", (_Prefixed,), {"prefix": prefix})


def cluster_name(i: int) -> str:
    return f"cluster_stage_{i}"


def draw_pipeline(pipe: Pipeline, view: str = "optimized") -> graphviz.Digraph:
    """Every stage's graph at `view`, each in its cluster, in order left to right."""
    top = graphviz.Digraph(name=pipe.flow, graph_attr={**style.GRAPH_ATTR, "compound": "true"},
                           node_attr=dict(style.NODE_ATTR), edge_attr=dict(style.EDGE_ATTR))
    drawn: list[list[str]] = []  # each stage's node names, as drawn
    for i, stage in enumerate(pipe.stages):
        prefix = f"{stage.name}/"
        outer = graphviz.Digraph(name=cluster_name(i))  # the stage's name around the view's own legend
        outer.attr(label=f"<<B>stage {style.esc(stage.name)}</B>  ({stage.steps} steps)>", style="rounded,dashed",
                   color="#495057", fontsize="16")
        inner = prefixed(prefix)(name=f"{cluster_name(i)}_graph")
        draw(stage.graph, view, None, into=inner)
        outer.subgraph(inner)
        top.subgraph(outer)
        names = [n.id for n in stage.graph.nodes] + ([CONTROLLER_NODE] if view == "placed" else [])
        drawn.append([prefix + n for n in names])
    for i in range(len(drawn) - 1):
        before, after = drawn[i], drawn[i + 1]
        if not before or not after:
            continue
        head = after[-1] if view == "placed" else after[0]  # controller to controller in the placed view
        top.edge(before[-1], head, label="then", ltail=cluster_name(i), lhead=cluster_name(i + 1),
                 penwidth="2", color="#212529", fontcolor="#212529")
        for a in before:  # every node of a stage ranks after every node of the one before: left to right
            for b in after:
                top.edge(a, b, style="invis")
    return top
