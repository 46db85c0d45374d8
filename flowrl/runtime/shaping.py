"""DAPO's overlong reward shaping at run time, and what every run reports of its responses' lengths (flowrl.runtime,
called by the controller and the fused generation stage).

A reward call with `overlong_buffer = L` (dsl.shaping checks it) adds flowrl.algos.dapo.overlong_penalty to each
sample's score: the scores batch's `scores` are then the shaped ones (what the advantages, the filter of dynamic
sampling and `reward_mean` read), and `overlong_penalty` (B,) holds what was added. A rollout's `truncated` (B,)
marks the responses cut at max_tokens without EOS (the generating worker knows the EOS; a multi-turn trajectory is
truncated when it ran out of tokens): `response/clip_ratio` is their share, in every run.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flowrl.algos.dapo import overlong_penalty
from flowrl.ir.graph import Graph, Node
from flowrl.runtime.batch import Batch

PENALTY = "overlong_penalty"  # the scores batch's tensor: what the shaping added to each score (B,)


def shaped_scores(graph: Graph, node: Node, rollout: Batch, scores: Batch) -> Batch:
    """`scores` (reward node `node`'s, of `rollout`) with the overlong punishment added, when the node asks for it."""
    buffer = int(str(node.attrs.get("overlong_buffer") or 0))
    if buffer <= 0:
        return scores
    max_tokens = int(str(graph.node(str(node.input("rollout"))).attrs["max_tokens"]))
    factor = float(str(node.attrs.get("overlong_penalty", 1.0)))
    added = overlong_penalty(rollout["response_mask"].sum(1), max_tokens, buffer, factor)  # (B,)
    shaped = scores["scores"].float() + added
    return Batch(scores.size, {**scores.tensors, "scores": shaped, PENALTY: added}, scores.meta, scores.primary)


def response_metrics(graph: Graph, rollout: Batch, values: Mapping[str, Batch]) -> dict[str, float]:
    """`response/clip_ratio` (the share of the step's responses cut at max_tokens) and, where a reward shaped its
    scores, `response/overlong_penalty_mean` (the mean reward the shaping added, 0 or below)."""
    out: dict[str, float] = {}
    if "truncated" in rollout.tensors and rollout.size:
        out["response/clip_ratio"] = float(rollout["truncated"].float().mean())
    shaped = next((values[n.id] for n in graph.nodes if n.op == "reward" and n.id in values
                   and PENALTY in values[n.id].tensors), None)
    if shaped is not None and shaped.size:
        out["response/overlong_penalty_mean"] = float(shaped[PENALTY].mean())
    return out


def ended_with(response_ids: torch.Tensor, response_mask: torch.Tensor, eos: int) -> torch.Tensor:
    """(B,) bool: each response's last real token is `eos` (an empty response did not end). Its negation is a
    rollout's `truncated`: generation stops at EOS or at max_tokens, nothing else."""
    lens = response_mask.sum(1).long()
    last = response_ids.gather(1, (lens - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return (lens > 0) & (last == eos)
