"""Pass `fuse-train` (RLHFuse intra-stage fusion), last of the rewrite passes in the pipeline.

Independent `update` nodes of one step (PPO's actor and critic updates) become one fused training stage:
each gets `fusion = "train:<models>"`, `fusion_kind = "intra-stage"` and `schedule`. With every member in one
worker group the schedule is "interleave" (micro-batches alternate: actor mb 1, critic mb 1, actor mb 2, ...,
see `flowrl.runtime.schedule`); across worker groups it is "concurrent" (all groups are called before any
result is awaited). Either way each model's update computes exactly what it computes alone.
"""

from __future__ import annotations

from flowrl.ir.graph import Graph, Node
from flowrl.passes.common import ancestors, position
from flowrl.passes.registry import register


def why_not_fuse(graph: Graph, first: Node, later: Node) -> str | None:
    """None when `later` can train in one stage with `first` (scheduled before it), else why it cannot."""
    if first.model == later.model:
        # Two updates of one model are sequential by definition: the second starts from the first's weights.
        return f"both update {first.model}"
    start = position(graph, first.id)
    late_input = next((i for i in sorted(ancestors(graph, later)) if position(graph, i) > start), None)
    if late_input is not None:
        # The fused stage runs where `first` is; `later` would not have this input yet.
        return f"{later.id} needs {late_input}, computed after {first.id}"
    for node in (first, later):
        engine = graph.model(str(node.model)).engine
        if engine != "torch":
            # Another training engine (DeepSpeed) runs its own micro-batch schedule.
            return f"{node.model} trains with engine {engine!r}"
    return None


def _stages(graph: Graph) -> tuple[list[list[Node]], list[str]]:
    """Greedy grouping in schedule order: an update joins the first stage whose every member it fuses with."""
    stages: list[list[Node]] = []
    notes: list[str] = []
    for node in (n for n in graph.nodes if n.op == "update"):
        refusal: str | None = None
        for stage in stages:
            reasons = [r for r in (why_not_fuse(graph, m, node) for m in stage) if r is not None]
            if not reasons:
                stage.append(node)
                break
            refusal = refusal or f"{node.id}: not fused with {stage[0].id}: {reasons[0]}"
        else:
            stages.append([node])
            if refusal is not None:
                notes.append(refusal)
    return stages, notes


@register("fuse-train", "train independent updates of a step as one fused stage: micro-batches interleaved "
          "in one worker group, or concurrent across groups (RLHFuse intra-stage fusion)")
def fuse_train(graph: Graph) -> tuple[Graph, list[str]]:
    stages, notes = _stages(graph)
    if not any(len(s) > 1 for s in stages):
        updates = sum(len(s) for s in stages)
        if updates < 2:
            notes.append(f"not fused: the step has {updates} update{'s' if updates != 1 else ''}")
        return graph, notes
    rewritten: dict[str, Node] = {}
    for stage in (s for s in stages if len(s) > 1):
        key = "train:" + "+".join(str(n.model) for n in stage)
        groups = {n.worker_group for n in stage}
        schedule = "interleave" if len(groups) == 1 else "concurrent"
        for n in stage:
            rewritten[n.id] = n.with_attrs(fusion=key, fusion_kind="intra-stage", schedule=schedule)
        where = f"in worker group {next(iter(groups))}" if len(groups) == 1 else f"on {', '.join(sorted(groups))}"
        notes.append(f"{' + '.join(n.id for n in stage)}: one training stage, {schedule} {where}")
    return graph.with_nodes([rewritten.get(n.id, n) for n in graph.nodes]), notes
