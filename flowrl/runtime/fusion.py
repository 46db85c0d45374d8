"""Fused stages at run time (flowrl.runtime): what the controller does with nodes the fuse-* passes marked.

`run_stage` runs every member of the fused stage a node belongs to (all nodes sharing its `fusion` attr):
`gen-infer:*` (fuse-gen-inference) through the streaming scheduler in `flowrl.runtime.gen_infer`, `train:*`
(fuse-train) as one interleaved call on a worker group (`ModelWorker.update_fused`) or as concurrent calls on
several groups. A stage the backend cannot run fused runs its members one by one, as if unfused: a group that
cannot stream, or a gen-infer stage whose groups all live in the controller's process (the local backend,
where "another worker group" is the same process and its chunk forwards would only take turns with decoding),
except for an env generate, whose chunk forwards take turns with the environments' waits instead.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from flowrl.ir.graph import Graph, Node
from flowrl.runtime.batch import Batch, training_batch
from flowrl.runtime.env_rollout import env_spec_of
from flowrl.runtime.gen_infer import GenInfer
from flowrl.runtime.protocol import StreamedStage, WorkerGroup
from flowrl.runtime.scoring import Pending, Scorer
from flowrl.runtime.shaping import shaped_scores


@dataclass(frozen=True)
class StageRun:
    """A node that ran: its output, and when it started and ended (None: when the whole stage ended)."""

    node: Node
    out: Batch | None
    start: float
    end: float | None


class StageHost(Protocol):
    """What a fused stage uses of the controller that runs it (`flowrl.runtime.controller.Controller`)."""

    @property
    def graph(self) -> Graph: ...

    @property
    def groups(self) -> Mapping[str, WorkerGroup]: ...

    @property
    def rewards(self) -> Mapping[str, Scorer]: ...

    def step_seed(self, step: int, node: Node) -> int: ...

    def run_node(self, node: Node, values: dict[str, Batch], step: int, metrics: dict[str, float]) -> Batch | None: ...

    def record_update(self, node: Node, out: Mapping[str, float], metrics: dict[str, float]) -> None: ...

    def decline(self, node: Node, reason: str) -> None: ...


def members(ctl: StageHost, node: Node) -> list[Node]:
    key = node.attrs.get("fusion")
    return [n for n in ctl.graph.nodes if n.attrs.get("fusion") == key]


def run_stage(ctl: StageHost, node: Node, values: dict[str, Batch], step: int,
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


def _one_by_one(ctl: StageHost, stage: list[Node], values: dict[str, Batch], step: int,
                metrics: dict[str, float]) -> list[StageRun]:
    ran = []
    for n in stage:
        start = time.perf_counter()
        out = ctl.run_node(n, values, step, metrics)
        if out is not None:
            values[n.id] = out
        ran.append(StageRun(n, out, start, time.perf_counter()))
    return ran


def _gen_infer(ctl: StageHost, gen: Node, members: list[Node], values: dict[str, Batch], step: int,
               metrics: dict[str, float]) -> list[StageRun] | None:
    forwards = [n for n in members if n.op != "reward"]
    rewards = [n for n in members if n.op == "reward"]
    scorers = {n.id: ctl.rewards[str(n.attrs["fn"])] for n in rewards}
    ranks = ctl.groups[gen.worker_group]
    if not ranks.per_rank:
        start = time.perf_counter()
        others = {n.worker_group: ctl.groups[n.worker_group] for n in forwards}
        streamed = ranks.stream_stage(gen, forwards, values[str(gen.input("prompts"))], ctl.step_seed(step, gen),
                                      others)
        if streamed is None:
            ctl.decline(gen, f"worker group {ranks.name} cannot be called rank by rank: {ranks.why_not_per_rank}")
            metrics["fusion/fallback"] = 1.0
            return None
        return _streamed(ctl, gen, forwards, rewards, streamed, start, values, step, metrics)
    # An env generate's chunk forwards take turns with environment waits, not with decoding (flowrl.engines.turns).
    if all(ctl.groups[n.worker_group].inline for n in [gen, *forwards]) and \
            not any(s.overlaps for s in scorers.values()) and env_spec_of(gen.attrs) is None:
        ctl.decline(gen, "every group of the stage runs inline in the controller's process: chunk forwards would "
                         "only take turns with decoding")
        metrics["fusion/fallback"] = 1.0
        return None
    other = {n.worker_group: ctl.groups[n.worker_group] for n in forwards if n.worker_group != gen.worker_group}
    start = time.perf_counter()
    scoring = _Scoring(scorers)
    sched = GenInfer(ranks, gen, forwards, values[str(gen.input("prompts"))], ctl.step_seed(step, gen), other,
                     on_chunk=scoring.submit)
    rollout, outs, stage_metrics = sched.run()
    metrics.update(stage_metrics)
    ran = [StageRun(gen, rollout, start, start + stage_metrics["fusion/gen_s"])]
    for n in forwards:
        spans = sched.results.spans_of(n.id)
        first = min((t.start for t in spans), default=start)
        ran.append(StageRun(n, outs[n.id], first, max((t.end for t in spans), default=first)))
    for n in rewards:
        out, began = scoring.collect(n.id, rollout)
        out = shaped_scores(ctl.graph, n, rollout, out)  # DAPO's overlong shaping, as unfused
        ran.append(StageRun(n, out, began if began is not None else start, time.perf_counter()))
    return ran


def _streamed(ctl: StageHost, gen: Node, forwards: list[Node], rewards: list[Node], streamed: StreamedStage,
              start: float, values: dict[str, Batch], step: int, metrics: dict[str, float]) -> list[StageRun]:
    """The stage a group streamed by itself (`WorkerGroup.stream_stage`); its rewards scored after it."""
    metrics.update(streamed.metrics)
    values[gen.id] = streamed.rollout
    ran = [StageRun(gen, streamed.rollout, start, streamed.gen_end)]
    for n in forwards:
        first, last = streamed.spans.get(n.id, (start, streamed.gen_end))
        values[n.id] = streamed.outs[n.id]
        ran.append(StageRun(n, streamed.outs[n.id], first, last))
    for n in rewards:
        began = time.perf_counter()
        out = ctl.run_node(n, values, step, metrics)
        ran.append(StageRun(n, out, began, time.perf_counter()))
    return ran


class _Scoring:
    """Rewards scored beside generation: each chunk is handed to every reward's scorer as it arrives."""

    def __init__(self, scorers: Mapping[str, Scorer]):
        self.scorers = scorers
        self.pending: dict[str, list[Pending]] = {node: [] for node in scorers}
        self.samples: dict[str, list[torch.Tensor]] = {}  # each chunk's sample numbers, in arrival order
        self.first: float | None = None

    def submit(self, chunk: Batch) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        for node, scorer in self.scorers.items():
            self.pending[node].append(scorer.submit(chunk))
            self.samples.setdefault(node, []).append(chunk["sample"])

    def collect(self, node: str, rollout: Batch) -> tuple[Batch, float | None]:
        """The reward's output (the rollout with its scores in sample order, as unfused) and when it began."""
        scores = torch.cat([p.result()["scores"] for p in self.pending[node]])  # (B,) in arrival order
        order = torch.argsort(torch.cat(self.samples[node]))
        return rollout.derive("scores", scores=scores[order]), self.first


def _train(ctl: StageHost, stage: list[Node], values: dict[str, Batch], step: int,
           metrics: dict[str, float]) -> list[StageRun]:
    start = time.perf_counter()
    batches = [training_batch({p: values[src] for p, src in n.inputs}, mask_truncated=bool(n.attrs.get("mask_truncated")))
               for n in stage]
    seeds = [ctl.step_seed(step, n) for n in stage]
    group = ctl.groups[stage[0].worker_group]
    one_holder = group.colocated([str(n.model) for n in stage])
    if stage[0].attrs.get("schedule") == "interleave" and one_holder and group.inline:
        # Taking turns needs a thread per update; a thread kept with torch ops run on it keeps its own OpenMP
        # team, which slowed every later op of the controller's thread 2x (PPO steps 0.106 s -> 0.224 s on 2
        # CPU cores, bench/calib/calib_ppo.flow), and on one device there are no pipeline bubbles to fill.
        ctl.decline(stage[0], f"worker group {group.name} runs in the controller's own process: taking turns on one "
                              "device fills no pipeline bubbles, and its threads' torch thread teams would slow the "
                              "controller's own work")
        metrics["fusion/fallback"] = 1.0
        return _one_by_one(ctl, stage, values, step, metrics)
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
