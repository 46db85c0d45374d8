"""The torch generation engine (flowrl.engines): batched sampling from a HF causal LM with a KV cache.

`generate` prefills left-padded prompts once, then runs its own decode loop (no `model.generate`: its per-step
logits-processor machinery costs more than a tiny model's forward). Speed comes from a preallocated KV cache
(no per-step `torch.cat` of the whole cache), a preallocated attention mask that is only sliced, shared-prefix
prefill (B prompts prefilled once, cache replicated n times) and dropping finished rows from the batch once
half of them are done. Each row samples from its own counter-based stream (flowrl.engines.sampling: keyed by the
seed, its prompt's slot in the step and its sample index), by inverse CDF over its filtered distribution, so a
row's samples do not depend on the batch it decodes in: sharing the prefix or not, the batch split across ranks
or instances in any order, finished rows dropped or a tail migrated, the same seed gives the same samples (to
the float rounding of the logits, which a different batch may move by ~1e-7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from flowrl.engines.forward import (
    forward_entropy,
    forward_logprobs,
    forward_logprobs_entropy,
    forward_values,
    no_grad_mode,
    positions_from_mask,
)
from flowrl.engines.prefill import Prefixes, expand, left_pad, match, supports_levels
from flowrl.engines.prefill import positions as level_positions
from flowrl.engines.sampling import Draws, Sampler, row_keys, sampling_seed, slots_of
from flowrl.models.attention import SharedPrefix, reads_shared_prefix
from flowrl.models.build import cache_kw
from flowrl.models.tokenizer import Tokenizer

__all__ = [
    "GenOutput",
    "forward_entropy",
    "forward_logprobs",
    "forward_logprobs_entropy",
    "forward_values",
    "generate",
]


@dataclass(frozen=True)
class GenOutput:
    """A batch of rollouts: the n samples of prompt 0 first, then prompt 1, ...; N = B * n rows."""

    prompt_ids: Tensor  # (N, P) left-padded with pad_id
    prompt_mask: Tensor  # (N, P) 1 on real prompt tokens
    response_ids: Tensor  # (N, T) right-padded with pad_id
    response_mask: Tensor  # (N, T) 1 on generated tokens, EOS included
    response_lens: Tensor  # (N,)
    prompt_index: Tensor  # (N,) which prompt each row came from
    logprobs: Tensor  # (N, T) log-prob of each sampled token under softmax(logits / temperature); 0 on pads


def generate(
    module: nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    max_tokens: int,
    min_tokens: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    prompt_slots: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    share_prefix: bool = True,
    prefixes: Prefixes | None = None,
    device: str | torch.device = "cpu",
) -> GenOutput:
    """Sample `n` responses per prompt; temperature 0 is greedy, EOS is banned before `min_tokens`. Sample j of
    prompt i draws from the stream of (`seed`, `prompt_slots[i]`, j) (slots default to 0..B-1: give each prompt's
    place in the whole batch when this is a part of it); `generator`, where a caller hands one instead of a
    seed, gives its `initial_seed()`. With `prefixes` (computed here or elsewhere, flowrl.engines.prefill), a
    prompt opening with one of them prefills only its rest (same samples, to float rounding)."""
    check_sampling_args(prompts, n, max_tokens, min_tokens, temperature, top_p)
    pad, eos = tokenizer.pad_id, tokenizer.eos_id
    dev = torch.device(device)
    ids, mask = left_pad_prompts(prompts, pad, dev)  # (B, P)
    batch = ids.shape[0]
    rows = batch * n
    full_prompt_mask = mask.repeat_interleave(n, dim=0)  # (N, P)
    sampler = Sampler(temperature, top_p, min_tokens, eos)
    keys = row_keys(sampling_seed(seed, generator), slots_of(prompt_slots, batch), n, dev)  # (N, 2)
    # each row's uniforms, hashed a block of steps at a time (greedy draws none)
    draws = Draws(keys, block=min(32, max_tokens)) if temperature > 0 else None

    out_ids = torch.full((rows, max_tokens), pad, dtype=torch.long, device=dev)
    out_mask = torch.zeros((rows, max_tokens), dtype=torch.long, device=dev)
    out_lp = torch.zeros((rows, max_tokens), dtype=torch.float32, device=dev)
    next_pos = positions_from_mask(full_prompt_mask)[:, -1:] + 1  # (N, 1) position of response token 0
    live: Tensor | None = None  # current batch row -> output row; None while it is the identity
    done = torch.zeros(rows, dtype=torch.bool, device=dev)

    with no_grad_mode(module):
        pre = prefill_prompts(module, prompts, ids, mask, n=n, share=share_prefix and n > 1, extra=max_tokens,
                              prefixes=prefixes, pad=pad)
        # `ours`: the cache is our buffered one, which also supports dropping finished rows mid-decode.
        cache, ours, logits, width = pre.cache, pre.ours, pre.logits, pre.mask.shape[1]
        kv = cache_kw(module, cache)  # the same cache, updated in place, for every step
        # Generated slots always attend (finished rows are never read), so the mask is built once and sliced.
        attn = torch.cat([pre.mask, torch.ones_like(out_mask)], dim=1)  # (N, W + max_tokens)
        remaining = rows  # rows of the batch still decoding
        for t in range(max_tokens):
            tok, lp = sampler.sample(logits, t, None if draws is None else draws.at(t))  # (rows_now,)
            target = slice(None) if live is None else live
            if remaining < done.shape[0]:  # rows finished earlier keep pad / 0 / 0 (until they are dropped)
                tok, lp = tok.masked_fill(done, pad), lp.masked_fill(done, 0.0)
                out_mask[target, t] = (~done).long()
            else:
                out_mask[target, t] = 1
            out_ids[target, t] = tok
            out_lp[target, t] = lp
            if t >= min_tokens:  # before, EOS is banned (probability 0, never sampled): no row can finish
                done = done | (tok == eos)
                remaining = int((~done).sum())  # the one host sync per step
            if remaining == 0 or t == max_tokens - 1:
                break
            if ours and remaining <= done.shape[0] // 2:
                # Finished rows would still cost a full forward each step; drop them (amortised: halves each time).
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live = keep if live is None else live[keep]
                done, tok, attn, next_pos = done[keep], tok[keep], attn[keep], next_pos[keep]
                if draws is not None:
                    draws.select(keep)
            out = module(input_ids=tok[:, None], attention_mask=attn[:, : width + t + 1],
                         position_ids=next_pos + t, use_cache=True, **kv)  # fmt: skip
            logits = out.logits[:, -1].float()  # (rows_now, V)

    lens = out_mask.sum(dim=1)  # (N,)
    length = int(lens.max())
    return GenOutput(
        prompt_ids=ids.repeat_interleave(n, dim=0),
        prompt_mask=full_prompt_mask,
        response_ids=out_ids[:, :length].contiguous(),
        response_mask=out_mask[:, :length].contiguous(),
        response_lens=lens,
        prompt_index=torch.arange(batch, device=dev).repeat_interleave(n),
        logprobs=out_lp[:, :length].contiguous(),
    )


@dataclass
class Prefilled:
    """Prompts prefilled into a new decode cache: the (N, V) scores of response token 0 and the (N, W) mask of
    the cache's prompt slots (W: the prompt width, or a prefix's and a rest's with `prefixes`)."""

    cache: Any
    ours: bool  # the cache is flowrl's buffered one (it can drop finished rows)
    logits: Tensor
    mask: Tensor


