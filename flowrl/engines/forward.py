"""Teacher-forced forward passes for the torch engines (flowrl.engines): log-probs, entropy and critic values.

Each helper runs one forward over concat([prompt, response]) with the attention mask and position ids derived
from the padding mask (left-padded prompts, right-padded responses), and returns a (B, T) tensor aligned with
`response_ids`; positions where `response_mask` is 0 hold 0. The generation engine imports
`positions_from_mask` from here so rollout and training agree on positions exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

__all__ = [
    "forward_entropy",
    "forward_logprobs",
    "forward_logprobs_entropy",
    "forward_values",
    "positions_from_mask",
]


def positions_from_mask(mask: Tensor) -> Tensor:
    """Position ids that skip padding: cumsum(mask) - 1, clamped at 0 so pad slots get a valid index."""
    return (mask.long().cumsum(-1) - 1).clamp_(min=0)


def forward_logprobs(
    module: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    micro_batch: int = 0,
    with_grad: bool = False,
) -> Tensor:
    """(B, T) log-prob of each response token under softmax(logits / temperature); 0 where masked.

    `temperature <= 0` (greedy rollouts) scores under the untempered distribution, matching `generate`.
    """

    def score(logits: Tensor, targets: Tensor) -> list[Tensor]:
        return [token_logprobs(logits, targets)]

    return _run_lm(module, prompt_ids, prompt_mask, response_ids, response_mask,
                   temperature, micro_batch, with_grad, score)[0]  # fmt: skip


def forward_entropy(
    module: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    micro_batch: int = 0,
    with_grad: bool = False,
) -> Tensor:
    """(B, T) entropy of the next-token distribution at each response position; 0 where masked."""

    def score(logits: Tensor, targets: Tensor) -> list[Tensor]:
        return [token_entropy(logits)]

    return _run_lm(module, prompt_ids, prompt_mask, response_ids, response_mask,
                   temperature, micro_batch, with_grad, score)[0]  # fmt: skip


def forward_logprobs_entropy(
    module: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    micro_batch: int = 0,
    with_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Both (B, T) log-probs and entropies from a single forward (what a PPO loss with entropy bonus needs)."""

    def score(logits: Tensor, targets: Tensor) -> list[Tensor]:
        return [token_logprobs(logits, targets), token_entropy(logits)]

    logprobs, entropy = _run_lm(module, prompt_ids, prompt_mask, response_ids, response_mask,
                                temperature, micro_batch, with_grad, score)  # fmt: skip
    return logprobs, entropy


def forward_values(
    value_module: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch: int = 0,
    with_grad: bool = False,
) -> Tensor:
    """(B, T) critic values; value t is read at the hidden state that predicts response token t (verl)."""
    width = prompt_ids.shape[1]
    length = response_ids.shape[1]
    outs: list[Tensor] = []
    with _grad_mode(with_grad):
        for ids, attn, pos, resp_mask in _chunks(prompt_ids, prompt_mask, response_ids, response_mask, micro_batch):
            values = value_module(input_ids=ids, attention_mask=attn, position_ids=pos)  # (b, P + T)
            values = values[:, width - 1 : width - 1 + length].float()  # (b, T)
            outs.append(values * resp_mask)
    return torch.cat(outs, dim=0)


def _run_lm(
    module: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float,
    micro_batch: int,
    with_grad: bool,
    score: Callable[[Tensor, Tensor], list[Tensor]],
) -> list[Tensor]:
    length = response_ids.shape[1]
    scale = 1.0 / temperature if temperature > 0 else 1.0
    parts: list[list[Tensor]] = []
    with _grad_mode(with_grad):
        for ids, attn, pos, resp_mask in _chunks(prompt_ids, prompt_mask, response_ids, response_mask, micro_batch):
            # Only the last T + 1 positions reach the LM head: the prompt's logits are never needed.
            out = module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                         logits_to_keep=length + 1)  # fmt: skip
            logits = out.logits[:, :-1].float()  # (b, T, V): position t predicts response token t
            if scale != 1.0:
                logits = logits * scale
            targets = ids[:, -length:] * resp_mask  # (b, T); pads -> id 0 so gather stays in range
            parts.append([s * resp_mask for s in score(logits, targets)])
    return [torch.cat(column, dim=0) for column in zip(*parts, strict=True)]


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    # gather - logsumexp avoids materialising a second (b, T, V) log_softmax tensor.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (b, T)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor) -> Tensor:
    probs = torch.softmax(logits, dim=-1)  # (b, T, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # (b, T)


def _chunks(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, micro_batch: int
) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Yield (ids, attention_mask, position_ids, response_mask) for row slices of at most `micro_batch` rows."""
    rows = prompt_ids.shape[0]
    if rows == 0 or response_ids.shape[1] == 0:
        raise ValueError(f"empty batch (B={rows}, T={response_ids.shape[1]}); nothing to score")
    step = micro_batch if micro_batch > 0 else max(rows, 1)
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        resp_mask = response_mask[sl].long()
        ids = torch.cat([prompt_ids[sl], response_ids[sl]], dim=1)  # (b, P + T)
        attn = torch.cat([prompt_mask[sl].long(), resp_mask], dim=1)  # (b, P + T)
        yield ids, attn, positions_from_mask(attn), resp_mask


def _grad_mode(with_grad: bool) -> contextlib.AbstractContextManager[object]:
    # inference_mode is cheaper than no_grad, but its tensors can never enter autograd: only for scoring.
    return torch.enable_grad() if with_grad else torch.inference_mode()
