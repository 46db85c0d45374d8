"""Shared-prefix forwards for the torch engines (flowrl.engines): each prompt prefix is computed once.

What the `share-prefix` pass switches on (RLHFless's pre-computed shared prefixes). A rollout of N = B * n
rows holds each prompt n times, and different prompts may open with the same tokens (a system prompt). The
plain forward (`flowrl.engines.forward`) runs every row's whole prompt; here the prompt part runs once:

    level A  one row per trie group (flowrl.engines.trie): the common prefix of prompts sharing >= min_len tokens
    level B  one row per unique prompt: the rest of the prompt, attending to its group's level-A cache
    level C  the responses, attending to their prompt's cache: the n samples of a prompt packed into one row
             with a 4-D mask (each token sees the prompt and its own sample), or one row per sample attending
             to a copy of the cache when a packed row would be too long

Every level is left-padded, holes are masked out of attention and positions count real tokens only, so each
token sees exactly the tokens and positions of the plain forward. The output at a prompt's last token (which
scores response token 0) comes from level B; responses run only their first T - 1 tokens. Results equal the
plain forward to float rounding (tested <= 1e-5). Levels A and B of each module are kept until its weights
change (`flowrl.engines.prompt_cache`), so the chunks of a streamed rollout compute each prompt once too. Which
layout level C takes for a call (packed rows or copies) is `flowrl.engines.packing_cost`'s decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.engines import packing_cost
from flowrl.engines.forward import no_grad_mode, token_entropy, token_logprobs
from flowrl.engines.packing_cost import packed_rows, packed_width, run_lengths
from flowrl.engines.prefill import compute_prefixes, expand, left_pad, level, run, supports_levels
from flowrl.engines.prompt_cache import KV, PromptCache, PromptState, cache_of, stack, store
from flowrl.engines.trie import PrefixPlan, plan_of, plan_prefixes
from flowrl.models.attention import NAME as ATTENTION
from flowrl.models.build import ValueModel

__all__ = ["PromptState", "packed_logprobs_entropy", "packed_values", "prefill", "shared_logprobs", "shared_values"]

# -- running the levels -----------------------------------------------------------------------------------


def prefill(module: nn.Module, plan: PrefixPlan, pad: int, device: torch.device) -> PromptState:
    """Levels A and B of `plan`: each trie prefix once (engines/prefill.py), then each unique prompt's remainder
    once."""
    group_of = [-1] * len(plan.unique)
    for g, (_, members) in enumerate(plan.groups):
        for u in members:
            group_of[u] = g
    past: KV | None = None
    past_mask: Tensor | None = None
    start = torch.zeros(len(plan.unique), dtype=torch.long, device=device)
    if plan.groups:
        level_a = compute_prefixes(module, [plan.unique[m[0]][:length] for length, m in plan.groups], pad, device)
        past, past_mask, start = expand(level_a, group_of)
    prefix_len = start.tolist()
    ids, mask = left_pad([p[prefix_len[u]:] for u, p in enumerate(plan.unique)], pad, device)
    last, kv = level(module, ids, mask, start, past, past_mask, 1)
    full_mask = mask if past_mask is None else torch.cat([past_mask, mask], dim=1)
    lengths = torch.tensor([len(p) for p in plan.unique], dtype=torch.long, device=device)
    return PromptState(kv, full_mask, lengths, last[:, -1])


def _responses(module: nn.Module, state: PromptState, prompts: Tensor, response_ids: Tensor,
               response_mask: Tensor) -> Tensor:
    """(b, T, out) outputs scoring response tokens 0..T-1 of rows whose unique prompts are `prompts` (b,),
    one row per sample: each sample attends to its own copy of its prompt's cache."""
    first = state.last[prompts][:, None]  # (b, 1, out): the prompt's last token scores response token 0
    length = response_ids.shape[1]
    if length == 1:
        return first
    past = [(k[prompts], v[prompts]) for k, v in state.kv]
    rest, _ = level(module, response_ids[:, :-1], response_mask[:, :-1].long(), state.lengths[prompts], past,
                     state.mask[prompts], length - 1)
    return torch.cat([first, rest], dim=1)


