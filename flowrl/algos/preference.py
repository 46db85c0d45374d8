"""Supervised and preference losses (flowrl.algos): SFT, Bradley-Terry reward models, DPO and its IPO/cDPO and
reference-free (SimPO) variants — pure functions of log-probs and scores, called by the update step of a
policy or a reward model; nothing here knows about models or batches.

Conventions follow TRL's trainers so losses can be compared number for number: a sequence's log-probability is
the sum of its response tokens' log-probs (`sequence_logp`); IPO and SimPO take the length-normalised mean
instead (`sequence_logp(..., mean=True)`), as TRL does for them. Every loss returns the batch mean and the
metrics under TRL's names (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPO_KINDS", "bradley_terry_loss", "dpo_loss", "sequence_logp", "sft_loss"]

DPO_KINDS = ("sigmoid", "ipo", "simpo")


def sequence_logp(logp: Tensor, mask: Tensor, *, mean: bool = False) -> Tensor:
    """(B,) log-probability of each response from its tokens' (B, T) log-probs: their sum over `mask`, or the
    mean over its tokens with `mean` (0 for a response without tokens)."""
    m = mask.to(logp.dtype)
    total = torch.where(m > 0, logp * m, torch.zeros_like(logp)).sum(dim=-1)  # (B,)
    if not mean:
        return total
    return total / m.sum(dim=-1).clamp(min=1)


def sft_loss(logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Supervised next-token loss on the response: the mean negative log-likelihood over the (B, T) response
    tokens in `mask` (the prompt is not trained on). Metrics: loss, and the tokens' perplexity."""
    m = mask.to(logp.dtype)
    nll = torch.where(m > 0, -logp * m, torch.zeros_like(logp)).sum() / m.sum().clamp(min=1)
    return nll, {"loss": float(nll.detach()), "ppl": float(torch.exp(nll.detach()))}


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, *, margin: float | Tensor = 0.0) -> tuple[Tensor, dict[str, float]]:
    """Reward-model loss on preference pairs: mean of −log σ(r_chosen − r_rejected − margin) over the (B,)
    pairs (Llama 2's margin term: a per-pair margin for pairs rated far apart; 0 is InstructGPT's loss).
    Metrics: loss, accuracy (r_chosen > r_rejected), the mean margin r_chosen − r_rejected."""
    diff = chosen - rejected  # (B,)
    loss = -F.logsigmoid(diff - torch.as_tensor(margin, dtype=diff.dtype, device=diff.device)).mean()
    d = diff.detach()
    return loss, {"loss": float(loss.detach()), "accuracy": float((d > 0).float().mean()), "margin": float(d.mean())}


def dpo_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None = None,
    ref_rejected_logp: Tensor | None = None,
    *,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
) -> tuple[Tensor, dict[str, float]]:
    """DPO (Rafailov et al., 2023) on (B,) sequence log-probs of the chosen and rejected responses.

    h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))
    sigmoid  −(1 − ε) log σ(β h) − ε log σ(−β h)      (ε = label_smoothing: cDPO; 0 is DPO)
    ipo      (h − 1/(2β))²                            (Azar et al., 2023; pass length-normalised log-probs, as TRL)
    simpo    −log σ(β (log π(y_w) − log π(y_l)) − γ)   (Meng et al., 2024: no reference; length-normalised
             log-probs; γ = gamma, TRL's `simpo_gamma` is γ/β)

    The implicit rewards are β (log π − log π_ref) (β log π for simpo). Metrics under TRL's names:
    rewards/chosen, rewards/rejected (means), rewards/accuracies (chosen > rejected), rewards/margins."""
    if kind not in DPO_KINDS:
        raise ValueError(f"unknown DPO loss {kind!r}; expected one of {', '.join(DPO_KINDS)}")
    if kind == "simpo":
        chosen_ratio, rejected_ratio = chosen_logp, rejected_logp
    else:
        if ref_chosen_logp is None or ref_rejected_logp is None:
            raise ValueError(f"the {kind} DPO loss needs the reference's log-probs (ref_logp)")
        chosen_ratio, rejected_ratio = chosen_logp - ref_chosen_logp, rejected_logp - ref_rejected_logp  # (B,)
    h = chosen_ratio - rejected_ratio  # (B,)
    if kind == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * h - gamma)
    loss = losses.mean()
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    return loss, {
        "loss": float(loss.detach()),
        "rewards/chosen": float(chosen_reward.mean()),
        "rewards/rejected": float(rejected_reward.mean()),
        "rewards/accuracies": float((chosen_reward > rejected_reward).float().mean()),
        "rewards/margins": float((chosen_reward - rejected_reward).mean()),
    }