def prefill_prompts(module: nn.Module, prompts: Sequence[Sequence[int]], ids: Tensor, mask: Tensor, *, n: int,
                    share: bool, extra: int, prefixes: Prefixes | None, pad: int) -> Prefilled:
    """The prefill of `generate` and `generate_stream` (under `no_grad_mode`): the B left-padded prompts `ids`,
    once each when `share` (the cache then repeated n times), else each of the N = B * n rows. With `prefixes`,
    a prompt opening with one runs only its rest, after the prefix's keys and values (rows [prefix | rest],
    engines/prefill.py); caches other than full attention (sliding windows) ignore them."""
    group_of = match(prompts, prefixes) if prefixes is not None else []
    if prefixes is None or max(group_of, default=-1) < 0 or not supports_levels(module):
        cache, ours = make_cache(module, ids.shape[1] + extra)
        run_ids, run_mask = (ids, mask) if share else (ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0))
        out = module(input_ids=run_ids, attention_mask=run_mask, position_ids=positions_from_mask(run_mask),
                     use_cache=True, logits_to_keep=1, **cache_kw(module, cache))  # fmt: skip
        cache_mask = run_mask
    else:
        past, past_mask, start = expand(prefixes.to(ids.device), group_of)
        rest_ids, rest_mask = left_pad([p[int(s):] for p, s in zip(prompts, start.tolist(), strict=True)], pad,
                                       ids.device)
        if not share:
            past = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in past]
            past_mask, start = past_mask.repeat_interleave(n, 0), start.repeat_interleave(n, 0)
            rest_ids, rest_mask = rest_ids.repeat_interleave(n, 0), rest_mask.repeat_interleave(n, 0)
        cache, ours = make_cache(module, past_mask.shape[1] + rest_ids.shape[1] + extra)
        for layer, (k, v) in zip(cache.layers, past, strict=True):
            layer.update(k, v)
        cache_mask = torch.cat([past_mask, rest_mask], dim=1)
        out = module(input_ids=rest_ids, attention_mask=cache_mask, position_ids=level_positions(rest_mask, start),
                     use_cache=True, logits_to_keep=1, **cache_kw(module, cache))  # fmt: skip
    logits = out.logits[:, -1].float()  # (B or N, V)
    if share:
        logits, cache_mask = logits.repeat_interleave(n, dim=0), cache_mask.repeat_interleave(n, dim=0)
        cache.batch_repeat_interleave(n)
    return Prefilled(cache, ours, logits, cache_mask)


