"""DAPO's two pieces outside the loss (Yu et al. 2025, arXiv:2503.14476), as pure tensor functions: the group filter
of dynamic sampling and the soft overlong punishment. (Its loss pieces are `policy_loss`'s `clip_high` and
`agg = "token-mean"`.) The controller calls them: flowrl.runtime.refill filters a rollout's groups and draws more
prompts, flowrl.runtime.shaping adds the punishment to a reward's scores.

Both follow verl (the DAPO authors' code: `recipe/dapo/dapo_ray_trainer.py` and
`verl/workers/reward_manager/dapo.py`); where the numbers could differ it is said below.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KEEP", "all_equal_groups", "kept_groups", "overlong_penalty"]

# filter_groups's `keep`: "mixed" drops the groups whose samples all scored the same (their GRPO advantages are all
# 0: no gradient, only a share of the token-mean denominator); "all" keeps every group (no filtering, no refill).
KEEP = ("mixed", "all")


def all_equal_groups(returns: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The groups of a rollout in the order they first appear: (their ids (G,), whether every sample of the group
    has the same return (G,) bool, their sizes (G,)). `returns` (B,) is each sample's total score (the declared
    reward plus the environment's return), `group_ids` (B,) its group.

    "The same" is exact equality (max == min). verl keeps a group whose `np.std` is above 0, which a float mean can
    make of equal values (three samples of 0.1: std 1.4e-17): such a group's advantages are all 0 here and there,
    so dropping it is what dynamic sampling means."""
    ids = group_ids.detach().long()  # (B,)
    uniq, inverse = torch.unique(ids, return_inverse=True)  # uniq sorted; (G,), (B,)
    first = torch.full((len(uniq),), ids.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(ids.numel()), reduce="amin")  # (G,) each group's first position
    order = torch.argsort(first)
    r = returns.detach().double()  # (B,)
    hi = torch.full((len(uniq),), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, reduce="amax")
    lo = torch.full((len(uniq),), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, reduce="amin")
    sizes = torch.bincount(inverse, minlength=len(uniq))
    return uniq[order], (hi == lo)[order], sizes[order]


def kept_groups(returns: Tensor, group_ids: Tensor, keep: str = "mixed") -> tuple[Tensor, int]:
    """(the ids of the groups dynamic sampling keeps, in order of first appearance (K,), how many all-equal groups
    it dropped). `keep = "mixed"`: a group whose returns are not all equal, and, as verl does, a group of one
    sample (its std is 0, yet it has no one to be compared with: verl keeps it, `std > 0 or len == 1`);
    `keep = "all"`: every group."""
    if keep not in KEEP:
        raise ValueError(f"keep = {keep!r}: expected one of {', '.join(map(repr, KEEP))}")
    ids, equal, sizes = all_equal_groups(returns, group_ids)
    if keep == "all":
        return ids, 0
    dropped = equal & (sizes > 1)  # (G,)
    return ids[~dropped], int(dropped.sum())


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (B,), added to each response's reward; `lengths` (B,) are the responses'
    token counts (EOS included, as verl's `valid_response_length`), `max_tokens` the generation's limit L_max,
    `buffer` L_cache and `penalty` the factor P:

        0                                  |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache * P     L_max - L_cache < |y| <= L_max
        -P                                 L_max < |y|

    verl computes min(-(|y| - (L_max - L_cache)) / L_cache * P, 0), which is the same for every length a generation
    capped at L_max can give (beyond it, verl's keeps falling; the paper's and this one stay at -P). `buffer = 0`:
    no punishment (0 for every response)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_tokens:
        raise ValueError(f"overlong buffer {buffer} is longer than max_tokens {max_tokens}")
    expected = max_tokens - buffer
    exceed = lengths.detach().float() - expected  # (B,)
    return (-exceed / buffer * penalty).clamp(min=-penalty, max=0.0) + 0.0  # + 0.0: no -0.0 in the metrics
