"""Deduplicated prefill on serverless generation instances (RLHFless; issue 15 item 4).

The driver tokenizes a generation's prompts (with the pool's `PromptEncoder`, fetched once) and finds the
prefixes they share (flowrl.engines.trie, at least the share-prefix pass's `prefix_min_len` tokens, over the
whole step, not one instance's shard). flowrl.elastic.prefill decides who computes what: a prefix is computed
by the first instance holding its prompts (its owner), which offers it to the generation's box when other
instances take it; the others take it or compute it themselves, as the measured handover and recompute times
say (`run { dedup_prefill = "auto" }`; "handover" and "local" force one side, "off" prefills every prompt whole):
`decide_hand_over` on the rates `PrefillRates` learned, the calls the simulator makes.
Every instance then prefills only its prompts' rests (flowrl.engines.prefill), so the samples are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from flowrl.elastic.prefill import PrefillRates, decide_hand_over, share_prefixes
from flowrl.engines.prefill import Prefixes, merge
from flowrl.engines.trie import plan_of
from flowrl.ir.attrs import GenerateAttrs
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.worker import ModelWorker, PromptEncoder

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class Share:
    """An instance's part: the prefixes it computes, those of them it offers to `box` (others take them), and
    the prefixes it takes from each owner (by the owner's rank)."""

    box: str
    rank: int
    mailbox: Any
    compute: tuple[Tokens, ...] = ()
    offer: tuple[Tokens, ...] = ()
    take: tuple[tuple[int, tuple[Tokens, ...]], ...] = ()
    patience_s: float | None = None  # the longest a taker waits for an owner before computing the prefixes itself
    skipped: int = 0  # prompt tokens this instance does not prefill (its prompts' prefixes)


def plan_shares(encoder: PromptEncoder, texts: Sequence[str], max_tokens: int, min_len: int,
                sizes: Sequence[int], mode: str, measured: PrefillRates, box: str,
                mailbox: Any) -> tuple[list[Share], dict[str, float]]:
    """Each instance's `Share` of a generation over `sizes` prompts an instance (in order), and what was
    decided (for the step's metrics)."""
    ids = [tuple(row) for row in encoder.ids(texts, max_tokens)]
    unique = sorted(set(ids))
    index = {p: u for u, p in enumerate(unique)}
    groups = plan_of(unique, [], min_len).groups
    instance_of = [i for i, size in enumerate(sizes) for _ in range(size)]
    in_group = {u: g for g, (_, m) in enumerate(groups) for u in m}
    members: list[list[int]] = [[] for _ in groups]
    for p, row in enumerate(ids):
        if index[row] in in_group:
            members[in_group[index[row]]].append(p)
    prefixes = [unique[m[0]][:length] for length, m in groups]
    taken = [length for (length, _), held in zip(groups, members, strict=True)
             for _ in range(len({instance_of[p] for p in held}) - 1)]  # one per instance other than the owner
    how = decide_hand_over(mode, measured.rate_s, measured.handover_s, taken)
    shares = share_prefixes(members, instance_of, len(sizes), how.handing)
    skipped = [0] * len(sizes)
    for (length, _), held in zip(groups, members, strict=True):
        for p in held:
            skipped[instance_of[p]] += length
    out = [Share(box, rank, mailbox, tuple(prefixes[g] for g in s.compute), tuple(prefixes[g] for g in s.offer),
                 tuple((owner, tuple(prefixes[g] for g, o in s.take if o == owner))
                       for owner in sorted({o for _, o in s.take})), how.patience_s, skipped[rank])
           for rank, s in enumerate(shares)]
    decided = {"prefixes": float(len(groups)), "handover": float(how.handing and bool(taken)),
               "prompt_tokens": float(sum(len(r) for r in ids))}
    if how.recompute_s is not None:
        decided["recompute_est_s"] = how.recompute_s
    if measured.handover_s is not None:
        decided["handover_est_s"] = measured.handover_s
    return out, decided


def shares_for(plan: dispatch.Plan, encoders: Mapping[str, PromptEncoder], mode: str, measured: PrefillRates,
               new_box: Callable[[], str], mailbox: Any) -> tuple[list[Share], str, dict[str, float]]:
    """A generation call's deduplicated prefill, on the driver: each instance's `Share`, the box owners offer
    prefixes in, and what was decided (the step's metrics, unprefixed) -> ([], "", {}) when it does not apply:
    not a generation, share-prefix off, vLLM (no encoder), `dedup_prefill = "off"`, no shared prefix."""
    if plan.method != "generate" or not plan.calls or len(plan.calls[0].args) < 3:
        return [], "", {}
    model, _, attrs = plan.calls[0].args[:3]
    a = GenerateAttrs.of(attrs)
    if model not in encoders or not a.share_prefix or mailbox is None:
        return [], "", {}
    shards = [c.args[1] for c in plan.calls]
    if not all(isinstance(b, Batch) and "prompt" in b.meta for b in shards):
        return [], "", {}
    box = new_box()
    shares, decided = plan_shares(encoders[model], [t for b in shards for t in b.meta["prompt"]], a.max_tokens,
                                  a.prefix_min_len, [b.size for b in shards], mode, measured, box, mailbox)
    if not decided["prefixes"]:
        return [], "", {}
    return shares, box, decided


def learned(measured: PrefillRates, stats: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """What the instances' deduplicated prefill measured: taught to `measured` (the next decision's rates) ->
    the step's metrics (prefix tokens computed, saved against every prompt prefilling its prefix, handed over;
    unprefixed; {} without stats)."""
    if not stats:
        return {}
    measured.learn(stats)
    computed = sum(s["prefill_tokens"] for s in stats)
    out = {"computed_tokens": computed, "saved_tokens": sum(s["skipped_tokens"] for s in stats) - computed,
           "prefill_s": sum(s["prefill_s"] for s in stats)}
    for key in ("handover_tokens", "handover_bytes", "handover_s", "handover_missed"):
        out[key] = sum(s[key] for s in stats)
    return out


def resolve(worker: ModelWorker, model: str, share: Share) -> tuple[Prefixes | None, dict[str, float]]:
    """On the instance: compute its prefixes (offering those others take), take the rest from their owners
    -> (all of them, for the engine; timings and sizes for the driver). An owner's word that has not come
    within `share.patience_s` (what computing its prefixes here is expected to cost) is not waited for: the
    instance computes those prefixes itself (a slow owner, or one still waiting for a device, never holds the
    others up for longer than that)."""
    stats = {"prefill_s": 0.0, "prefill_tokens": 0.0, "handover_s": 0.0, "handover_tokens": 0.0,
             "handover_bytes": 0.0, "handover_missed": 0.0, "skipped_tokens": float(share.skipped)}
    parts: list[Prefixes] = []
    if share.compute:
        own = _compute(worker, model, share.compute, stats)
        if share.offer:
            offered = own.select([share.compute.index(t) for t in share.offer])
            share.mailbox.offer.remote(share.box, (share.rank, [ray.put(offered)]))
        parts.append(own)
    if share.take:
        began = time.perf_counter()
        got = _take(share, None if share.patience_s is None else began + share.patience_s)
        missed: list[Tokens] = []
        for owner, wanted in share.take:
            have = got.get(owner)
            if have is None:
                missed.extend(wanted)
            else:
                parts.append(have.select([have.tokens.index(t) for t in wanted]))
                stats["handover_tokens"] += float(sum(len(t) for t in wanted))
                stats["handover_bytes"] += float(have.nbytes)
        if missed:
            parts.append(_compute(worker, model, tuple(missed), stats))
            stats["handover_missed"] = float(len(missed))
        stats["handover_s"] = time.perf_counter() - began
    return merge(parts), stats


def _compute(worker: ModelWorker, model: str, tokens: tuple[Tokens, ...], stats: dict[str, float]) -> Prefixes:
    began = time.perf_counter()
    out = worker.compute_prefixes(model, tokens)
    stats["prefill_s"] += time.perf_counter() - began
    stats["prefill_tokens"] += float(sum(len(t) for t in tokens))
    return out


def _take(share: Share, deadline: float | None) -> dict[int, Prefixes]:
    """The owners' words that come before `deadline` (None: all of them; a retried owner may offer twice: the
    first counts)."""
    owners = {owner for owner, _ in share.take}
    got: dict[int, Prefixes] = {}
    since = 0
    while not owners <= set(got):
        pending = share.mailbox.take_all.remote(share.box, since)
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        ready, _ = ray.wait([pending], timeout=left)
        if not ready:
            break
        words = ray.get(pending)
        if not words:  # the box was closed
            break
        since += len(words)
        for rank, ref in words:
            if rank in owners and rank not in got:
                got[rank] = ray.get(ref[0])
    return got
