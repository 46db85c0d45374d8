"""Common prompt prefixes computed once (flowrl.engines): a system prompt or a few-shot preamble shared by many
prompts runs once, and each prompt's rest runs after its prefix's keys and values.

`Prefixes` are the computed prefixes: their tokens and, per layer, keys and values (left-padded rows, a mask).
They are plain tensors, so one process can compute them and hand them to others (the serverless backend's
deduplicated prefill, RLHFless): `generate` and `generate_stream` take them and prefill only what follows. The
same two levels serve the shared-prefix forwards (flowrl.engines.prefix: level A is `compute_prefixes`, level B
`expand` + the rest). In the cache a prompt's row is [holes | prefix | holes | rest]: holes are masked out of
attention and positions count real tokens only, so every token sees exactly the tokens and positions it sees in
one left-padded prompt (equal to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from flowrl.engines.prompt_cache import KV, stack_kv
from flowrl.models.build import ValueModel, cache_kw

__all__ = ["Prefixes", "compute_prefixes", "expand", "left_pad", "level", "match", "merge", "supports_levels"]

@dataclass
class Prefixes:
    """Computed prompt prefixes: `tokens[g]` and, per layer, their keys and values (G, heads, L, d), left-padded
    to the longest (`mask` (G, L) is 1 on real tokens)."""

    tokens: list[tuple[int, ...]]
    kv: KV
    mask: Tensor

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    def to(self, device: torch.device) -> Prefixes:
        return Prefixes(self.tokens, [(k.to(device), v.to(device)) for k, v in self.kv], self.mask.to(device))

    def select(self, rows: Sequence[int]) -> Prefixes:
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        width = max(1, max((len(self.tokens[i]) for i in rows), default=1))
        return Prefixes([self.tokens[i] for i in rows], [(k[idx, :, -width:], v[idx, :, -width:]) for k, v in self.kv],
                        self.mask[idx, -width:])


def supports_levels(module: nn.Module) -> bool:
    """Only plain full-attention caches can be split into levels (sliding-window layers cannot)."""
    lm = module.backbone if isinstance(module, ValueModel) else module
    config = getattr(lm, "config", None)
    if config is None:
        return False
    layers = getattr(DynamicCache(config=config), "layers", [])
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def left_pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def run(module: nn.Module, ids: Tensor, attn: Tensor, positions: Tensor, past: KV | None,
        keep: int) -> tuple[Tensor, KV]:
    """One level: `ids` (b, w) after `past` (b, heads, s, d) per layer, with a 2-D (b, s + w) or 4-D attention
    mask. Returns the last `keep` outputs (logits (b, keep, V) for an LM, hidden states (b, keep, H) for a
    value model) and the grown cache."""
    lm: Any = module.backbone if isinstance(module, ValueModel) else module
    cache = DynamicCache(config=lm.config)
    for i, (k, v) in enumerate(past or []):
        cache.update(k, v, i)
    if isinstance(module, ValueModel):
        out = lm(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **cache_kw(lm, cache))
        result = out.last_hidden_state[:, -keep:]
    else:
        out = module(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
                     logits_to_keep=keep, **cache_kw(module, cache))  # fmt: skip
        result = out.logits[:, -keep:]
    layers: list[Any] = list(cache.layers)
    return result, [(layer.keys, layer.values) for layer in layers]


def positions(mask: Tensor, start: Tensor) -> Tensor:
    """Positions of left-padded rows that count real tokens from `start` (b,)."""
    return (start[:, None] + mask.cumsum(-1) - 1).clamp(min=0)


def level(module: nn.Module, ids: Tensor, mask: Tensor, start: Tensor, past: KV | None,
          past_mask: Tensor | None, keep: int) -> tuple[Tensor, KV]:
    """A level of left-padded rows: positions count real tokens from `start` (b,)."""
    attn = mask if past_mask is None else torch.cat([past_mask, mask], dim=1)  # (b, s + w)
    return run(module, ids, attn, positions(mask, start), past, keep)


def compute_prefixes(module: nn.Module, tokens: Sequence[tuple[int, ...]], pad: int,
                     device: torch.device) -> Prefixes:
    """Each prefix once, from position 0 (level A); under the caller's grad mode."""
    ids, mask = left_pad(tokens, pad, device)
    _, kv = level(module, ids, mask, torch.zeros(len(tokens), dtype=torch.long, device=device), None, None, 1)
    return Prefixes(list(tokens), kv, mask)


def merge(parts: Sequence[Prefixes]) -> Prefixes | None:
    """Prefixes from several places as one (left-padded to the longest); None when there are none."""
    parts = [p for p in parts if p.tokens]
    if not parts:
        return None
    kv, mask = stack_kv([p.kv for p in parts], [p.mask for p in parts])
    return Prefixes([t for p in parts for t in p.tokens], kv, mask)


def match(prompts: Sequence[Sequence[int]], prefixes: Prefixes) -> list[int]:
    """Each prompt's prefix: the longest of `prefixes` it opens with and outlasts by a token at least (its last
    token scores response token 0), or -1."""
    out = []
    for p in prompts:
        best, length = -1, 0
        for g, tokens in enumerate(prefixes.tokens):
            if length < len(tokens) < len(p) and tuple(p[: len(tokens)]) == tokens:
                best, length = g, len(tokens)
        out.append(best)
    return out


def expand(prefixes: Prefixes, group_of: Sequence[int]) -> tuple[KV, Tensor, Tensor]:
    """Level A per prompt: (keys and values (B, heads, L, d), mask (B, L), prefix length (B,)); a prompt without
    a prefix (-1) gets an all-masked zero row, so the rest of every prompt runs as one batch."""
    device = prefixes.mask.device
    rows = torch.tensor([max(g, 0) for g in group_of], device=device)
    keep = torch.tensor([g >= 0 for g in group_of], device=device)
    past = [(k[rows] * keep[:, None, None, None], v[rows] * keep[:, None, None, None]) for k, v in prefixes.kv]
    lengths = torch.tensor([len(prefixes.tokens[g]) if g >= 0 else 0 for g in group_of], dtype=torch.long,
                           device=device)
    return past, prefixes.mask[rows] * keep[:, None], lengths
