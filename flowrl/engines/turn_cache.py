"""Kept KV caches of the multi-turn decode loop (flowrl.engines.turns): a trajectory's keys and values while
it is out of the decode batch, and the packing of kept caches into the batch's buffer when trajectories join.

A trajectory out of the batch (its environment pending) holds its cache as `RowKV`: per layer, the keys and
values of its real tokens only (no padding), so it can rejoin any batch. `pack` left-pads kept caches (and,
when rows join a running batch, the batch's own rows, already packed) into one buffered cache
(flowrl.engines.generation's `make_cache`) with a mask that is 0 on padding; `unpack` takes rows back out,
dropping the padding by that mask. The new tokens that follow (observations) may leave padding inside a row
too: attention reads the mask, positions continue each row's own count of real tokens, so a row's scores are
those of a plain forward over its whole sequence (to float rounding). When squeezing the padding out would
narrow the buffer by a quarter, `pack` does (per row: the only per-row copies besides rows leaving).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.engines.generation import kv_rows, make_cache

__all__ = ["Packed", "RowKV", "pack", "packed_rows", "row_length", "unpack"]

RowKV = list[tuple[Tensor, Tensor]]  # per layer: (H, L, D) keys and values of one row's L real tokens
# Rows already packed: per layer (R, H, L, D) keys and values, and their (R, L) mask (0 on padding).
Packed = tuple[list[tuple[Tensor, Tensor]], Tensor]


def row_length(kv: RowKV) -> int:
    """Tokens held by a row's kept cache (its next token's position)."""
    return int(kv[0][0].shape[1])


def packed_rows(cache: Any, attn: Tensor, length: int) -> Packed:
    """All rows of a decode cache with `length` slots in use, as `Packed`: views of its buffers where they hold
    every row whole (read before the cache is dropped: `pack` copies them), else copies."""
    idx = torch.arange(attn.shape[0], device=attn.device)
    layers = [(layer.keys, layer.values) if getattr(layer, "prefix", None) is None and layer.keys is not None
              else kv_rows(layer, idx) for layer in cache.layers]  # fmt: skip
    return layers, attn[:, :length]


def unpack(cache: Any, attn: Tensor, length: int, rows: Sequence[int]) -> list[RowKV]:
    """Copies of some rows' caches, real tokens only: `attn` is the cache's (R, >= length) mask, `length` the
    slots in use."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=attn.device)
    return _compact([kv_rows(layer, idx) for layer in cache.layers], attn[idx, :length])


def _compact(layers: list[tuple[Tensor, Tensor]], mask: Tensor) -> list[RowKV]:
    real = mask.bool()  # (r, L)
    out: list[RowKV] = [[] for _ in range(real.shape[0])]
    for keys, values in layers:  # (r, H, L, D)
        for r in range(len(out)):
            out[r].append((keys[r][:, real[r]].clone(), values[r][:, real[r]].clone()))
    return out


def pack(module: nn.Module, kvs: Sequence[RowKV], headroom: int,
         packed: Sequence[Packed] = ()) -> tuple[Any, Tensor, int]:
    """A decode cache holding the `packed` groups' rows (first, in order, padding kept) then the kept caches
    `kvs`, left-padded to a common width W, with room for `headroom` more tokens per row; returns (cache,
    (R, W) mask, W)."""
    groups = list(packed)
    if groups:
        lens = [row_length(kv) for kv in kvs]
        real = max([int(g[1].sum(1).max()) for g in groups] + lens)  # the widest row without its padding
        if real <= 0.75 * max([g[1].shape[1] for g in groups] + lens):
            # Padding inside rows (observations of uneven lengths) makes the buffer a third wider: squeeze it out.
            kvs = [row for g in groups for row in _compact(*g)] + list(kvs)
            groups = []
    lens = [row_length(kv) for kv in kvs]
    width = max(lens + [g[1].shape[1] for g in groups])
    cache, _ = make_cache(module, width + headroom)
    dev = groups[0][1].device if groups else kvs[0][0][0].device
    masks = [_left(g[1], width, 1) for g in groups]
    if kvs:
        own = torch.zeros((len(kvs), width), dtype=torch.long, device=dev)
        for row, length in enumerate(lens):
            own[row, width - length :] = 1
        masks.append(own)
    mask = torch.cat(masks)  # (R, W)
    for layer_i, layer in enumerate(cache.layers):
        # One (R, H, W, D) tensor filled in place: the buffer's update is then the only other copy.
        k0, v0 = groups[0][0][layer_i] if groups else kvs[0][layer_i]
        keys = k0.new_zeros((mask.shape[0], k0.shape[-3], width, k0.shape[-1]))
        values = v0.new_zeros((mask.shape[0], v0.shape[-3], width, v0.shape[-1]))
        row = 0
        for g in groups:
            k, v = g[0][layer_i]  # (Rg, H, Lg, D)
            keys[row : row + k.shape[0], :, width - k.shape[2] :] = k
            values[row : row + v.shape[0], :, width - v.shape[2] :] = v
            row += k.shape[0]
        for kv in kvs:
            k, v = kv[layer_i]  # (H, L, D)
            keys[row, :, width - k.shape[1] :] = k
            values[row, :, width - v.shape[1] :] = v
            row += 1
        layer.update(keys, values)  # (R, H, W, D)
    return cache, mask, width


def _left(x: Tensor, width: int, dim: int) -> Tensor:
    """`x` padded with zeros on the left of `dim` to `width`."""
    pad = width - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_zeros(shape), x], dim=dim)
