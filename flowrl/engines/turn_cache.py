"""Kept KV caches of the multi-turn decode loop (flowrl.engines.turns): a trajectory's keys and values while
it is out of the decode batch, packed into a batch buffer when it joins, and the prefill of observations onto
them.

A trajectory out of the batch (its environment pending) holds its cache as `RowKV`: per layer, the keys and
values of its real tokens only (no padding), so it can rejoin any batch. `pack` left-pads several rows' caches
into one buffered cache (flowrl.engines.generation's `make_cache`) with an attention mask that is 0 on the
padding; `unpack` takes rows back out, dropping the padding by that mask. `prefill` runs several returning rows'
new tokens (the turn's last action token and the observation's ids) in one forward onto their kept caches:
positions continue each row's own count of real tokens, so a row's logits are those of a plain forward over its
whole sequence (to float rounding), and nothing already in the cache is run again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.engines.generation import kv_rows, make_cache
from flowrl.models.build import cache_kw

__all__ = ["RowKV", "pack", "prefill", "row_length", "unpack"]

RowKV = list[tuple[Tensor, Tensor]]  # per layer: (H, L, D) keys and values of one row's L real tokens


def row_length(kv: RowKV) -> int:
    """Tokens held by a row's kept cache (its next token's position)."""
    return int(kv[0][0].shape[1])


def pack(module: nn.Module, kvs: Sequence[RowKV], headroom: int) -> tuple[Any, Tensor, int]:
    """A decode cache holding `kvs` left-padded to the longest (width W), with room for `headroom` more tokens
    per row; returns (cache, (R, W + headroom) attention mask: 0 on each row's left padding, 1 after, W)."""
    lens = [row_length(kv) for kv in kvs]
    width = max(lens)
    cache, _ = make_cache(module, width + headroom)
    for layer_i, layer in enumerate(cache.layers):
        keys, values = [], []
        for kv in kvs:
            k, v = kv[layer_i]  # (H, L, D)
            pad = width - k.shape[1]
            keys.append(torch.cat([k.new_zeros((k.shape[0], pad, k.shape[2])), k], dim=1))
            values.append(torch.cat([v.new_zeros((v.shape[0], pad, v.shape[2])), v], dim=1))
        layer.update(torch.stack(keys), torch.stack(values))  # (R, H, W, D)
    attn = torch.zeros((len(kvs), width + headroom), dtype=torch.long, device=kvs[0][0][0].device)
    for row, length in enumerate(lens):
        attn[row, width - length :] = 1
    return cache, attn, width


def unpack(cache: Any, attn: Tensor, length: int, rows: Sequence[int]) -> list[RowKV]:
    """Copies of some rows' caches, real tokens only: `attn` is the cache's (R, >= length) mask, `length` the
    slots in use."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=attn.device)
    real = attn[idx, :length].bool()  # (r, length)
    out: list[RowKV] = [[] for _ in rows]
    for layer in cache.layers:
        keys, values = kv_rows(layer, idx)  # (r, H, length, D)
        for r in range(len(out)):
            out[r].append((keys[r][:, real[r]].clone(), values[r][:, real[r]].clone()))
    return out


def prefill(module: nn.Module, kvs: Sequence[RowKV], inputs: Sequence[Sequence[int]],
            pad: int) -> tuple[Tensor, list[RowKV]]:
    """Run each row's `inputs` (at least one token each) after its kept cache, all rows in one forward; returns
    the (R, V) scores of each row's next token and the rows' grown caches."""
    grow = max(len(ids) for ids in inputs)
    cache, attn, width = pack(module, kvs, grow)
    dev = attn.device
    ids = torch.full((len(inputs), grow), pad, dtype=torch.long, device=dev)  # (R, I) left-padded
    mask = torch.zeros((len(inputs), grow), dtype=torch.long, device=dev)
    for row, new in enumerate(inputs):
        ids[row, grow - len(new) :] = torch.as_tensor(list(new), dtype=torch.long)
        mask[row, grow - len(new) :] = 1
    full = torch.cat([attn[:, :width], mask], dim=1)  # (R, W + I)
    start = torch.tensor([row_length(kv) for kv in kvs], dtype=torch.long, device=dev)
    # Each new token's position continues its row's own count (pads take the last real position: never read).
    positions = start[:, None] + mask.cumsum(1) - 1  # (R, I)
    out = module(input_ids=ids, attention_mask=full, position_ids=positions, use_cache=True, logits_to_keep=1,
                 **cache_kw(module, cache))  # fmt: skip
    return out.logits[:, -1].float(), unpack(cache, full, width + grow, range(len(inputs)))
