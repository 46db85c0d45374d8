"""Graph -> graphviz.Digraph, one function per `flowrl viz --stage`: parsed, optimized, placed.

parsed:    the dataflow as written (every node, every edge labelled with the parameter it feeds).
optimized: parsed plus what the passes decided: fused nodes share a box, shared-prefix nodes are marked,
           and a legend says which pass did what.
placed:    worker groups as clusters on their pools, the single controller dispatching to each model call
           (edge label: the dispatch mode) and collecting the result back.
"""

from __future__ import annotations

from collections.abc import Iterable

import graphviz

from flowrl.ir.graph import CONTROLLER, Graph, GroupDecl, Node, PoolDecl
from flowrl.ir.printer import env_label
from flowrl.viz import style
from flowrl.viz.timings import Timings

STAGES = ("parsed", "optimized", "placed")
CONTROLLER_NODE = "[controller]"  # not an identifier, so no flow node can take this id
MODEL_OPS = ("generate", "logprobs", "values", "score", "update")


def draw(g: Graph, stage: str = "optimized", timings: Timings | None = None,
         into: graphviz.Digraph | None = None) -> graphviz.Digraph:
    """`g` drawn at `stage`, into a new Digraph or `into` (a pipeline stage's cluster, viz/stages.py)."""
    if stage == "parsed":
        return parsed(g, timings, into)
    if stage == "optimized":
        return optimized(g, timings, into)
    if stage == "placed":
        return placed(g, timings, into)
    raise ValueError(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")


def parsed(g: Graph, timings: Timings | None = None, into: graphviz.Digraph | None = None) -> graphviz.Digraph:
    dot = _digraph(g) if into is None else into
    for n in g.nodes:
        _node(dot, g, n, timings, passes=False)
    _data_edges(dot, g)
    _key(dot, g, "parsed", timings)
    return dot


def optimized(g: Graph, timings: Timings | None = None, into: graphviz.Digraph | None = None) -> graphviz.Digraph:
    dot = _digraph(g) if into is None else into
    _nodes(dot, g, g.nodes, _fusion_groups(g.nodes), timings)
    _data_edges(dot, g)
    _pass_legend(dot, g, timings)
    return dot


def placed(g: Graph, timings: Timings | None = None, into: graphviz.Digraph | None = None) -> graphviz.Digraph:
    dot = _digraph(g) if into is None else into
    fused = _fusion_groups(g.nodes)
    groups = {w.name: w for w in g.worker_groups}
    with dot.subgraph(name="cluster_controller") as c:
        c.attr(label=f"<<B>{CONTROLLER}</B> (one process)>",
               labelloc="b", style="rounded,filled,dashed", fillcolor="#f8f9fa", color="#868e96")
        swatch = style.PALETTE["controller"]
        c.node(CONTROLLER_NODE, "<<B>controller</B>>", shape="box", style="rounded,filled",
               fillcolor=swatch.fill, color=swatch.line, fontcolor="white")
        mine = [n for n in g.nodes if n.worker_group not in groups]
        _nodes(c, g, mine, _within(fused, mine), timings, numbered=True, prefix="controller_")
    for w in g.worker_groups:
        members = [n for n in g.nodes if n.worker_group == w.name]
        with dot.subgraph(name=f"cluster_{w.name}") as c:
            c.attr(label=_group_label(g, w), style="rounded,filled", fillcolor="#f8f9fa",
                   color=_group_color(g, w))
            _nodes(c, g, members, _within(fused, members), timings, numbered=True, prefix=f"{w.name}_")
            if not members:  # graphviz drops empty clusters; the group still holds its models
                c.node(f"[{w.name}]", f"<<I>{style.esc(', '.join(w.models))}: no calls</I>>",
                       shape="plaintext", fontsize="10")
    # No data edges here: the placed view is the controller's star (dispatch out, collect back); the
    # dataflow is the other views' job, and the schedule position on each node keeps the order readable.
    for n in g.nodes:
        if n.worker_group in groups and n.op in MODEL_OPS:
            line = style.PALETTE[style.role_of(g, n)].line
            dot.edge(CONTROLLER_NODE, n.id, label=n.dispatch, color=line, fontcolor=line, penwidth="1.3")
            # The collect edge runs n -> controller; drawn as a reversed controller -> n edge so graphviz
            # lays it beside its dispatch edge instead of looping it back across the picture.
            dot.edge(CONTROLLER_NODE, n.id, style="dashed", color=line, dir="back", arrowtail="empty",
                     tooltip=f"{n.id} -> controller: collect")
    _placement_legend(dot, g, timings)
    return dot


# -- pieces shared by the views ---------------------------------------------------------------------


def _digraph(g: Graph) -> graphviz.Digraph:
    return graphviz.Digraph(name=g.flow, graph_attr=dict(style.GRAPH_ATTR), node_attr=dict(style.NODE_ATTR),
                            edge_attr=dict(style.EDGE_ATTR))


def _node(dot: graphviz.Digraph, g: Graph, n: Node, timings: Timings | None, *, passes: bool,
          numbered: bool = False) -> None:
    attrs = style.node_attrs(g, n)
    extra: list[str] = []
    font_color = None
    if passes and n.attrs.get("share_prefix"):
        attrs["peripheries"] = "2"
        extra.append(style.SHARED_PREFIX)
    if timings is not None:
        share = timings.share(n.id)
        attrs["penwidth"] = "2"  # the border keeps the role colour; the fill shows the time
        if share is None:
            attrs["fillcolor"] = "white"
            extra.append("no timing")
        else:
            attrs["fillcolor"] = style.heat(share)
            extra.append(f"{style.seconds(timings.node_s[n.id])} \u00b7 {style.percent(share)}")
            font_color = "white" if share > 0.4 else None
    order = g.nodes.index(n) + 1 if numbered else None
    dot.node(n.id, style.node_label(g, n, extra, font_color, order), **attrs)


def _nodes(dot: graphviz.Digraph, g: Graph, nodes: Iterable[Node], fused: dict[str, list[Node]],
           timings: Timings | None, numbered: bool = False, prefix: str = "") -> None:
    """Draw `nodes` in schedule order; a fusion group is drawn as one cluster where its first member is."""
    cluster_of = {m.id: key for key, ms in fused.items() for m in ms}
    keys = list(fused)
    drawn: set[str] = set()
    for n in nodes:
        key = cluster_of.get(n.id)
        if key is None:
            _node(dot, g, n, timings, passes=True, numbered=numbered)
        elif key not in drawn:
            drawn.add(key)
            _fusion_cluster(dot, g, keys.index(key), key, fused[key], timings, prefix, numbered)


def _data_edges(dot: graphviz.Digraph, g: Graph) -> None:
    """One edge per input; an asynchronous one (pass async-rollout: the value comes from a queue, generated up
    to max_staleness updates earlier) dashed and labelled so; a generate that runs an environment gets a dashed
    self-loop labelled with it (`env calc (tool, max_turns=4)`): the policy acts, the environment answers."""
    k = g.run.get("max_staleness", 0)
    for n in g.nodes:
        env = env_label(n.attrs) if n.op == "generate" else None
        if env is not None:  # the environment loop: each turn's action goes out, its observation comes back
            dot.edge(n.id, n.id, label=f"env {env}", style="dashed", color="#2b8a3e", fontcolor="#2b8a3e",
                     dir="forward")
        loop = n.attrs.get("refill") if n.op == "fn" else None
        if isinstance(loop, tuple) and loop:  # dynamic sampling: the filter sends the step back for more prompts
            dot.edge(n.id, str(loop[0]), label=f"refill: draw more prompts until {n.attrs.get('batch')} groups "
                     f"are kept (\u2264{n.attrs.get('max_gen_batches')} draws)", style="dashed", color="#5f3dc4",
                     fontcolor="#5f3dc4", constraint="false")
        queued = set(str(n.attrs.get("async_inputs") or "").split(","))
        for param, src in n.inputs:
            if src in queued:
                dot.edge(src, n.id, label=f"{param} (async, \u2264{k} stale)", style="dashed", color="#e8590c",
                         fontcolor="#e8590c")
            else:
                dot.edge(src, n.id, label=param)


def _fusion_groups(nodes: Iterable[Node]) -> dict[str, list[Node]]:
    """fusion attr value -> its nodes, in schedule order (dicts keep first-seen order: deterministic)."""
    groups: dict[str, list[Node]] = {}
    for n in nodes:
        key = n.attrs.get("fusion")
        if key is not None and key is not False:
            groups.setdefault(str(key), []).append(n)
    return groups


def _within(fused: dict[str, list[Node]], members: list[Node]) -> dict[str, list[Node]]:
    """The fusion groups wholly inside `members` (a fusion across worker groups gets no shared box)."""
    ids = {m.id for m in members}
    return {k: ms for k, ms in fused.items() if all(m.id in ids for m in ms)}


def _fusion_cluster(dot: graphviz.Digraph, g: Graph, i: int, key: str, members: list[Node],
                    timings: Timings | None, prefix: str = "", numbered: bool = False) -> None:
    kinds = sorted({str(m.attrs.get("fusion_kind") or "fusion") for m in members})
    fused = " + ".join(m.id for m in members)
    label = (f'<<B>{style.esc(" / ".join(kinds))}</B><BR/>'
             f'<FONT POINT-SIZE="9">fuses {style.esc(fused)}</FONT>>')
    with dot.subgraph(name=f"cluster_fusion_{prefix}{i}") as c:
        c.attr(label=label, style="rounded,dashed,filled", fillcolor="#fff4e6", color="#e8590c",
               penwidth="1.5", tooltip=f"fusion {key}")
        for m in members:
            _node(c, g, m, timings, passes=True, numbered=numbered)


def _key(dot: graphviz.Digraph, g: Graph, stage: str, timings: Timings | None,
         rows: list[tuple[str, str]] | None = None) -> None:
    """The graph's caption, drawn above it: title, then the view's legend `rows`, then the colour key.
    A graph label (not a node) so the legend never takes a rank column or crowds the nodes."""
    title = f"{g.flow} \u00b7 {stage}" + (f" \u00b7 use {g.template}" if g.template else "")
    cells = list(rows or [])
    if timings is None:
        present = sorted({style.role_of(g, n) for n in g.nodes}, key=list(style.PALETTE).index)
        swatches = " ".join(
            f'<FONT COLOR="{style.PALETTE[r].line}">\u25a0</FONT> {style.esc(r)}' for r in present)
        colours = f'<TR><TD ALIGN="LEFT"><B>colours</B></TD><TD ALIGN="LEFT">{swatches}</TD></TR>'
    else:
        cells.insert(0, ("timings", timings.caption()))
        stops = " ".join(f'<FONT COLOR="{style.heat(s)}">\u25a0</FONT> {style.percent(s)}'
                         for s in style.HEAT_STOPS)
        colours = ('<TR><TD ALIGN="LEFT"><B>fill</B></TD><TD ALIGN="LEFT">share of the mean step time: '
                   f"{stops}; the border keeps the role colour</TD></TR>")
    dot.attr(label=style.table(title, cells, tail=colours))


def _pass_legend(dot: graphviz.Digraph, g: Graph, timings: Timings | None) -> None:
    rows: list[tuple[str, str]] = []
    for rec in g.passes:
        what = "changed the graph" if rec.changed else "no change"
        rows.append((f"pass {rec.name}", what + (": " + "; ".join(rec.notes) if rec.notes else "")))
    if not any(rec.changed for rec in g.passes):
        rows.append(("passes", "no passes changed the graph"))
    if any(n.attrs.get("share_prefix") for n in g.nodes):
        rows.append((style.SHARED_PREFIX.split()[0], "double border: samples share the prompt prefix (computed once)"))
    _key(dot, g, "optimized", timings, rows)


def _placement_legend(dot: graphviz.Digraph, g: Graph, timings: Timings | None) -> None:
    used = {w.pool for w in g.worker_groups}
    # A used pool is in its groups' labels; only an unused one needs a line of its own.
    rows = [(p.name, _pool_text(p) + " \u2014 no group placed on it") for p in g.pools if p.name not in used]
    rows.append(("edges", "solid: controller dispatches a call (split | broadcast | rank0); "
                          "dashed: result collected; N. = position in the controller's schedule"))
    _key(dot, g, "placed", timings, rows)


def _pool_text(p: PoolDecl) -> str:
    return f"pool {p.name} (gpus {p.gpus}{', elastic' if p.elastic else ''})"


def _group_label(g: Graph, w: GroupDecl) -> str:
    parts = [f"<B>group {style.esc(w.name)}</B>", f"models {style.esc(', '.join(w.models))}"]
    pool = next((p for p in g.pools if p.name == w.pool), None)
    if pool is not None:
        parts.append(style.esc(_pool_text(pool)))
    elif w.pool:
        parts.append(f"pool {style.esc(w.pool)}")
    if str(w.replicas) != "1":
        parts.append(f"replicas {style.esc(w.replicas)}")
    return "<" + " \u2014 ".join(parts) + ">"


def _group_color(g: Graph, w: GroupDecl) -> str:
    """The border of a group: the role colour of its first model, so the group reads as its models."""
    for name in w.models:
        try:
            return style.PALETTE[g.model(name).role].line
        except KeyError:
            continue
    return "#868e96"
