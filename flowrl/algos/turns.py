"""Rewards and advantages over multi-turn trajectories: pure functions called by the advantage step functions
(flowrl.runtime.functions) on rollouts generated with an environment (`generate(..., env = NAME)`).

A trajectory is ONE packed sequence per sample: the response holds every turn's action tokens and the
observation tokens the environment answered with, `loss_mask` (B, T) is 1 on action tokens only, `turn_index`
(B, T) names each token's turn (-1 on padding) and `turn_rewards` (B, T) holds turn k's reward at turn k's last
action token. Training on it costs one forward/backward per trajectory, whatever its number of turns, and the
optimizer and LR schedule step once per mini-batch of trajectories: nothing here splits a trajectory into
per-turn samples (ROLL #409, SkyRL #1278: per-turn samples cost K times the compute and run the schedule K
times too fast). Turn-level credit is a per-token advantage on the same packed sequence instead.

Everything detaches its inputs: these are targets, not trained through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.algos.advantages import group_baseline, group_index, group_sum

# Relative spread of a group's total returns below which they count as equal (float32 rounding of sums of
# rewards is ~1e-7 relative): such a group is centred, not divided by its (near-zero) std.
FLAT = 1e-5

__all__ = ["FLAT", "last_valid_index", "token_rewards", "turn_advantages", "turn_returns", "turn_rloo_advantages"]


def last_valid_index(mask: Tensor) -> Tensor:
    """Index of each row's last position where mask > 0, (B, T) -> (B,) long; 0 for a row with none.

    With observation tokens inside a response the last action token is not at `mask.sum() - 1`: take the
    largest valid index instead (equal to it on a right-padded mask)."""
    positions = torch.arange(mask.shape[1], device=mask.device)  # (T,)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(dim=1)  # (B,)


def token_rewards(scores: Tensor, mask: Tensor, turn_rewards: Tensor | None = None) -> Tensor:
    """Per-token rewards (B, T) for the token-level estimators (GAE, REINFORCE++): the outcome `scores` (B,)
    at each row's last valid token of `mask`, plus `turn_rewards` (B, T) where given (the environment's
    reward of each turn at that turn's last action token). Zero on masked positions (a row with no valid
    token gets no reward)."""
    m = mask.float()  # (B, T)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # (B, T)
    out.scatter_(1, last_valid_index(mask)[:, None], scores.detach().float()[:, None])
    if turn_rewards is not None:
        out = out + turn_rewards.detach().float()
    return out * m


def _per_turn(turn_rewards: Tensor, turn_index: Tensor, scores: Tensor) -> Tensor:
    """G (B, K): G[i, k] = sum_{j >= k} r_{i,j} + s_i, the return from turn k on (K = turns of the longest
    trajectory, at least 1). G[:, 0] is the trajectory's total return. Rewards on tokens of no turn
    (turn_index -1) are dropped."""
    index = turn_index.long()  # (B, T)
    turns = max(int(index.max()) + 1, 1) if index.numel() else 1
    valid = index >= 0  # (B, T)
    rewards = torch.where(valid, turn_rewards.detach().to(scores.dtype), torch.zeros((), dtype=scores.dtype))
    per_turn = torch.zeros(index.shape[0], turns, dtype=scores.dtype, device=scores.device)  # (B, K)
    per_turn.scatter_add_(1, index.clamp(min=0), rewards)
    suffix = per_turn.flip(1).cumsum(1).flip(1)  # (B, K) sum_{j >= k} r_j
    return suffix + scores.detach()[:, None]


def turn_returns(turn_rewards: Tensor, turn_index: Tensor, loss_mask: Tensor, scores: Tensor) -> Tensor:
    """Turn k's return G_{i,k} = sum_{j >= k} r_{i,j} + s_i on every action token of turn k, (B, T); 0 off
    the loss mask. turn_rewards, turn_index, loss_mask: (B, T); scores: (B,) the trajectory's final score
    (its declared rewards; 0 when it has none)."""
    scores = scores.detach().float()  # (B,)
    g = _per_turn(turn_rewards, turn_index, scores)  # (B, K)
    tokens = g.gather(1, turn_index.long().clamp(min=0))  # (B, T)
    keep = (loss_mask > 0) & (turn_index >= 0)
    return torch.where(keep, tokens, torch.zeros_like(tokens))


def turn_advantages(
    turn_rewards: Tensor,
    turn_index: Tensor,
    loss_mask: Tensor,
    scores: Tensor,
    group: int | Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Turn-level GRPO: A_{i,k} = (G_{i,k} - b_g) / (std_g + eps) on turn k's action tokens, (B, T).

    G_{i,k} = sum_{j >= k} r_{i,j} + s_i is the return from turn k on (`turn_returns`); b_g and std_g are the
    mean and unbiased std over the group of the trajectories' TOTAL returns G_{i,0} (norm_std=False: centre
    only, Dr.GRPO). The baseline is one number per group and does not depend on when a trajectory stopped.
    Normalising per turn index instead (the mean of the G_{.,k} of the trajectories that reached turn k) is
    biased when the policy decides when to stop: turn k's baseline is then computed over a sample selected by
    the policy's own stopping (only the trajectories that lived that long), so stopping early or late shifts
    every later turn's advantage (verl RFC #7244). A group of one has mean 0, std 1 (A = G), as
    `grpo_advantages`. With one turn per trajectory this is GRPO's advantage of s_i + r_i broadcast on the
    action tokens.

    A group whose total returns are all equal (std_g <= FLAT * (1 + |b_g|), rounding included) is centred
    only. GRPO gives 0 there whatever it divides by; here a later turn's return still differs from the
    baseline (the rewards before it are behind it: three misses at -0.1 give G = -0.3, -0.2, -0.1 against
    b = -0.3), and dividing that by eps would make advantages of 1e5 and wreck the update.

    turn_rewards, turn_index, loss_mask: (B, T) (see the module docstring); scores: (B,) the declared
    rewards' score; group: as in `grpo_advantages`. 0 off the loss mask.
    """
    scores = scores.detach().float()  # (B,)
    g = _per_turn(turn_rewards, turn_index, scores)  # (B, K)
    mean, std = group_baseline(g[:, 0], group)  # (B,), (B,) of the total returns
    tokens = g.gather(1, turn_index.long().clamp(min=0))  # (B, T)
    adv = tokens - mean[:, None]
    if norm_std:
        flat = std <= FLAT * (1 + mean.abs())  # (B,) no spread among the totals: centre only
        scale = torch.where(flat, torch.ones_like(std), std + eps)  # (B,)
        adv = adv / scale[:, None]
    keep = (loss_mask > 0) & (turn_index >= 0)
    return torch.where(keep, adv, torch.zeros_like(adv))


