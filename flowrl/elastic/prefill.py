"""Deduplicated prefill (flowrl.elastic): a prompt prefix shared across generation instances runs once.

Prompts often open alike (a system prompt, a few-shot preamble). After length-ranked assignment those prompts
sit on several instances, and each would prefill the common prefix again. RLHFless computes it once and hands
its keys and values to the instances that need it, where moving them costs less than recomputing them. Here:
every prefix is computed by the first instance holding its prompts (its owner); another instance holding some
of them takes the owner's keys and values when `hand_over` says so, else computes the prefix itself (once for
all its prompts either way: the engine prefills only what follows a prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixShare:
    """One instance's part: the prefixes (indices into the step's groups) it computes, those of them other
    instances take from it, and the (prefix, owner instance) pairs it takes."""

    compute: tuple[int, ...] = ()
    offer: tuple[int, ...] = ()
    take: tuple[tuple[int, int], ...] = ()


def share_prefixes(groups: Sequence[Sequence[int]], instance_of: Sequence[int], instances: int,
                   hand_over: bool) -> list[PrefixShare]:
    """Each instance's `PrefixShare`. `groups[g]`: the prompts opening with prefix g; `instance_of[p]`: the
    instance holding prompt p. A prefix on one instance is computed there; on several, by the lowest-numbered
    (the owner) and, with `hand_over`, taken by the others, else computed by each."""
    compute: list[list[int]] = [[] for _ in range(instances)]
    offer: list[list[int]] = [[] for _ in range(instances)]
    take: list[list[tuple[int, int]]] = [[] for _ in range(instances)]
    for g, prompts in enumerate(groups):
        holders = sorted({instance_of[p] for p in prompts})
        if not holders:
            continue
        owner = holders[0]
        compute[owner].append(g)
        for other in holders[1:]:
            if hand_over:
                take[other].append((g, owner))
            else:
                compute[other].append(g)
        if hand_over and len(holders) > 1:
            offer[owner].append(g)
    return [PrefixShare(tuple(c), tuple(o), tuple(t)) for c, o, t in zip(compute, offer, take, strict=True)]


def hand_over(recompute_s: float | None, handover_s: float | None) -> bool:
    """Whether an instance should take prefixes computed elsewhere (`handover_s`: measured, from asking to
    holding them, waiting for the owner included) rather than compute them itself (`recompute_s`: the
    measured prefill rate times their tokens). While either is unmeasured: hand over, which measures it."""
    if recompute_s is None or handover_s is None:
        return True
    return handover_s < recompute_s
