"""The prompt cache of shared-prefix forwards (flowrl.engines): each module's computed prompts, kept until its
weights change, so the chunks of a streamed rollout (fuse-gen-inference) compute each prompt once too.

Invalidation is explicit: whatever changes a module's weights calls `weights_changed(module)` (flowrl does it
in `ModelWorker` after each optimizer step and weight load), and the next `cache_of(module)` finds the cache
stale and empties it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

KV = list[tuple[Tensor, Tensor]]  # per layer: keys, values (rows, heads, slots, head_dim)


@dataclass
class PromptState:
    """The prompt levels (A and B) computed once per unique prompt: what responses and decoding attend to."""

    kv: KV  # (U, heads, W, d) per layer
    mask: Tensor  # (U, W) 1 where a slot holds a real prompt token
    lengths: Tensor  # (U,) prompt length = position of response token 0
    last: Tensor  # (U, V) logits or (U, H) hidden state at each prompt's last token


class PromptCache:
    """One module's computed prompts (levels A + B, one row each), reused by its later forwards until its
    weights change (`weights_changed`)."""

    CAPACITY = 512  # prompts kept, least recently used dropped first

    def __init__(self) -> None:
        self.version = -1
        self.entries: OrderedDict[tuple[int, ...], PromptState] = OrderedDict()
        self.lock = threading.Lock()


_CACHES: weakref.WeakKeyDictionary[nn.Module, PromptCache] = weakref.WeakKeyDictionary()
_VERSIONS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # bumped by weights_changed
_LOCK = threading.Lock()


def weights_changed(module: nn.Module) -> None:
    """Say that `module`'s weights changed (an optimizer step, a weight load): its cached prompts are stale.
    Every place flowrl changes weights calls this (`ModelWorker.update`, `load_state_dict`, `load_weights`)."""
    with _LOCK:
        _VERSIONS[module] = _VERSIONS.get(module, 0) + 1


def cache_of(module: nn.Module) -> PromptCache:
    """`module`'s prompt cache, emptied first if its weights changed since it was filled."""
    with _LOCK:
        cache = _CACHES.setdefault(module, PromptCache())
        version = _VERSIONS.get(module, 0)
    with cache.lock:
        if version != cache.version:
            cache.entries.clear()
            cache.version = version
    return cache


def clear() -> None:
    """Forget every module's cached prompts (benchmarks that measure computing them)."""
    with _LOCK:
        _CACHES.clear()


def store(cache: PromptCache, prompts: Sequence[tuple[int, ...]], state: PromptState) -> None:
    """Keep row i of `state` as the computed prompt `prompts[i]` (copied: a row must not pin its batch)."""
    with cache.lock:
        for i, p in enumerate(prompts):
            cache.entries[p] = PromptState([(k[i : i + 1].clone(), v[i : i + 1].clone()) for k, v in state.kv],
                                           state.mask[i : i + 1].clone(), state.lengths[i : i + 1].clone(),
                                           state.last[i : i + 1].clone())
            cache.entries.move_to_end(p)
        while len(cache.entries) > cache.CAPACITY:
            cache.entries.popitem(last=False)


def stack(rows: Sequence[PromptState]) -> PromptState:
    """One PromptState of single-prompt states, left-padded to the widest (zero keys/values, mask 0)."""
    kv, mask = stack_kv([r.kv for r in rows], [r.mask for r in rows])
    return PromptState(kv, mask, torch.cat([r.lengths for r in rows]), torch.cat([r.last for r in rows]))


def stack_kv(kvs: Sequence[KV], masks: Sequence[Tensor]) -> tuple[KV, Tensor]:
    """Caches of different widths (each (rows, heads, width, d) per layer, with a (rows, width) mask) as one,
    left-padded to the widest: zero keys and values, mask 0."""
    width = max(m.shape[1] for m in masks)

    def left(x: Tensor, dim: int) -> Tensor:
        gap = list(x.shape)
        gap[dim] = width - x.shape[dim]
        return torch.cat([x.new_zeros(gap), x], dim=dim)

    kv = [(torch.cat([left(c[i][0], 2) for c in kvs]), torch.cat([left(c[i][1], 2) for c in kvs]))
          for i in range(len(kvs[0]))]
    return kv, torch.cat([left(m, 1) for m in masks])
