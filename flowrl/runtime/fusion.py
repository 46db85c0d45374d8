"""Fused stages at run time (flowrl.runtime): what the controller does with nodes the fuse-* passes marked.

`run_stage` runs every member of the fused stage a node belongs to (all nodes sharing its `fusion` attr):
`gen-infer:*` (fuse-gen-inference) through the streaming scheduler in `flowrl.runtime.streaming`, `train:*`
(fuse-train) as one interleaved call on a worker group (`ModelWorker.update_fused`) or as concurrent calls on
several groups. A stage the backend cannot run fused runs its members one by one, as if unfused: a group that
cannot stream, or a gen-infer stage whose groups all live in the controller's process (the local backend,
where "another worker group" is the same process and its chunk forwards would only take turns with decoding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowrl.ir.graph import Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.streaming import GenInfer, rank_group

if TYPE_CHECKING:
    from flowrl.runtime.controller import Controller


@dataclass(frozen=True)
class StageRun:
    """A node that ran: its output, and when it started and ended (None: when the whole stage ended)."""

    node: Node
    out: Batch | None
    start: float
    end: float | None


def members(ctl: Controller, node: Node) -> list[Node]:
    key = node.attrs.get("fusion")
    return [n for n in ctl.graph.nodes if n.attrs.get("fusion") == key]


def run_stage(ctl: Controller, node: Node, values: dict[str, Batch], step: int,
              metrics: dict[str, float]) -> list[StageRun]:
    stage = members(ctl, node)
    key = str(node.attrs.get("fusion"))
    if key.startswith("gen-infer:") and node.op == "generate":
        fused = _gen_infer(ctl, node, stage[1:], values, step, metrics)
        if fused is not None:
            return fused
    if key.startswith("train:") and all(n.op == "update" for n in stage):
        return _train(ctl, stage, values, step, metrics)
    return _one_by_one(ctl, stage, values, step, metrics)


def _one_by_one(ctl: Controller, stage: list[Node], values: dict[str, Batch], step: int,
                metrics: dict[str, float]) -> list[StageRun]:
    ran = []
    for n in stage:
        start = time.perf_counter()
        out = ctl._run(n, values, step, metrics)
        if out is not None:
            values[n.id] = out
        ran.append(StageRun(n, out, start, time.perf_counter()))
    return ran


def _gen_infer(ctl: Controller, gen: Node, forwards: list[Node], values: dict[str, Batch], step: int,
               metrics: dict[str, float]) -> list[StageRun] | None:
    ranks = rank_group(ctl.groups[gen.worker_group])
    in_process = [bool(getattr(ctl.groups[n.worker_group], "in_process", False)) for n in [gen, *forwards]]
    if ranks is None or (ranks.world == 1 and all(in_process)):
        metrics["fusion/fallback"] = 1.0
        return None
    other = {n.worker_group: ctl.groups[n.worker_group] for n in forwards if n.worker_group != gen.worker_group}
    start = time.perf_counter()
    sched = GenInfer(ranks, gen, forwards, values[str(gen.input("prompts"))], ctl.step_seed(step, gen), other)
    rollout, outs, stage_metrics = sched.run()
    metrics.update(stage_metrics)
    ran = [StageRun(gen, rollout, start, start + stage_metrics["fusion/gen_s"])]
    for n in forwards:
        spans = [t for t in sched.timeline if t.what == n.id]
        first = min((t.start for t in spans), default=start)
        ran.append(StageRun(n, outs[n.id], first, max((t.end for t in spans), default=first)))
    return ran


def _train(ctl: Controller, stage: list[Node], values: dict[str, Batch], step: int,
           metrics: dict[str, float]) -> list[StageRun]:
    from flowrl.runtime.controller import _training_batch

    start = time.perf_counter()
    batches = [_training_batch({p: values[src] for p, src in n.inputs}) for n in stage]
    seeds = [ctl.step_seed(step, n) for n in stage]
    group = ctl.groups[stage[0].worker_group]
    holders: Any = getattr(group, "workers", None)
    one_holder = not isinstance(holders, dict) or len({id(holders.get(n.model)) for n in stage}) == 1
    if stage[0].attrs.get("schedule") == "interleave" and one_holder:
        out = group.call("update_fused", [n.model for n in stage], batches, [dict(n.attrs) for n in stage],
                         dispatch=stage[0].dispatch, step_seeds=seeds).result()
        results = out["results"]
        metrics["fusion/train_turns"] = float(len(out["order"]))
    else:  # concurrent: every group is called before any result is awaited
        futures = [ctl.groups[n.worker_group].call("update", n.model, b, dict(n.attrs), dispatch=n.dispatch,
                                                   step_seed=s) for n, b, s in zip(stage, batches, seeds, strict=True)]
        results = [f.result() for f in futures]
    for n, res in zip(stage, results, strict=True):
        ctl.record_update(n, res, metrics)
    return [StageRun(n, None, start, None) for n in stage]
