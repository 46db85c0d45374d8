"""Advantage estimators: pure functions called by the step functions of the controller.

Every function takes plain tensors and returns new tensors; nothing here knows about models, workers or
batches. Estimators treat their inputs as fixed targets (they are detached), so no autograd graph is
built through the reward or value tensors. Conventions follow verl's `core_algos` so results can be
compared number for number; where we differ it is said in the docstring.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gae", "group_baseline", "group_index", "group_sum", "grpo_advantages", "reinforce_pp_returns", "rloo_advantages", "whiten"]


def group_index(group: int | Tensor, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Map `group` to (dense group index per sample (B,), size of each group (G,))."""
    if isinstance(group, int):
        if group < 1 or batch % group != 0:
            raise ValueError(f"group size {group} must be >= 1 and divide the batch size {batch}")
        inverse = torch.arange(batch, device=device) // group  # (B,)
    else:
        if group.shape != (batch,):
            raise ValueError(f"group ids must have shape ({batch},), got {tuple(group.shape)}")
        if group.is_floating_point() or group.is_complex():
            raise ValueError(f"group ids must be an integer tensor, got {group.dtype}")
        # Ids may be arbitrary (e.g. prompt uids hashed to int64) and in any order: densify them.
        _, inverse = torch.unique(group.to(device), return_inverse=True)  # (B,)
    counts = torch.bincount(inverse)  # (G,)
    return inverse, counts


def group_sum(x: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Sum of `x` (B,) within each group -> (G,)."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_baseline(scores: Tensor, group: int | Tensor) -> tuple[Tensor, Tensor]:
    """Each sample's group mean and unbiased group std of `scores` (B,) -> (mean (B,), std (B,)).

    A group of one has no baseline: mean 0, std 1 there (verl's convention), so a centred, scaled value is the
    score itself. Shared by `grpo_advantages` and the turn-level estimators (flowrl.algos.turns), so both
    normalise with the same numbers.
    """
    scores = scores.detach()  # (B,)
    inverse, counts = group_index(group, scores.shape[0], scores.device)
    n = counts.to(scores.dtype)  # (G,)
    mean = group_sum(scores, inverse, len(counts)) / n  # (G,)
    centred = scores - mean[inverse]  # (B,)
    # n - 1 is 0 for singleton groups; clamp only to keep the division finite, the value is replaced below.
    var = group_sum(centred * centred, inverse, len(counts)) / (n - 1).clamp(min=1)  # (G,)
    single = (counts == 1)[inverse]  # (B,)
    std = torch.where(single, torch.ones_like(scores), var.sqrt()[inverse])  # (B,)
    return torch.where(single, torch.zeros_like(scores), mean[inverse]), std


def grpo_advantages(
    scores: Tensor, group: int | Tensor, *, norm_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantage A_i = (r_i - mean_G) / (std_G + eps), one value per sample.

    scores: (B,) float, one scalar reward per response.
    group: an int n (consecutive blocks of n samples share a prompt) or integer ids (B,) in any order.
    norm_std: False gives Dr.GRPO (arXiv:2503.20783): centre only, no division by the std.

    std is unbiased (n - 1), like `torch.std`. A group of one has no baseline: verl uses mean 0, std 1
    there, so A = r; we do the same.
    """
    scores = scores.detach()  # (B,)
    mean, std = group_baseline(scores, group)  # (B,), (B,)
    centred = scores - mean
    if not norm_std:
        return centred
    return centred / (std + eps)


def rloo_advantages(scores: Tensor, group: int | Tensor) -> Tensor:
    """RLOO advantage A_i = r_i - (sum_G r - r_i) / (n - 1): the baseline is the mean of the *other* samples.

    scores: (B,) float; group: as in `grpo_advantages`.

    A group of one has no other samples. verl then leaves the score untouched (baseline 0, so A = r_i),
    which also matches GRPO's singleton convention; we do the same.
    """
    scores = scores.detach()  # (B,)
    inverse, counts = group_index(group, scores.shape[0], scores.device)
    n = counts.to(scores.dtype)[inverse]  # (B,) size of each sample's group
    total = group_sum(scores, inverse, len(counts))[inverse]  # (B,)
    baseline = (total - scores) / (n - 1).clamp(min=1)  # (B,) clamp keeps singletons finite
    return torch.where(n > 1, scores - baseline, scores)


def reinforce_pp_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ discounted returns G_t = sum_{k>=t} gamma^(k-t) r_k over valid tokens, (B, T) -> (B, T).

    Masked positions are skipped as if absent: they contribute no reward, get return 0, and the exponent
    counts valid tokens only, so a trajectory with observation tokens inside its response gets the returns
    of its compacted action-token sequence (the discount is per action, not per observed token). On right
    padding alone this is the plain suffix recursion. Note verl instead *resets* the running return at every
    masked token. Whitening is separate: call `whiten` after.
    """
    m = mask.to(token_rewards.dtype)  # (B, T)
    rewards = token_rewards.detach() * m  # (B, T)
    returns = torch.zeros_like(rewards)  # (B, T)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        m_t = m[:, t]
        # A masked token passes the running return through untouched (no extra factor of gamma).
        running = torch.where(m_t > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m_t
    return returns


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (arXiv:1506.02438) -> (advantages, returns), each (B, T).

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};  R_t = A_t + V_t.

    Masked tokens (padding, or observation tokens inside a multi-turn response) are skipped: at a masked
    position the bootstrap value V_{t+1} and the running advantage keep the values of the next valid token,
    so valid tokens see each other as if the masked ones were absent. The result on the valid tokens is GAE
    on the compacted action-token sequence: rewards and values at masked positions are ignored (an
    observation is not an action, so it has no delta of its own). Advantages and returns at masked positions
    are 0 (verl stores the carried running advantage there; nothing may train on it, so we store nothing).

    Not whitened: the caller decides (see `whiten`).
    """
    m = mask.to(values.dtype)  # (B, T)
    rewards = token_rewards.detach()  # (B, T)
    values = values.detach()  # (B, T)
    advantages = torch.zeros_like(values)  # (B, T)
    next_value = torch.zeros_like(values[:, 0])  # (B,) V after the last token is 0 (terminal)
    last_gae = torch.zeros_like(values[:, 0])  # (B,)
    for t in reversed(range(values.shape[1])):
        m_t = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last_gae
        # Only a valid token moves the recursion; a masked one passes the previous state through.
        next_value = values[:, t] * m_t + (1 - m_t) * next_value
        last_gae = candidate * m_t + (1 - m_t) * last_gae
        advantages[:, t] = last_gae
    returns = (advantages + values) * m  # (B, T)
    return advantages * m, returns


def whiten(
    x: Tensor, mask: Tensor, unbiased: bool = True, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise `x` (B, T) to zero mean, unit variance over its valid entries (verl `masked_whiten`).

    (x - mu) * rsqrt(var + eps) with mu, var the masked mean and variance; `unbiased` applies the
    n / (n - 1) correction. shift_mean=False adds mu back (scale only). Masked entries come back as 0.
    With fewer than two valid entries the correction is skipped (var is 0 there, nothing to correct)
    instead of raising as verl does.
    """
    m = mask.to(x.dtype)  # (B, T)
    x = x.detach()
    n = m.sum()
    denom = n.clamp(min=1)  # an all-masked input gives mean 0, var 0 -> zeros, not NaN
    mean = (x * m).sum() / denom
    centred = (x - mean) * m  # (B, T)
    var = (centred * centred).sum() / denom
    if unbiased:
        var = var * torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