@dataclass(frozen=True)
class _Packing:
    """Where each sample's response tokens sit when the samples of a prompt share one packed row. Padding is
    left out: a sample takes as many places as it has tokens to run (its response tokens but the last), so a
    long-tailed batch costs its real tokens, not rows x its longest response (verl's remove-padding)."""

    units: Tensor  # (U',) the unique prompts, one packed row each
    slot: Tensor  # (b,) packed row of each sample
    sample: Tensor  # (k,) for each packed token: its sample ...
    step: Tensor  # (k,) ... and its place in that sample's response
    rows: Tensor  # (k,) packed row of each token
    where: Tensor  # (k,) column of each token in its packed row
    ids: Tensor  # (U', q) the packed tokens
    position: Tensor  # (U', q) position of each token within its response
    own: Tensor  # (U', q, q) True where a token may attend to another: same sample, not later, not padding


def _packing(prompts: Tensor, response_ids: Tensor, response_mask: Tensor) -> _Packing:
    dev = prompts.device
    units, slot = torch.unique(prompts, return_inverse=True)
    runs = run_lengths(response_mask)
    offset = torch.zeros_like(prompts)  # where each sample's tokens start in its packed row
    for u in range(len(units)):
        mine = (slot == u).nonzero().squeeze(1)
        offset[mine] = torch.cumsum(runs[mine], 0) - runs[mine]
    sample = torch.repeat_interleave(torch.arange(len(prompts), device=dev), runs)
    step = torch.arange(len(sample), device=dev) - torch.repeat_interleave(torch.cumsum(runs, 0) - runs, runs)
    rows, where = slot[sample], offset[sample] + step
    q = max(1, int((offset + runs).max())) if len(prompts) else 1
    ids = response_ids.new_zeros((len(units), q))
    ids[rows, where] = response_ids[sample, step]
    owner = torch.full((len(units), q), -1, device=dev)
    owner[rows, where] = sample
    position = torch.zeros((len(units), q), dtype=torch.long, device=dev)
    position[rows, where] = step
    valid = torch.zeros((len(units), q), dtype=torch.bool, device=dev)
    valid[rows, where] = response_mask[sample, step].bool()
    own = (owner[:, :, None] == owner[:, None, :]) & (position[:, None, :] <= position[:, :, None]) & valid[:, None, :]
    own |= torch.eye(q, dtype=torch.bool, device=dev)  # a padding query still sees itself
    return _Packing(units, slot, sample, step, rows, where, ids, position, own)


def _additive(seen: Tensor) -> Tensor:
    # An additive float mask: what eager attention needs, and twice as fast as a boolean one in CPU SDPA.
    return torch.zeros(seen.shape, device=seen.device).masked_fill(~seen, torch.finfo(torch.float32).min)


def _unpack(out: Tensor, pk: _Packing, first: Tensor, length: int) -> Tensor:
    """(b, length, out): `first` (b, out) scores response token 0, the packed outputs the rest (zeros where a
    sample has no token to score: its padding, which every caller masks)."""
    rest = out.new_zeros((len(pk.slot), length - 1, out.shape[-1]))
    rest = rest.index_put((pk.sample, pk.step), out[pk.rows, pk.where])
    return torch.cat([first[:, None], rest], dim=1)


def _responses_packed(module: nn.Module, state: PromptState, prompts: Tensor, response_ids: Tensor,
                      response_mask: Tensor) -> Tensor:
    """Like `_responses`, without copying any cache: the samples of a prompt run as one packed row after its
    cache, a 4-D mask letting each token see the prompt and the earlier tokens of its own sample only."""
    pk = _packing(prompts, response_ids, response_mask)
    q = pk.ids.shape[1]
    seen = torch.cat([state.mask[pk.units].bool()[:, None, :].expand(-1, q, -1), pk.own], dim=2)[:, None]
    past = [(k[pk.units], v[pk.units]) for k, v in state.kv]
    out, _ = run(module, pk.ids, _additive(seen), state.lengths[pk.units][:, None] + pk.position, past, q)
    return _unpack(out, pk, state.last[prompts], response_ids.shape[1])