def turn_rloo_advantages(
    turn_rewards: Tensor, turn_index: Tensor, loss_mask: Tensor, scores: Tensor, group: int | Tensor
) -> Tensor:
    """Turn-level RLOO: A_{i,k} = G_{i,k} - (sum_{j in g} G_{j,0} - G_{i,0}) / (n - 1), (B, T).

    The baseline is the mean of the OTHER trajectories' total returns, for the same reason as
    `turn_advantages` (it must not depend on when a trajectory stopped). A group of one keeps A = G, as
    `rloo_advantages`. With one turn per trajectory this is RLOO's advantage broadcast on the action tokens.
    """
    scores = scores.detach().float()  # (B,)
    g = _per_turn(turn_rewards, turn_index, scores)  # (B, K)
    total = g[:, 0]  # (B,)
    inverse, counts = group_index(group, total.shape[0], total.device)
    n = counts.to(total.dtype)[inverse]  # (B,)
    others = (group_sum(total, inverse, len(counts))[inverse] - total) / (n - 1).clamp(min=1)  # (B,)
    baseline = torch.where(n > 1, others, torch.zeros_like(others))
    adv = g.gather(1, turn_index.long().clamp(min=0)) - baseline[:, None]  # (B, T)
    keep = (loss_mask > 0) & (turn_index >= 0)
    return torch.where(keep, adv, torch.zeros_like(adv))
