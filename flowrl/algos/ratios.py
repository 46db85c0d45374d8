"""Importance ratios of the policy losses (flowrl.algos): per token (PPO), per sequence (GSPO), and CISPO's
clipped, stop-gradient importance weight. Pure functions of (B, T) tensors, called by `flowrl.algos.losses`.

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071) replaces PPO's token ratio
pi(y_t)/pi_old(y_t) with the sequence's length-normalised ratio

    s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp( (1/|y_i|) sum_t [log pi(y_i,t) - log pi_old(y_i,t)] ),

the same for every token of response i, clipped as one. Its token form (GSPO-token, eq. 13; verl's
`compute_policy_loss_gspo`) is s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]: its value is s_i, its gradient
s_i * grad log pi(y_i,t), which lets a token-level advantage through and equals GSPO's gradient when the
advantage is the sequence's. The mean runs over the loss mask, so a sequence's ratio needs all of its tokens:
micro-batches split the rows of a batch, never a row.

CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5) keeps PPO's token ratio r = pi/pi_old but clips the importance
WEIGHT and stops its gradient instead of clipping the update, so every token keeps the REINFORCE gradient
sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * grad log pi, where PPO's clip zeroes it for the tokens outside the
range (the rare "fork" tokens the paper found were the ones that mattered).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RATIO_LEVELS", "ROLLOUT_LOSSES", "cispo_token_loss", "importance_log_ratio", "sequence_log_ratio"]

RATIO_LEVELS = ("token", "sequence")
ROLLOUT_LOSSES = ("ppo_clip", "cispo")

# A sequence's log-ratio is capped at 10 (a ratio of e^10), as verl caps it: an exp() of a stale sequence's mean
# log-ratio would otherwise overflow. Token log-ratios are clamped at +-20, as everywhere in flowrl.
SEQUENCE_LOG_CAP = 10.0
TOKEN_LOG_CAP = 20.0


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """(B,) log s_i = the masked mean over each row of logp - old_logp ((B, T) each); 0 for a row without
    tokens. Gradients flow through `logp` (callers detach it where GSPO stops them)."""
    m = mask.to(logp.dtype)  # (B, T)
    diff = torch.where(m > 0, (logp - old_logp) * m, torch.zeros_like(logp))  # (B, T)
    return diff.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # (B,)


def importance_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """(B, T) log of the importance ratio each token's surrogate uses; `old_logp` is detached.

    token     log r_t = clamp(logp_t - old_logp_t, -20, 20)
    sequence  log s_i,t = min(logp_t - sg[logp_t] + sg[log s_i], 10): the value is log s_i on every token of
              row i, the gradient that of logp_t (verl's `compute_policy_loss_gspo`)
    """
    old_logp = old_logp.detach()
    if level == "token":
        return (logp - old_logp).clamp(-TOKEN_LOG_CAP, TOKEN_LOG_CAP)
    if level == "sequence":
        seq = sequence_log_ratio(logp.detach(), old_logp, mask)  # (B,)
        return (logp - logp.detach() + seq.unsqueeze(-1)).clamp(max=SEQUENCE_LOG_CAP)
    raise ValueError(f"unknown ratio level {level!r}; expected one of {', '.join(RATIO_LEVELS)}")


def cispo_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip: float = 1.0,
                     clip_high: float | None = 4.0) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO's per-token loss -> (loss, ratio, clipped), each (B, T):

        r = exp(clamp(logp - old_logp, -20, 20));  w = sg(clamp(r, 1 - clip, 1 + clip_high));  l = -w * A * logp

    (clip_high None: clip). The defaults are SkyRL's (after ScaleRL, arXiv:2510.13786): 1 - clip = 0, no lower
    bound, as MiniMax-M1 ran it ("we did not impose a lower bound ... by setting eps_low to a large value"),
    and 1 + clip_high = 5. `clipped`: the tokens whose weight the clamp changed (verl's pg_clipfrac).
    advantages (B,) broadcast over tokens, or (B, T); detached like old_logp."""
    advantages = advantages.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    high = clip if clip_high is None else clip_high
    ratio = torch.exp((logp.detach() - old_logp.detach()).clamp(-TOKEN_LOG_CAP, TOKEN_LOG_CAP))  # (B, T)
    weight = ratio.clamp(1.0 - clip, 1.0 + high)  # no gradient: built from detached log-probs
    return -weight * advantages * logp, ratio, weight != ratio
