"""Dynamic sampling at run time (DAPO; the loop is drawn into the graph by dsl.refill): what the controller does
with a `kept = filter_groups(rollout, scores, ...)` node.

The step has run the loop once (the data node drew prompts, the generate sampled them, the reward scored them).
`run_filter` keeps the groups whose samples did not all score the same (flowrl.algos.dapo.kept_groups) and, while
fewer than `batch` are kept and fewer than `max_gen_batches` draws were made, runs the loop's nodes again
(`RefillHost.run_round`): the data node draws the next prompts (they are consumed: the loader's position is what a
checkpoint keeps, so a resumed run draws what an uninterrupted one would), generation samples them with the seed of
(seed, step, round, node) (`Controller.step_seed`), so the same seed gives the same samples on every backend.
Then the first `batch` kept groups, in draw order, are the filter's output: the rollout's tensors and meta for
those samples plus the scores' tensors (one batch that is both, with the groups numbered 0..K-1), and every value
of the loop becomes the concatenation of all the draws (what the step's metrics report: all that was generated).

In an asynchronous run (pass async-rollout) the filter is in the rollout phase, so its draws run on the rollout
thread while training goes on: a refill delays the batch, not the step, as long as the queue holds one.

A filter that kept no group after its last draw outputs an empty batch; every node reading an empty batch is
skipped, and its output is empty too (`starved`): the step trains nothing, and its metrics say so
(`filter/kept_groups` 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from flowrl.algos.dapo import kept_groups
from flowrl.ir.graph import Graph, Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.functions import trajectory_returns

if TYPE_CHECKING:
    from flowrl.runtime.controller import StepResult

FILTER = "filter_groups"  # = dsl.refill.FILTER


class RefillHost(Protocol):
    """What a filter uses of the controller that runs it (`flowrl.runtime.controller.Controller`)."""

    @property
    def graph(self) -> Graph: ...

    def run_round(self, nodes: Sequence[Node], step: int, round: int) -> tuple[dict[str, Batch], StepResult]: ...


def is_filter(node: Node) -> bool:
    return node.op == "fn" and node.attrs.get("fn") == FILTER and bool(node.attrs.get("refill"))


def run_filter(host: RefillHost, node: Node, values: dict[str, Batch], step: int, result: StepResult) -> Batch:
    """The kept groups of `node`'s rollout, drawing more prompts as needed; `values` gets each loop node's value
    over every draw, `result` the draws' spans and metrics and the filter's own metrics."""
    loop = [host.graph.node(str(i)) for i in tuple(node.attrs["refill"])]  # type: ignore[arg-type]
    rollout_id, scores_id = str(node.input("rollout")), str(node.input("scores"))
    data_id = next(n.id for n in loop if n.op == "data")
    keep, want = str(node.attrs.get("keep", "mixed")), int(str(node.attrs.get("batch")))
    rounds_max = int(str(node.attrs.get("max_gen_batches", 10)))
    draws: list[dict[str, Batch]] = [{n.id: values[n.id] for n in loop}]
    kept: list[list[int]] = []  # each draw's kept group ids, in order
    dropped = equal = 0
    while True:
        returns, group_ids = trajectory_returns(draws[-1][scores_id]), _group_ids(draws[-1][rollout_id])
        ids, gone = kept_groups(returns, group_ids, keep)
        kept.append([int(g) for g in ids])
        dropped += gone
        equal += len(group_ids.unique()) - len(kept_groups(returns, group_ids, "mixed")[0])
        if sum(map(len, kept)) >= want or len(draws) >= rounds_max:
            break
        fresh, spent = host.run_round(loop, step, len(draws))
        _merge(result, spent)
        draws.append({n.id: fresh[n.id] for n in loop})
    offsets = _offsets([d[data_id].size for d in draws])
    for n in loop:  # every draw's samples: what the step generated and scored
        values[n.id] = _concat([_shifted(d[n.id], off) for d, off in zip(draws, offsets, strict=True)])
    groups = [g + off for ids, off in zip(kept, offsets, strict=True) for g in ids]
    total = len(groups)
    groups = groups[:want]  # verl: batch[:train_batch_size * n], the first groups kept
    out = _kept_batch(values[rollout_id], values[scores_id], groups, scores_id != rollout_id)
    result.metrics.update({
        "filter/kept_groups": float(len(groups)),
        "filter/dropped_all_equal": float(dropped),
        "filter/all_equal_groups": float(equal),  # drawn groups whose samples all scored alike, kept or not
        "filter/gen_rounds": float(len(draws)),
        "filter/drawn_groups": float(sum(d[data_id].size for d in draws)),
        "filter/short_groups": float(want - len(groups)),  # > 0: max_gen_batches ran out before the batch filled
        "filter/surplus_groups": float(total - len(groups)),  # kept, but past `batch`: generated, not trained
    })
    return out


def starved(graph: Graph, node: Node, values: Mapping[str, Batch]) -> list[Node]:
    """The nodes to skip now: `node` (with the rest of its fused stage) when one of them reads a batch with no
    samples (a filter that kept no group, or a node skipped before it); else none."""
    key = node.attrs.get("fusion")
    stage = [n for n in graph.nodes if n.attrs.get("fusion") == key] if key else [node]
    if any(src in values and values[src].size == 0 for n in stage for src in n.input_ids):
        return stage
    return []


def _group_ids(rollout: Batch) -> torch.Tensor:
    return rollout["group_id"] if "group_id" in rollout.tensors else torch.arange(rollout.size)


def _offsets(prompts: Sequence[int]) -> list[int]:
    """Each draw's first group id in the concatenated rollout (a draw numbers its prompts' groups from 0)."""
    out, at = [], 0
    for n in prompts:
        out.append(at)
        at += n
    return out


def _shifted(batch: Batch, offset: int) -> Batch:
    if not offset or "group_id" not in batch.tensors:
        return batch
    return Batch(batch.size, {**batch.tensors, "group_id": batch.tensors["group_id"] + offset}, batch.meta,
                 batch.primary)


def _concat(batches: list[Batch]) -> Batch:
    """The draws' batches one after another; token ids padded with the rollout's own pad id (read where a response
    is masked: it never reaches a number, a masked position is never attended to or trained on)."""
    if len(batches) == 1:
        return batches[0]
    pad = next((int(b["response_ids"][b["response_mask"] == 0][0]) for b in batches
                if "response_ids" in b.tensors and bool((b["response_mask"] == 0).any())), 0)
    return Batch.concat(batches, fill={"prompt_ids": pad, "response_ids": pad})


def _kept_batch(rollout: Batch, scores: Batch, groups: list[int], scored: bool) -> Batch:
    """The samples of `groups` (in that order): the rollout's tensors and meta with the scores' tensors, groups
    numbered 0..K-1."""
    ids = _group_ids(rollout)  # (B,)
    rows = [int(i) for g in groups for i in torch.nonzero(ids == g).flatten().tolist()]
    both = Batch(rollout.size, {**rollout.tensors, **(scores.tensors if scored else {})}, rollout.meta,
                 "scores" if scored else rollout.primary)
    out = both.select(rows)
    if "group_id" in out.tensors:
        renumber = {g: k for k, g in enumerate(groups)}
        out.tensors["group_id"] = torch.tensor([renumber[int(g)] for g in out["group_id"].tolist()],
                                               dtype=torch.long)
    return out


def _merge(result: StepResult, spent: StepResult) -> None:
    """A refill draw's spans and metrics into the step's: seconds add up (`time/NODE` is the node's time over every
    draw), other figures are the last draw's."""
    result.spans.extend(spent.spans)
    for key, value in spent.metrics.items():
        adds = key.startswith("time/") or key.endswith("_s")
        result.metrics[key] = result.metrics.get(key, 0.0) + value if adds else value
