"""Teacher-forced forward passes for the torch engines (flowrl.engines): log-probs, entropy and critic values.

Each helper runs one forward over concat([prompt, response]) with the attention mask and position ids derived
from the padding mask (left-padded prompts, right-padded responses), and returns a (B, T) tensor aligned with
`response_ids`; positions where `response_mask` is 0 hold 0. The generation engine imports
`positions_from_mask` from here so rollout and training agree on positions exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # annotations only (typing.Unpack is 3.11+; typing_extensions comes with torch)
    from typing_extensions import Unpack

__all__ = [
    "ChunkOptions",
    "ForwardOptions",
    "forward_entropy",
    "forward_logprobs",
    "forward_logprobs_entropy",
    "forward_values",
    "no_grad_mode",
    "positions_from_mask",
]


def positions_from_mask(mask: Tensor) -> Tensor:
    """Position ids that skip padding: cumsum(mask) - 1, clamped at 0 so pad slots get a valid index."""
    return (mask.long().cumsum(-1) - 1).clamp_(min=0)


class ChunkOptions(TypedDict, total=False):
    """How a forward here runs: `micro_batch` rows at a time (0: all at once, the default), `with_grad` keeping
    the autograd graph (training; default False: inference mode)."""

    micro_batch: int
    with_grad: bool


class ForwardOptions(ChunkOptions, total=False):
    """A language model's forward: scores under softmax(logits / `temperature`) (default 1.0; `temperature <= 0`,
    greedy rollouts, scores under the untempered distribution, matching `generate`)."""

    temperature: float


Score = Callable[[Tensor, Tensor], Tensor]  # (b, T, V) logits, (b, T) targets -> (b, T)


def forward_logprobs(module: nn.Module, *batch: Tensor, **options: Unpack[ForwardOptions]) -> Tensor:
    """(B, T) log-prob of each response token under softmax(logits / temperature); 0 where masked. `batch`: the
    rollout's (prompt_ids, prompt_mask, response_ids, response_mask), as every forward here takes it."""
    return _run_lm(module, batch, options, [token_logprobs])[0]


def forward_entropy(module: nn.Module, *batch: Tensor, **options: Unpack[ForwardOptions]) -> Tensor:
    """(B, T) entropy of the next-token distribution at each response position; 0 where masked."""
    return _run_lm(module, batch, options, [_entropy])[0]


def forward_logprobs_entropy(module: nn.Module, *batch: Tensor,
                             **options: Unpack[ForwardOptions]) -> tuple[Tensor, Tensor]:
    """Both (B, T) log-probs and entropies from a single forward (what a PPO loss with entropy bonus needs)."""
    logprobs, entropy = _run_lm(module, batch, options, [token_logprobs, _entropy])
    return logprobs, entropy


def forward_values(value_module: nn.Module, *batch: Tensor, **options: Unpack[ChunkOptions]) -> Tensor:
    """(B, T) critic values; value t is read at the hidden state that predicts response token t (verl)."""
    rollout = _rollout(batch, options, ChunkOptions)
    width, length = rollout[0].shape[1], rollout[2].shape[1]
    outs: list[Tensor] = []
    with _grad_mode(value_module, options.get("with_grad", False)):
        for ids, attn, pos, resp_mask in _chunks(*rollout, options.get("micro_batch", 0)):
            values = value_module(input_ids=ids, attention_mask=attn, position_ids=pos)  # (b, P + T)
            values = values[:, width - 1 : width - 1 + length].float()  # (b, T)
            outs.append(values * resp_mask)
    return torch.cat(outs, dim=0)


def _rollout(batch: tuple[Tensor, ...], options: Mapping[str, object],
             allowed: type = ForwardOptions) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four tensors of `batch`, after checking them and the keywords (what a signature would have checked)."""
    if len(batch) != 4:
        raise TypeError(f"a forward takes (prompt_ids, prompt_mask, response_ids, response_mask), got {len(batch)} "
                        "tensors")
    keys = allowed.__required_keys__ | allowed.__optional_keys__  # type: ignore[attr-defined]
    unknown = sorted(set(options) - keys)
    if unknown:
        raise TypeError(f"unexpected keyword {unknown[0]!r}; this forward takes {sorted(keys)}")
    return batch[0], batch[1], batch[2], batch[3]


def _run_lm(module: nn.Module, batch: tuple[Tensor, ...], options: ForwardOptions,
            scores: Sequence[Score]) -> list[Tensor]:
    rollout = _rollout(batch, options)
    length = rollout[2].shape[1]
    temperature = options.get("temperature", 1.0)
    scale = 1.0 / temperature if temperature > 0 else 1.0
    parts: list[list[Tensor]] = []
    with _grad_mode(module, options.get("with_grad", False)):
        for ids, attn, pos, resp_mask in _chunks(*rollout, options.get("micro_batch", 0)):
            # Only the last T + 1 positions reach the LM head: the prompt's logits are never needed.
            out = module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                         logits_to_keep=length + 1)  # fmt: skip
            logits = out.logits[:, :-1].float()  # (b, T, V): position t predicts response token t
            if scale != 1.0:
                logits = logits * scale
            targets = ids[:, -length:] * resp_mask  # (b, T); pads -> id 0 so gather stays in range
            parts.append([score(logits, targets) * resp_mask for score in scores])
    return [torch.cat(column, dim=0) for column in zip(*parts, strict=True)]


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    # gather - logsumexp avoids materialising a second (b, T, V) log_softmax tensor.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (b, T)
    return picked - torch.logsumexp(logits, dim=-1)


def _entropy(logits: Tensor, _targets: Tensor) -> Tensor:
    return token_entropy(logits)


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


def no_grad_mode(module: nn.Module) -> contextlib.AbstractContextManager[object]:
    """The context of a forward without gradients through `module` (scoring, generation, its KV caches):
    inference_mode, which is cheaper than no_grad but whose tensors can never enter autograd, except for a module
    DeepSpeed ZeRO-3 partitions. Its forward hooks all-gather each layer's weights inside the caller's context and
    keep the small ("persistent") ones gathered for the forwards after: gathered under inference_mode, those
    weights are inference tensors, and the next training forward fails ("Inference tensors cannot be saved for
    backward"; with two or more ranks, where the gather allocates). Every site that runs or caches for a module
    must use this one context: a cache made under inference_mode cannot be written in place under no_grad."""
    first = next(module.parameters(), None)
    return torch.no_grad() if first is not None and hasattr(first, "ds_id") else torch.inference_mode()


def _grad_mode(module: nn.Module, with_grad: bool) -> contextlib.AbstractContextManager[object]:
    return torch.enable_grad() if with_grad else no_grad_mode(module)