def _single_pass(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, prompts: Tensor,
                 response_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, PromptState]:
    """Prompts and packed responses in one forward ([prompt | packed samples] per unique prompt): the
    outputs of `_responses_packed`, and the prompts' state for the cache."""
    pk = _packing(prompts, response_ids, response_mask)
    width, q, dev = prompt_ids.shape[1], pk.ids.shape[1], prompts.device
    first_row = torch.zeros(len(pk.units), dtype=torch.long, device=dev)
    first_row[pk.slot] = torch.arange(len(prompts), device=dev)
    ids, mask = prompt_ids[first_row], prompt_mask[first_row].long()  # (U', W)
    real = mask.bool()
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=dev))[None] & real[:, None, :]
    causal |= torch.eye(width, dtype=torch.bool, device=dev)[None]  # left padding sees itself
    top = torch.cat([causal, causal.new_zeros((len(pk.units), width, q))], dim=2)
    seen = torch.cat([top, torch.cat([real[:, None, :].expand(-1, q, -1), pk.own], dim=2)], dim=1)[:, None]
    lengths = mask.sum(1)
    positions = torch.cat([(mask.cumsum(-1) - 1).clamp(min=0), lengths[:, None] + pk.position], dim=1)
    out, kv = run(module, torch.cat([ids, pk.ids], dim=1), _additive(seen), positions, None, q + 1)
    state = PromptState([(k[:, :, :width], v[:, :, :width]) for k, v in kv], mask, lengths, out[:, 0])
    return _unpack(out[:, 1:], pk, out[:, 0][pk.slot], response_ids.shape[1]), state


PACKABLE = ("sdpa", "eager", ATTENTION)  # attention that takes any 4-D mask (flash kernels take none)


def _attention(module: nn.Module) -> str:
    lm: Any = module.backbone if isinstance(module, ValueModel) else module
    return str(getattr(lm.config, "_attn_implementation", "eager"))


def _prompt_states(module: nn.Module, plan: PrefixPlan, min_len: int, pad: int, device: torch.device,
                   cache: PromptCache) -> PromptState:
    """The PromptState of every unique prompt of `plan`: from the cache, the missing ones computed now."""
    with cache.lock:
        missing = [p for p in plan.unique if p not in cache.entries]
    if missing:
        store(cache, missing, prefill(module, plan_of(missing, [], min_len), pad, device))
    with cache.lock:
        rows = [cache.entries[p] for p in plan.unique]
        for p in plan.unique:
            cache.entries.move_to_end(p)
    return stack(rows)


