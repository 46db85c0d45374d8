"""Chunked generation for the torch engine (flowrl.engines): `generate_stream` yields samples as they finish.

What `fuse-gen-inference` runs on each generation rank. It is `generate`'s decode loop (same prefill, same
per-row random streams, same dropping of finished rows), so a stream that runs to the end yields `generate`'s
samples, only handed over in chunks (`GenChunk`) as they finish rather than all at the end.

The long tail can also move: when asked (`StreamControl.should_export`), a stream stops after a step and
yields a `Tail`: the unfinished rows' KV caches, pending tokens, partial outputs and stream keys and steps.
Another rank resumes any number of tails together (`resume_stream`) in one batch. Sampling stays the same
because a row's draws are a function of its key and its response step only (flowrl.engines.sampling): rows from
any sources decode side by side, each at its own step.

With `partial`, once at most that many rows are still decoding, every flush also hands over the unfinished
rows' responses so far (a `GenChunk` with `final = False`), so a consumer elsewhere can score their tokens
while they still decode (`flowrl.engines.incremental`); those rows come again, whole, when they finish.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from flowrl.engines.forward import no_grad_mode, positions_from_mask
from flowrl.engines.generation import (
    check_sampling_args,
    kv_rows,
    left_pad_prompts,
    make_cache,
    prefill_prompts,
)
from flowrl.engines.prefill import Prefixes
from flowrl.engines.sampling import Draws, Sampler, Sampling, row_keys, sampling_seed, slots_of
from flowrl.models.build import cache_kw
from flowrl.models.tokenizer import Tokenizer

__all__ = ["GenChunk", "Sampling", "StreamControl", "Tail", "generate_stream", "resume_stream"]


class StreamControl(Protocol):
    """The scheduler's side of a stream: progress reports in, the request to hand the tail over out."""

    def progress(self, remaining: int) -> None: ...

    def should_export(self) -> bool: ...


@dataclass(frozen=True)
class GenChunk:
    """Finished samples. `samples` are rollout row numbers (n samples of prompt 0 first, then prompt 1, ...)."""

    samples: Tensor  # (c,)
    prompt_ids: Tensor  # (c, P) left-padded
    prompt_mask: Tensor  # (c, P)
    response_ids: Tensor  # (c, Tc) right-padded to the longest response in the chunk
    response_mask: Tensor  # (c, Tc)
    logprobs: Tensor  # (c, Tc)
    remaining: int  # samples of this stream still decoding
    final: bool = True  # False: unfinished samples, their responses so far


@dataclass
class Tail:
    """Unfinished rows handed from one rank to another, between a sampling step and the next forward."""

    samples: Tensor  # (r,) rollout row numbers
    prompt_ids: Tensor  # (r, P)
    prompt_mask: Tensor  # (r, P)
    out_ids: Tensor  # (r, max_tokens) response so far
    out_lp: Tensor
    out_mask: Tensor
    kv: list[tuple[Tensor, Tensor]]  # per layer (r, heads, L, d): the cache before the pending token
    mask: Tensor  # (r, L)
    pos: Tensor  # (r,) position of the pending token
    pending: Tensor  # (r,) sampled, not yet fed
    keys: Tensor  # (r, 2) each row's random-stream key (flowrl.engines.sampling)
    steps: Tensor  # (r,) each row's response step: the index of its pending token
    source: int = -1  # the rank it comes from (set by the scheduler)


