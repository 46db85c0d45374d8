"""Deduplicated prefill (flowrl.elastic): a prompt prefix shared across generation instances runs once.

Prompts often open alike (a system prompt, a few-shot preamble). After length-ranked assignment those prompts
sit on several instances, and each would prefill the common prefix again. RLHFless computes it once and hands
its keys and values to the instances that need it, where moving them costs less than recomputing them. Here:
every prefix is computed by the first instance holding its prompts (its owner); another instance holding some
of them takes the owner's keys and values when `hand_over` says so, else computes the prefix itself (once for
all its prompts either way: the engine prefills only what follows a prefix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


UNMEASURED_PATIENCE_S = 1.0  # how long a taker waits for an owner before the recompute time is measured


@dataclass(frozen=True)
class HandOver:
    """How a deduplicated prefill's takers get their prefixes: `handing` (take them from the owners, else
    compute them), how long a taker waits for an owner before computing them itself (`patience_s`, None: as long
    as it takes), and the recompute estimate it rests on (None: unmeasured)."""

    handing: bool
    patience_s: float | None
    recompute_s: float | None


def decide_hand_over(mode: str, rate_s: float | None, handover_s: float | None,
                     taken: Sequence[int]) -> HandOver:
    """The choice for one generation. `mode`: auto | handover | local (`run { dedup_prefill }`); `rate_s`:
    measured seconds per computed prefix token; `handover_s`: measured seconds per handover; `taken`: the length
    of each prefix some instance other than its owner needs. The recompute estimate is `rate_s` times their mean
    length; "auto" hands over as `hand_over` says and waits no longer than recomputing is expected to take."""
    recompute = None if rate_s is None or not taken else rate_s * sum(taken) / len(taken)
    handing = mode == "handover" or (mode == "auto" and hand_over(recompute, handover_s))
    patience = None if mode == "handover" else recompute if recompute is not None else UNMEASURED_PATIENCE_S
    return HandOver(handing, patience, recompute)


@dataclass
class PrefillRates:
    """What a pool learned from its instances' deduplicated prefill: seconds per computed prefix token
    (`rate_s`) and per handover (`handover_s`), each an even EWMA over generations. A taker that gave up on its
    owner counts its wait plus its own computing as the handover's cost."""

    rate_s: float | None = None
    handover_s: float | None = None

    def learn(self, stats: Sequence[Mapping[str, float]]) -> None:
        """`stats`: per instance, prefill_s and prefill_tokens (its own computing), handover_s, handover_tokens
        and handover_missed (its taking)."""
        computed = [s for s in stats if s.get("prefill_tokens")]
        if computed:
            rate = sum(s["prefill_s"] for s in computed) / sum(s["prefill_tokens"] for s in computed)
            self.rate_s = rate if self.rate_s is None else 0.5 * self.rate_s + 0.5 * rate
        taken = [s["handover_s"] for s in stats if s.get("handover_tokens") or s.get("handover_missed")]
        if taken:
            mean = sum(taken) / len(taken)
            self.handover_s = mean if self.handover_s is None else 0.5 * self.handover_s + 0.5 * mean