def _shared(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
            response_mask: Tensor, min_len: int, micro_batch: int, pad: int,
            finish: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor | None:
    if response_ids.shape[1] == 0 or prompt_ids.shape[0] == 0 or not supports_levels(module):
        return None
    plan = plan_prefixes(prompt_ids, prompt_mask, min_len)
    cache = cache_of(module)
    with cache.lock:
        cached = any(p in cache.entries for p in plan.unique)
    if not plan.worth_it(min_len, cached):
        return None
    device = response_ids.device
    out = torch.zeros(response_ids.shape, dtype=torch.float32, device=device)  # (N, T)
    row_prompt = torch.tensor(plan.row_prompt, device=device)
    packed = _attention(module) in PACKABLE and response_ids.shape[1] > 1
    if packed:
        per_prompt = packed_rows(plan.row_prompt, response_mask)
        packed = max(per_prompt.values(), default=0) <= packing_cost.PACK_LIMIT and (
            packing_cost.PACKING == "always"
            or packing_cost.packing_pays(module, per_prompt, prompt_ids.shape[1], response_mask.shape))
    with no_grad_mode(module):
        if packed and not plan.groups and not cached:  # nothing to reuse: prompts and responses in one call
            for rows in _row_chunks(plan.row_prompt, micro_batch):
                idx = torch.tensor(rows, device=device)
                outputs, state = _single_pass(module, prompt_ids[idx], prompt_mask[idx], row_prompt[idx],
                                              response_ids[idx], response_mask[idx])
                store(cache, [plan.unique[int(u)] for u in torch.unique(row_prompt[idx])], state)
                out[idx] = finish(outputs, response_ids[idx], response_mask[idx].long())
            return out
        state = _prompt_states(module, plan, min_len, pad, device, cache)
        for rows in _row_chunks(plan.row_prompt, micro_batch):
            idx = torch.tensor(rows, device=device)
            respond = _responses_packed if packed else _responses
            outputs = respond(module, state, row_prompt[idx], response_ids[idx], response_mask[idx])
            out[idx] = finish(outputs, response_ids[idx], response_mask[idx].long())
    return out


def _row_chunks(row_prompt: Sequence[int], micro_batch: int) -> list[list[int]]:
    """Rows grouped by whole unique prompts, at most `micro_batch` rows a chunk (a prompt is never split)."""
    by_prompt: dict[int, list[int]] = {}
    for r, u in enumerate(row_prompt):
        by_prompt.setdefault(u, []).append(r)
    chunks: list[list[int]] = [[]]
    for rows in by_prompt.values():
        if micro_batch > 0 and chunks[-1] and len(chunks[-1]) + len(rows) > micro_batch:
            chunks.append([])
        chunks[-1].extend(rows)
    return chunks


def shared_logprobs(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                    response_mask: Tensor, *, temperature: float = 1.0, min_len: int = 16, micro_batch: int = 0,
                    pad: int = 0) -> Tensor | None:
    """(N, T) like `forward_logprobs`, or None when sharing does not apply (then use the plain forward)."""
    scale = 1.0 / temperature if temperature > 0 else 1.0

    def finish(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        logits = logits.float() * scale if scale != 1.0 else logits.float()
        return token_logprobs(logits, targets * mask) * mask

    return _shared(module, prompt_ids, prompt_mask, response_ids, response_mask, min_len, micro_batch, pad, finish)


def shared_values(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  response_mask: Tensor, *, min_len: int = 16, micro_batch: int = 0, pad: int = 0) -> Tensor | None:
    """(N, T) like `forward_values` for a `ValueModel`, or None when sharing does not apply."""
    if not isinstance(module, ValueModel):
        return None

    def finish(hidden: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        return module.value_head(hidden).squeeze(-1).float() * mask

    return _shared(module, prompt_ids, prompt_mask, response_ids, response_mask, min_len, micro_batch, pad, finish)


# -- with autograd: the update's forward ------------------------------------------------------------------


def _packed_train(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  response_mask: Tensor, min_len: int) -> Tensor | None:
    """(N, T, out) outputs scoring each response token from one packed forward per unique prompt ([prompt |
    its samples], as `_single_pass`), with autograd: a prompt's gradient is the sum over its samples, as in the
    plain forward. None when no prompt of at least `min_len` tokens repeats, or the packing does not apply
    (then use the plain forward). Nothing is cached: the weights change right after."""
    length = response_ids.shape[1]
    if length < 2 or prompt_ids.shape[0] == 0 or not supports_levels(module):
        return None
    if _attention(module) not in PACKABLE:
        return None
    plan = plan_prefixes(prompt_ids, prompt_mask, min_len)
    per_prompt = max(plan.row_prompt.count(u) for u in set(plan.row_prompt))
    if per_prompt < 2 or max(len(p) for p in plan.unique) < min_len or \
            packed_width(plan.row_prompt, response_mask) > packing_cost.PACK_LIMIT:
        return None
    row_prompt = torch.tensor(plan.row_prompt, device=response_ids.device)
    outputs, _ = _single_pass(module, prompt_ids, prompt_mask, row_prompt, response_ids, response_mask)
    return outputs


def packed_logprobs_entropy(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                            response_mask: Tensor, *, temperature: float = 1.0,
                            min_len: int = 16) -> tuple[Tensor, Tensor] | None:
    """Like `forward_logprobs_entropy(..., with_grad=True)` with each prompt computed once, or None."""
    logits = _packed_train(module, prompt_ids, prompt_mask, response_ids, response_mask, min_len)
    if logits is None:
        return None
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    mask = response_mask.long()
    return token_logprobs(logits, response_ids * mask) * mask, token_entropy(logits) * mask


def packed_values(module: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  response_mask: Tensor, *, min_len: int = 16) -> Tensor | None:
    """Like `forward_values(..., with_grad=True)` for a `ValueModel` with each prompt computed once, or None."""
    if not isinstance(module, ValueModel):
        return None
    hidden = _packed_train(module, prompt_ids, prompt_mask, response_ids, response_mask, min_len)
    if hidden is None:
        return None
    return module.value_head(hidden).squeeze(-1).float() * response_mask.long()
