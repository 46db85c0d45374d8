"""Chunks of a streamed rollout (flowrl.runtime): what generation ranks yield and how the fused stage's scheduler
(`flowrl.runtime.gen_infer`) merges them and puts them back in sample order.

`ModelWorker.generate_stream` turns the engine's chunks into rollout `Batch`es (`chunk_batches`), unfinished
samples' responses so far into `Growing` batches, and with "own-rank" scoring runs the chunk forwards itself
(`score_chunks` -> `Scored`); `assemble` restores sample order and padding at the end, so downstream nodes see
the batch the unfused step computes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.engines.chunked_generation import GenChunk, Sampling, Tail
from flowrl.ir.attrs import GenerateAttrs
from flowrl.models.tokenizer import Tokenizer
from flowrl.runtime.batch import Batch
from flowrl.runtime.shaping import ended_with

STREAMS = ("generate_stream", "resume_stream")  # worker methods that yield items (RankGroup.on_rank streams)
SCRATCH = ("sample", "pad")  # per-chunk bookkeeping tensors, dropped when chunks are assembled
# What `ModelWorker.score_growing` reads of a sample; `final` marks those that finished.
GROWING_KEYS = ("sample", "pad", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "temperature")
OUTPUT = {"logprobs": "logp", "values": "values", "score": "scores"}  # forward op -> its output field


def sampling_of(a: GenerateAttrs) -> Sampling:
    return Sampling(a.max_tokens, a.min_tokens, a.temperature, a.top_p)


def chunk_of(a: GenerateAttrs) -> int:
    return a.stream_chunk or 1 << 30  # no stream_chunk: one chunk at the end


@dataclass(frozen=True)
class Growing:
    """Unfinished samples' responses so far (the rollout's tensors, no text): scored while they decode."""

    batch: Batch


def chunk_batches(stream: Iterator[GenChunk | Tail], tok: Tokenizer,
                  a: GenerateAttrs) -> Iterator[Batch | Growing | Tail]:
    """Engine chunks as rollout `Batch`es (the fields `ModelWorker.generate` returns, plus SCRATCH)."""
    temperature, n = a.temperature, a.n
    for item in stream:
        if isinstance(item, Tail):
            yield item
            continue
        size = int(item.samples.shape[0])
        responses = [tok.decode([t for t, m in zip(r, mk, strict=True) if m]) for r, mk in
                     zip(item.response_ids.tolist(), item.response_mask.tolist(), strict=True)] if item.final else []
        tensors = {
            "prompt_ids": item.prompt_ids.cpu(), "prompt_mask": item.prompt_mask.cpu(),
            "response_ids": item.response_ids.cpu(), "response_mask": item.response_mask.cpu(),
            "group_id": item.samples.cpu() // n, "temperature": torch.full((size,), temperature),
            "gen_logp": item.logprobs.cpu(), "sample": item.samples.cpu(), "pad": torch.full((size,), tok.pad_id),
        }
        if item.final:  # cut at max_tokens: no EOS (as `ModelWorker.generate` marks it)
            tensors["truncated"] = ~ended_with(tensors["response_ids"], tensors["response_mask"], tok.eos_id)
            yield Batch(size, tensors, {"response": responses}, primary="response_ids")
        else:
            yield Growing(Batch(size, tensors, {}, primary="response_ids"))


@dataclass(frozen=True)
class ChunkForward:
    """A forward a generation rank runs itself on each of its chunks (`GenInfer`'s "own-rank" schedule)."""

    node: str
    op: str  # logprobs | values | score
    model: str
    attrs: Mapping[str, Any]


@dataclass(frozen=True)
class Scored:
    """A chunk with the results of its `ChunkForward`s: node id -> (output, seconds it took)."""

    batch: Batch
    outs: Mapping[str, tuple[Batch, float]]


def score_chunks(worker: Any, items: Iterator[Batch | Growing | Tail], inline: Sequence[ChunkForward]
                 ) -> Iterator[Batch | Growing | Tail | Scored]:
    """Run `inline` on every chunk as it comes out of the stream (in the rank's own process)."""
    for item in items:
        if not isinstance(item, Batch) or not inline:
            yield item
            continue
        outs: dict[str, tuple[Batch, float]] = {}
        for f in inline:
            t0 = time.perf_counter()
            outs[f.node] = (getattr(worker, f.op)(f.model, item, dict(f.attrs)), time.perf_counter() - t0)
        yield Scored(item, outs)


def assemble(batches: Sequence[Batch], samples: Sequence[torch.Tensor]) -> Batch:
    """Chunk batches put back in sample order, without SCRATCH; 2-D tensors padded as one batch has them
    (responses on the right, prompts on the left, token ids with the tokenizer's pad)."""
    whole = concat(batches)
    order = torch.argsort(torch.cat(list(samples)))
    rows = order.tolist()
    tensors = {k: t[order] for k, t in whole.tensors.items() if k not in SCRATCH}
    return Batch(len(rows), tensors, {k: [v[i] for i in rows] for k, v in whole.meta.items()}, whole.primary)


def concat(batches: Sequence[Batch]) -> Batch:
    """Chunk batches as one, in the order given (every tensor kept, 2-D ones padded as `assemble` pads)."""
    pad = int(batches[0]["pad"][0]) if "pad" in batches[0].tensors else 0
    fills = {"prompt_ids": pad, "response_ids": pad, "turn_index": -1}  # turn_index: -1 on pads (env rollouts)
    tensors = {k: _cat([b.tensors[k] for b in batches], left=k.startswith("prompt_"), fill=fills.get(k, 0))
               for k in batches[0].tensors}
    meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
    return Batch(sum(b.size for b in batches), tensors, meta, batches[0].primary)


def _cat(parts: list[torch.Tensor], left: bool, fill: int) -> torch.Tensor:
    if parts[0].dim() < 2:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    out = []
    for p in parts:
        gap = p.new_full((p.shape[0], width - p.shape[1], *p.shape[2:]), fill)
        out.append(torch.cat([gap, p] if left else [p, gap], dim=1))
    return torch.cat(out)


def growing_rows(batch: Batch, final: bool) -> Batch:
    """The fields `ModelWorker.score_growing` reads, with every row's `final` flag."""
    tensors = {k: batch.tensors[k] for k in GROWING_KEYS if k in batch.tensors}
    tensors["final"] = torch.full((batch.size,), final, dtype=torch.bool)
    return Batch(batch.size, tensors, {}, "response_ids")


def merge_rows(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], size: int) -> torch.Tensor:
    """Per-rank outputs (each for the final rows at positions `index`) as one (size, ...) tensor."""
    if not parts:
        return torch.zeros(0)
    if parts[0][1].dim() == 1:  # scores
        flat = torch.zeros(size)
        for index, o in parts:
            flat[index] = o
        return flat
    out = torch.zeros((size, max(o.shape[1] for _, o in parts)))
    for index, o in parts:
        out[index, : o.shape[1]] = o
    return out
