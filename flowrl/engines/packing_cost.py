"""The layout cost model of shared-prefix forwards (flowrl.engines): whether a prompt's samples run packed into
one row after it, or each on a copy of the prompt's cache (`packing_pays`), and the packed rows' sizes.

Tests set `PACKING = "always"` or `PACK_LIMIT = 0` here to force one layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.models.build import ValueModel

PACK_LIMIT = 1024  # packed rows longer than this would make the (q, q) mask cost more than the copies saved
COPY_COST = 1 / 16  # a prompt token's keys and values copied for one sample, in token runs (`packing_pays`)
PACKING = "auto"  # "auto": packed rows where they cost less (`packing_pays`); "always" (tests): wherever allowed


def run_lengths(response_mask: Tensor) -> Tensor:
    """(b,) how many leading response tokens each sample runs: all but its last real one (the last one's output
    scores nothing). A mask that is not one run of 1s from the start keeps every column (nothing left out)."""
    width = response_mask.shape[1] - 1
    lens = response_mask.long().sum(1)
    leading = torch.arange(response_mask.shape[1], device=response_mask.device)[None] < lens[:, None]
    if not bool((response_mask.bool() == leading).all()):
        return torch.full_like(lens, width)
    return (lens - 1).clamp(min=0, max=width)


def packed_rows(row_prompt: Sequence[int], response_mask: Tensor) -> dict[int, int]:
    """The packed rows `prefix.packing` would build for these rows: unique prompt -> the tokens of its samples."""
    runs = run_lengths(response_mask).tolist()
    per: dict[int, int] = {}
    for u, n in zip(row_prompt, runs, strict=True):
        per[u] = per.get(u, 0) + n
    return per


def packed_width(row_prompt: Sequence[int], response_mask: Tensor) -> int:
    """The longest packed row `prefix.packing` would build for these rows: the tokens of a prompt's samples."""
    return max(packed_rows(row_prompt, response_mask).values(), default=0)


def packing_pays(module: nn.Module, packed_rows: Mapping[int, int], prompt_width: int,
                  response_shape: Sequence[int]) -> bool:
    """Whether packed rows cost less than running each sample on a copy of its prompt's cache. Packed, a
    prompt's samples run as one row and the rows are padded to the longest (U' x q tokens, each attending up to
    P + q places); on copies, every sample runs padded to the longest response (N x (T - 1) tokens, P + T - 1
    places) after a copy of its prompt's keys and values (N x P). Per layer a token costs ~24 d^2 multiply-adds
    in the linear layers and an attended place ~4 d (d: the hidden size); a copied prompt token about 1/16 of a
    token run (fitted on CPU). Short samples pack well; a long tail packs into long rows that cost more than
    the copies saved. Measured (CPU, one thread): 20 tail samples of a long-tail batch 30.7 ms packed vs 15.9 ms
    on copies; the whole batch of 128, 58 ms vs 120 ms; 8 prompts of 65 tokens x 8 samples of 16, 0.190 s vs
    0.225 s for the four forwards of bench/passes_share_prefix.py."""
    units, q = len(packed_rows), max(packed_rows.values(), default=0)
    rows, width = response_shape[0], response_shape[1] - 1
    lm: Any = module.backbone if isinstance(module, ValueModel) else module
    per_place = 1.0 / (6 * max(1, int(getattr(lm.config, "hidden_size", 0) or 768)))  # 4d / 24d^2

    def cost(tokens: int, places: int) -> float:
        return tokens * (1.0 + places * per_place)

    copies = rows * prompt_width * COPY_COST
    return cost(units * q, prompt_width + q) <= cost(rows * width, prompt_width + width) + copies
