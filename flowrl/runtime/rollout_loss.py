"""The loss of one micro-batch of a rollout (flowrl.runtime): what `ModelWorker.update` hands its optimizer steps
for a policy (`policy_micro_loss`) or a critic (`critic_micro_loss`) — the rows moved to the worker's device, the
forward with gradients (each prompt once under the share-prefix pass), and the algorithm's loss
(`flowrl.algos`) scaled by the whole mini-batch's denominators. Updates on a data node's rows (sft, dpo,
bradley_terry) take their losses from flowrl.runtime.preference_update instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flowrl.algos import policy_loss, value_loss
from flowrl.engines.generation import forward_logprobs_entropy, forward_values
from flowrl.engines.prefix import packed_logprobs_entropy, packed_values
from flowrl.ir.attrs import UpdateAttrs
from flowrl.runtime.batch import Batch


def rollout_inputs(rollout: Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A rollout's (prompt_ids, prompt_mask, response_ids, response_mask) on `device`, as the forwards take them."""
    return tuple(rollout[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"))


def safe_temp(t: float) -> float:
    # Greedy generation (temperature 0) scores tokens at temperature 1.
    return t if t > 0 else 1.0


def loss_mask(mb: Batch, response_mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(B, T) the tokens the loss trains on: a multi-turn rollout's loss_mask (0 on observation tokens, which
    the forwards still attend to through response_mask), else the response mask."""
    return mb["loss_mask"].to(device).float() if "loss_mask" in mb.tensors else response_mask.float()


def policy_micro_loss(module: torch.nn.Module, mb: Batch, *, device: torch.device, a: UpdateAttrs,
                      denoms: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    inputs = rollout_inputs(mb, device)
    mask = loss_mask(mb, inputs[3], device)
    temp = float(mb["temperature"][0]) if "temperature" in mb.tensors else 1.0
    packed = None
    if a.share_prefix:  # the share-prefix pass: each prompt once, gradients summed over samples
        packed = packed_logprobs_entropy(module, *inputs, temperature=safe_temp(temp), min_len=a.prefix_min_len)
    logp, entropy = packed or forward_logprobs_entropy(module, *inputs, temperature=safe_temp(temp),
                                                       with_grad=True)  # (B, T) each
    dev = device
    if a.loss_scale_factor:  # agg = "seq-mean-token-sum-norm" over a constant (Dr. GRPO), not the batch's width
        denoms = {**denoms, "horizon": float(a.loss_scale_factor)}
    return policy_loss(
        logp, mb["old_logp"].to(dev) if "old_logp" in mb.tensors else None, mb["advantages"].to(dev), mask,
        ref_logp=mb["ref_logp"].to(dev) if "ref_logp" in mb.tensors else None,
        behav_logp=mb["gen_logp"].to(dev) if "gen_logp" in mb.tensors else None,
        is_correction=a.correction, is_cap=a.is_cap, entropy=entropy, clip=a.clip,
        clip_high=a.clip_high, dual_clip=a.dual_clip, kl_coef=a.kl_coef, kl_kind=a.kl,
        entropy_coef=a.entropy_coef, agg=a.agg, loss=a.loss, ratio=a.ratio, **denoms)


def critic_micro_loss(module: torch.nn.Module, mb: Batch, *, device: torch.device, a: UpdateAttrs,
                      denoms: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    inputs = rollout_inputs(mb, device)
    values = None
    if a.share_prefix:  # the share-prefix pass (engines/prefix.py)
        values = packed_values(module, *inputs, min_len=a.prefix_min_len)
    if values is None:
        values = forward_values(module, *inputs, with_grad=True)  # (B, T)
    old = mb["values"].to(device) if "values" in mb.tensors else values.detach()
    loss, metrics = value_loss(values, old, mb["returns"].to(device), loss_mask(mb, inputs[3], device), clip=a.clip,
                               agg=a.agg, **denoms)
    metrics["vf_loss"] = float(loss.detach())
    return loss, metrics