class _Decoder:
    """Batched decode state of one rank: physical rows, the KV cache and output buffers. Rows may be at
    different response steps (a batch resumed from several tails): each samples at its own step."""

    def __init__(self, module: nn.Module, tok: Tokenizer, s: Sampling, samples: Tensor, prompt_ids: Tensor,
                 prompt_mask: Tensor, out: tuple[Tensor, Tensor, Tensor], keys: Tensor) -> None:
        self.module, self.s = module, s
        self.pad, self.eos = tok.pad_id, tok.eos_id
        self.sampler = Sampler(s.temperature, s.top_p, s.min_tokens, self.eos)
        self.samples, self.prompt_ids, self.prompt_mask = samples, prompt_ids, prompt_mask  # per local slot
        self.out_ids, self.out_lp, self.out_mask = out  # (S, max_tokens) per local slot
        self.keys = keys  # (S, 2) per local slot: its random-stream key
        self.draws: Draws | None = None  # the rows' uniforms from their steps at the first sample (and `clock`)
        self.clock = 0
        self.ours = True
        self.cache: object = None
        self.logits: Tensor | None = None  # (R, V) scores of the next token, None before the first forward
        self.rows = self.pos = self.pending = self.t_row = torch.empty(0, dtype=torch.long)
        self.done = torch.empty(0, dtype=torch.bool)
        self.attn = torch.empty(0, 0, dtype=torch.long)
        self.length = 0

    def sample_step(self) -> list[int]:
        """Sample every live row's next token; returns the local slots that finished at this step."""
        assert self.logits is not None
        u = None
        if self.s.temperature > 0:
            if self.draws is None:  # every row samples once per forward: `length` counts the steps since
                self.draws = Draws(self.keys[self.rows], self.t_row, block=min(32, self.s.max_tokens))
                self.clock = self.length
            u = self.draws.at(self.length - self.clock)
        tok, lp = self.sampler.sample(self.logits, self.t_row, u)
        was_done = self.done
        tok = tok.masked_fill(was_done, self.pad)
        # Finished rows keep the buffers' initial pad / 0 (and may be past max_tokens in a resumed batch).
        live = (~was_done).nonzero().squeeze(1)
        slots, steps = self.rows[live], self.t_row[live]
        self.out_ids[slots, steps] = tok[live]
        self.out_lp[slots, steps] = lp[live]
        self.out_mask[slots, steps] = 1
        # Rows still going at max_tokens finish by length.
        done = was_done | (tok == self.eos) | (self.t_row >= self.s.max_tokens - 1)
        finished = self.rows[(done & ~was_done).nonzero().squeeze(1)].tolist()
        self.done, self.pending = done, tok
        return finished

    def advance(self) -> None:
        """Feed the pending tokens: one decode step for every physical row. Finished rows would still cost a
        forward each; once at most half the rows are live they are dropped (amortised: halves each time)."""
        if self.ours and int((~self.done).sum()) <= self.done.shape[0] // 2:
            self._keep(~self.done)
        self.length += 1
        with no_grad_mode(self.module):
            out = self.module(input_ids=self.pending[:, None], attention_mask=self.attn[:, : self.length],
                              position_ids=self.pos[:, None], use_cache=True, **cache_kw(self.module, self.cache))  # fmt: skip
        self.logits = out.logits[:, -1].float()
        self.pos = self.pos + 1
        self.t_row = self.t_row + 1

    def _keep(self, keep_mask: Tensor) -> None:
        keep = keep_mask.nonzero().squeeze(1)
        with no_grad_mode(self.module):
            self.cache.batch_select_indices(keep)  # type: ignore[attr-defined]
        for name in ("rows", "pos", "pending", "t_row", "done", "attn"):
            setattr(self, name, getattr(self, name)[keep])
        if self.logits is not None:
            self.logits = self.logits[keep]
        if self.draws is not None:
            self.draws.select(keep)

    # -- hand-offs -----------------------------------------------------------------------------------
    @property
    def remaining(self) -> int:
        return int((~self.done).sum())

    def take(self, slots: Sequence[int] | Tensor, final: bool = True) -> GenChunk:
        idx = torch.as_tensor(slots, dtype=torch.long)
        lens = self.out_mask[idx].sum(1)
        width = max(1, int(lens.max()))
        return GenChunk(self.samples[idx], self.prompt_ids[idx], self.prompt_mask[idx],
                        self.out_ids[idx, :width].clone(), self.out_mask[idx, :width].clone(),
                        self.out_lp[idx, :width].clone(), self.remaining, final)

    def take_live(self) -> GenChunk:
        """The unfinished rows' responses so far."""
        return self.take(self.rows[~self.done].cpu(), final=False)

    def export(self) -> Tail:
        live = (~self.done).nonzero().squeeze(1)
        slots = self.rows[live]
        layers = self.cache.layers  # type: ignore[attr-defined]
        kv = [kv_rows(layer, live) for layer in layers]
        return Tail(self.samples[slots], self.prompt_ids[slots], self.prompt_mask[slots], self.out_ids[slots],
                    self.out_lp[slots], self.out_mask[slots], kv, self.attn[live, : self.length],
                    self.pos[live], self.pending[live], self.keys[slots], self.t_row[live])


