"""Supervised and preference losses over a model (flowrl.runtime): the micro-batch loss functions a worker's
update hands to `TrainEngine.step` for `loss = "sft"`, `"bradley_terry"` and `"dpo"` (and its kinds).

Each runs the model's forward with gradients on a micro-batch built by flowrl.runtime.pairs (pairs: chosen at
row 2i, rejected at 2i + 1; a micro-batch holds whole pairs) and calls the pure loss in
flowrl.algos.preference. Losses are scaled by the micro-batch's share of the mini-batch (`num_tokens` for SFT,
`num_pairs` for the pair losses), so the micro-batch losses sum to the mini-batch's loss and the gradient does
not depend on the split (tested). Metrics are shares too where they are means (rewards/accuracies, ...).
With `share` (the share-prefix pass's `min_len`; 0 is off), a pair's chosen and rejected rows run their common
prompt once, in the forward and in the backward (flowrl.engines.prefix).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flowrl.algos.preference import bradley_terry_loss, dpo_loss, sequence_logp
from flowrl.engines.forward import forward_logprobs, forward_values
from flowrl.engines.prefix import packed_logprobs_entropy, packed_values
from flowrl.runtime.batch import Batch

__all__ = ["dpo_micro_loss", "pair_scores", "reward_micro_loss", "sft_micro_loss", "with_last_slot"]

_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _inputs(mb: Batch, device: torch.device) -> tuple[Tensor, ...]:
    return tuple(mb[k].to(device) for k in _INPUTS)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _sides(x: Tensor) -> tuple[Tensor, Tensor]:
    """Chosen and rejected halves of a (2b, ...) pair tensor."""
    if x.shape[0] % 2:
        raise ValueError(f"a pair batch has an even number of rows (chosen, rejected), got {x.shape[0]}")
    return x[0::2], x[1::2]


def _shares(metrics: dict[str, float], share: float) -> dict[str, float]:
    return {k: v * share for k, v in metrics.items()}


def sft_micro_loss(module: nn.Module, mb: Batch, *, num_tokens: float) -> tuple[Tensor, dict[str, float]]:
    """Mean next-token NLL of the demonstrations' responses, this micro-batch's share (its tokens / `num_tokens`)."""
    inputs = _inputs(mb, _device(module))
    logp = _logprobs(module, inputs, 1.0, 0)  # (b, T)
    mask = inputs[3].float()
    nll_sum = torch.where(mask > 0, -logp * mask, torch.zeros_like(logp)).sum()
    loss = nll_sum / max(num_tokens, 1.0)
    return loss, {"sft_loss": float(loss.detach())}


def _logprobs(module: nn.Module, inputs: tuple[Tensor, ...], temperature: float, share: int) -> Tensor:
    """(b, T) token log-probs with gradients; with `share` (the share-prefix pass's min_len, 0: off) the pair's
    common prompt runs once (flowrl.engines.prefix: same numbers to float rounding)."""
    packed = packed_logprobs_entropy(module, *inputs, temperature=temperature, min_len=share) if share else None
    if packed is not None:
        return packed[0]
    return forward_logprobs(module, *inputs, temperature=temperature, with_grad=True)


def with_last_slot(response_ids: torch.Tensor,
                   response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Responses with one slot appended after each one's last token (its id never read), and each response's
    length (that slot's place): the value read at the slot is the last token's hidden state's."""
    lens = response_mask.sum(1).long()
    rows = torch.arange(len(lens), device=lens.device)
    ids = torch.cat([response_ids, response_ids[:, :1]], dim=1)
    mask = torch.cat([response_mask, torch.zeros_like(response_mask[:, :1])], dim=1)
    mask[rows, lens] = 1
    return ids, mask, lens


def pair_scores(value_module: nn.Module, mb: Batch, *, with_grad: bool = False, share: int = 0) -> Tensor:
    """(2b,) a reward model's score of each row: its value head on the hidden state of the response's last
    token (EOS), so the score has read the whole response, as TRL's and OpenRLHF's reward models do. (A forward's
    value t is read where response token t is predicted, flowrl.engines.forward; one pad slot appended after each
    response makes that slot's value the last token's.) With `share`, each prompt is computed once, in training."""
    prompt_ids, prompt_mask, response_ids, response_mask = _inputs(mb, _device(value_module))
    ids, mask, lens = with_last_slot(response_ids, response_mask)  # (2b, T+1), (2b, T+1), (2b,)
    rows = torch.arange(len(lens), device=lens.device)
    values = packed_values(value_module, prompt_ids, prompt_mask, ids, mask, min_len=share) \
        if share and with_grad else None
    if values is None:
        values = forward_values(value_module, prompt_ids, prompt_mask, ids, mask, with_grad=with_grad)  # (2b, T+1)
    return values[rows, lens]


def reward_micro_loss(value_module: nn.Module, mb: Batch, *, num_pairs: int, margin: float = 0.0,
                      share: int = 0) -> tuple[Tensor, dict[str, float]]:
    """Bradley-Terry loss of this micro-batch's pairs, scaled by its share of the mini-batch's pairs."""
    chosen, rejected = _sides(pair_scores(value_module, mb, with_grad=True, share=share))
    loss, metrics = bradley_terry_loss(chosen, rejected, margin=margin)
    part = chosen.shape[0] / max(num_pairs, 1)
    return loss * part, _shares({"rm_loss": metrics["loss"], "rm_accuracy": metrics["accuracy"],
                                  "rm_margin": metrics["margin"]}, part)


def dpo_micro_loss(module: nn.Module, mb: Batch, *, num_pairs: int, ref_logp: Tensor | None, beta: float,
                   kind: str = "sigmoid", label_smoothing: float = 0.0, gamma: float = 0.5,
                   temperature: float = 1.0, share: int = 0) -> tuple[Tensor, dict[str, Any]]:
    """DPO (or IPO / SimPO) loss of this micro-batch's pairs: the policy's sequence log-probs with gradients,
    the reference's (2b, T) token log-probs `ref_logp` (none for simpo), scaled by the micro-batch's share."""
    inputs = _inputs(mb, _device(module))
    logp = _logprobs(module, inputs, temperature, share)  # (2b, T)
    mean = kind in ("ipo", "simpo")  # length-normalised, as TRL for these
    seq = sequence_logp(logp, inputs[3], mean=mean)  # (2b,)
    chosen, rejected = _sides(seq)
    ref_c = ref_r = None
    if ref_logp is not None and kind != "simpo":
        ref_c, ref_r = _sides(sequence_logp(ref_logp.to(logp.device), inputs[3], mean=mean))
    loss, metrics = dpo_loss(chosen, rejected, ref_c, ref_r, beta=beta, kind=kind,
                             label_smoothing=label_smoothing, gamma=gamma)
    part = chosen.shape[0] / max(num_pairs, 1)
    metrics = {("dpo_loss" if k == "loss" else k): v for k, v in metrics.items()}
    return loss * part, _shares(metrics, part)