class _BufferedLayer(DynamicLayer):
    """A DynamicLayer backed by a preallocated (B, H, capacity, D) buffer.

    HF's DynamicLayer concatenates the whole cache every step (quadratic copying); this writes one slot and hands
    attention a view. Subclassing is the narrowest way to plug into HF's Cache protocol.

    With `shared` (the model's attention reads a `SharedPrefix`, flowrl.models.attention), repeating the rows of
    a prefilled prompt batch n times keeps the prompts' KV once instead: the buffer then holds each sample's own
    tokens only, and every view handed to attention carries the prefix as `flowrl_prefix`.
    """

    is_croppable = False

    def __init__(self, capacity: int, shared: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0  # tokens per row, the prompt prefix included
        self.shared = shared
        self.prefix: SharedPrefix | None = None
        self.base = 0  # tokens held by `prefix` (0 without one)
        self._keys: Tensor | None = None
        self._values: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self._keys = key_states.new_empty((b, h, self.capacity, dk))
        self._values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._keys is not None and self._values is not None
        start, end = self.length - self.base, self.length - self.base + key_states.shape[-2]
        if end > self._keys.shape[2]:
            raise RuntimeError(f"KV buffer overflow: {end + self.base} > capacity {self.capacity}")
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.length = end + self.base
        self._refresh_views()
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._keys is None or self._values is None:
            return
        if self.shared and self.prefix is None and self.length > 0:
            # Keep the prompts once; the samples' own tokens go to a fresh (N, H, capacity - P, D) buffer.
            keys, values = self._keys[:, :, : self.length], self._values[:, :, : self.length]
            self.prefix, self.base = SharedPrefix.grouped(keys, values, repeats), self.length
            rows, rest = keys.shape[0] * repeats, self.capacity - self.length
            self._keys = keys.new_empty((rows, keys.shape[1], rest, keys.shape[3]))
            self._values = values.new_empty((rows, values.shape[1], rest, values.shape[3]))
        else:
            self._materialize()
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
        self._refresh_views()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._keys is not None and self._values is not None:
            self._keys = self._keys[indices]
            self._values = self._values[indices]
            if self.prefix is not None:
                self.prefix = self.prefix.select(indices)
            self._refresh_views()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def rows(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """Whole (len(indices), H, length, D) keys and values of some rows (the prefix included), as copies."""
        assert self._keys is not None and self._values is not None
        own = self._keys[indices, :, : self.length - self.base], self._values[indices, :, : self.length - self.base]
        if self.prefix is None:
            return own[0].clone(), own[1].clone()
        pk, pv = self.prefix.rows(indices)
        return torch.cat([pk, own[0]], dim=2), torch.cat([pv, own[1]], dim=2)

    def _materialize(self) -> None:
        """Back to one buffer holding every row's whole cache (before a second repeat)."""
        if self.prefix is None or self._keys is None:
            return
        keys, values = self.rows(torch.arange(self._keys.shape[0], device=self._keys.device))
        self.prefix, self.base = None, 0
        self._keys = keys.new_empty((keys.shape[0], keys.shape[1], self.capacity, keys.shape[3]))
        self._values = values.new_empty((values.shape[0], values.shape[1], self.capacity, values.shape[3]))
        self._keys[:, :, : self.length], self._values[:, :, : self.length] = keys, values

    def _refresh_views(self) -> None:
        assert self._keys is not None and self._values is not None
        keys = self._keys[:, :, : self.length - self.base]
        if self.prefix is not None:
            keys.flowrl_prefix = self.prefix  # type: ignore[attr-defined]  # read by flowrl's attention
        self.keys, self.values = keys, self._values[:, :, : self.length - self.base]


def kv_rows(layer: DynamicLayer, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of some rows' whole keys and values from any cache layer (a tail moving to another worker)."""
    if isinstance(layer, _BufferedLayer):
        return layer.rows(rows)
    assert layer.keys is not None and layer.values is not None
    return layer.keys[rows].clone(), layer.values[rows].clone()


def make_cache(module: nn.Module, capacity: int) -> tuple[Any, bool]:
    """A DynamicCache for `module`; its plain full-attention layers swapped for buffered ones when possible
    (sharing the prompt prefix across samples when the model's attention reads one)."""
    config = getattr(module, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    layers = list(getattr(cache, "layers", []))
    # Sliding-window / linear-attention layers have their own semantics: keep HF's cache untouched for those.
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        shared = reads_shared_prefix(module)
        cache.layers = [_BufferedLayer(capacity, shared) for _ in layers]
        return cache, True
    return cache, False


def left_pad_prompts(prompts: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def check_sampling_args(
    prompts: Sequence[Sequence[int]], n: int, max_tokens: int, min_tokens: int, temperature: float, top_p: float
) -> None:
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS) to condition on")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 <= min_tokens <= max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