def generate_stream(module: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], *, n: int,
                    sampling: Sampling, chunk: int, seed: int | None = None,
                    prompt_slots: Sequence[int] | None = None, generator: torch.Generator | None = None,
                    share_prefix: bool = True, first_sample: int = 0, control: StreamControl | None = None,
                    flush: int = 0, partial: float = 0.0, prefixes: Prefixes | None = None,
                    device: str | torch.device = "cpu") -> Iterator[GenChunk | Tail]:
    """`generate(...)` as a stream (`seed`, `prompt_slots`, `generator` and `prefixes` as there; `first_sample`:
    the rollout row number of this stream's first row): finished samples in chunks of about `chunk` (and,
    with `flush`, whatever finished once `flush` decode steps passed since the last hand-over), or a `Tail` when
    exported. With `partial` (a fraction of the rows), unfinished rows' responses so far go out every `flush`
    steps once at most that fraction is still decoding."""
    s = sampling
    check_sampling_args(prompts, n, s.max_tokens, s.min_tokens, s.temperature, s.top_p)
    dev = torch.device(device)
    ids, mask = left_pad_prompts(prompts, tokenizer.pad_id, dev)  # (B, P)
    batch = ids.shape[0]
    rows = batch * n
    out = (torch.full((rows, s.max_tokens), tokenizer.pad_id, dtype=torch.long, device=dev),
           torch.zeros((rows, s.max_tokens), dtype=torch.float32, device=dev),
           torch.zeros((rows, s.max_tokens), dtype=torch.long, device=dev))
    full_mask = mask.repeat_interleave(n, dim=0)  # (N, P)
    keys = row_keys(sampling_seed(seed, generator), slots_of(prompt_slots, batch), n, dev)  # (N, 2)
    dec = _Decoder(module, tokenizer, s, torch.arange(rows, device=dev) + first_sample,
                   ids.repeat_interleave(n, dim=0), full_mask, out, keys)
    with no_grad_mode(module):
        pre = prefill_prompts(module, prompts, ids, mask, n=n, share=share_prefix and n > 1, extra=s.max_tokens,
                              prefixes=prefixes, pad=tokenizer.pad_id)
    dec.cache, dec.ours, dec.logits = pre.cache, pre.ours, pre.logits
    dec.rows = torch.arange(rows, device=dev)
    dec.t_row = torch.zeros(rows, dtype=torch.long, device=dev)
    dec.done = torch.zeros(rows, dtype=torch.bool, device=dev)
    dec.attn = torch.cat([pre.mask, torch.ones_like(out[2])], dim=1)  # (N, W + max_tokens)
    dec.pos = positions_from_mask(full_mask)[:, -1] + 1
    dec.length = pre.mask.shape[1]
    return _drive(dec, chunk, control, flush, math.floor(partial * rows) if flush > 0 else 0)


def resume_stream(module: nn.Module, tokenizer: Tokenizer, tails: Sequence[Tail], *, sampling: Sampling,
                  chunk: int, control: StreamControl | None = None, flush: int = 0, partial: float = 0.0,
                  device: str | torch.device = "cpu") -> Iterator[GenChunk | Tail]:
    """Continue the rows of `tails` (from any ranks) as one batch; each row keeps its own random stream
    (already the tail: with `partial` > 0 its unfinished rows go out every `flush` steps)."""
    s = sampling
    dev = torch.device(device)
    width = max(t.mask.shape[1] for t in tails)
    prompt_width = max(t.prompt_ids.shape[1] for t in tails)

    def left(x: Tensor, w: int, fill: int = 0) -> Tensor:  # (r, L, ...) -> (r, w, ...) padded on the left
        pad = x.new_full((x.shape[0], w - x.shape[1], *x.shape[2:]), fill)
        return torch.cat([pad, x], dim=1)

    cat = torch.cat
    dec = _Decoder(module, tokenizer, s, cat([t.samples for t in tails]).to(dev),
                   cat([left(t.prompt_ids, prompt_width, tokenizer.pad_id) for t in tails]).to(dev),
                   cat([left(t.prompt_mask, prompt_width) for t in tails]).to(dev),
                   (cat([t.out_ids for t in tails]).to(dev), cat([t.out_lp for t in tails]).to(dev),
                    cat([t.out_mask for t in tails]).to(dev)), cat([t.keys for t in tails]).to(dev))
    rows = dec.samples.shape[0]
    dec.cache, dec.ours = make_cache(module, width + s.max_tokens)
    with no_grad_mode(module):
        for i, layer in enumerate(dec.cache.layers):  # type: ignore[attr-defined]
            keys = cat([left(t.kv[i][0].transpose(1, 2), width).transpose(1, 2) for t in tails]).to(dev)
            values = cat([left(t.kv[i][1].transpose(1, 2), width).transpose(1, 2) for t in tails]).to(dev)
            layer.update(keys, values)
    dec.rows = torch.arange(rows, device=dev)
    dec.t_row = cat([t.steps for t in tails]).to(dev)
    dec.pos = cat([t.pos for t in tails]).to(dev)
    dec.pending = cat([t.pending for t in tails]).to(dev)
    dec.done = torch.zeros(rows, dtype=torch.bool, device=dev)
    past = cat([left(t.mask, width) for t in tails]).to(dev)
    dec.attn = cat([past, torch.ones((rows, s.max_tokens), dtype=torch.long, device=dev)], dim=1)
    dec.length = width
    return _drive(dec, chunk, control, flush, rows if partial > 0 and flush > 0 else 0)


def _drive(dec: _Decoder, chunk: int, control: StreamControl | None, flush: int = 0,
           partial: int = 0) -> Iterator[GenChunk | Tail]:
    """The decode loop: sample, hand finished samples over in chunks, export when asked, feed, repeat. With
    `flush`, a partial chunk goes out once `flush` steps passed since the last hand-over: in the long tail,
    samples finish a few at a time and a consumer elsewhere would otherwise wait for the last one. Once at
    most `partial` rows are still decoding, their responses so far go out every `flush` steps too."""
    ready: list[int] = []
    since = grown = 0  # decode steps since the last hand-over / the last hand-over of unfinished rows
    if dec.logits is None:
        dec.advance()
    while True:
        ready.extend(dec.sample_step())
        since += 1
        grown += 1
        if dec.remaining == 0:
            if ready:
                yield dec.take(ready)
            return
        if len(ready) >= chunk or (flush > 0 and ready and since >= flush):
            yield dec.take(ready)
            ready, since = [], 0
        if 0 < dec.remaining <= partial and grown >= flush:
            yield dec.take_live()
            grown = 0
        if control is not None:
            control.progress(dec.remaining)
            if dec.ours and control.should_export():
                if ready:
                    yield dec.take(ready)
                yield dec.export()
                return
        dec.advance()
