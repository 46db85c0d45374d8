"""Cut-and-migrate on serverless generation instances (RLHFless; issue 15 item 5).

A generation call on N instances runs as N streams (`ModelWorker.generate_stream`: `generate`'s samples, same
seeds). The instance holding the prompts with the longest predicted responses (the last of the length-ranked runs)
is the *sink*; the others are *sources*. A source that has finished a fraction `tau` of its sequences
(flowrl.elastic.should_migrate) stops after a decode step, exports its unfinished rows with their decoding state
(KV cache, pending tokens, each row's random-stream key and step: the engine's `Tail`), hands them to the sink
through the `Mailbox` and returns, releasing its device; a source that finishes before that says so. The sink
checks its box between decode steps: when tails came, it exports its own rows too and resumes them all as one batch
(`resume_stream`), so every row keeps its own random stream (keyed by its prompt's slot in the step and its sample
index, flowrl.engines.sampling) and the samples are those of a run without migration, or on one rank. Having
finished its own rows, the sink waits for every source's word (a tail or "finished"), so no tail is ever left
without an instance. Each instance returns its finished rows with their sample numbers (`Part`); `assemble` puts
the rollout back in sample order. In a fused stage the same instances also stream (backends/serverless/stream.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from flowrl.elastic.migrate import should_migrate
from flowrl.engines.chunked_generation import Tail
from flowrl.engines.prefill import Prefixes
from flowrl.ir.attrs import GenerateAttrs
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import ChunkForward, Scored, assemble, score_chunks
from flowrl.runtime.worker import ModelWorker

METHOD = "generate_migrating"  # the instance-side method name of a migrating or streamed generation


@dataclass(frozen=True)
class Role:
    """An instance's part in a migrating generation: `sources` > 0 for the sink (how many words to wait for);
    `rank`: which source (its word names it, so a retried source's second word is not taken twice)."""

    box: str
    tau: float
    sources: int = 0
    rank: int = 0


@dataclass
class Part:
    """What one generation instance returns: its finished rows as chunk batches (with their `sample` numbers),
    its own forwards' outputs on them (a fused stage's own-group forwards: node -> [(output, samples)]) and when
    they ran (wall clock), when its generation ended, and the rows that moved out of it and into it."""

    chunks: list[Batch] = field(default_factory=list)
    outs: dict[str, list[tuple[Batch, Any]]] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    ended: float = 0.0
    moved_out: int = 0
    moved_in: int = 0


def generate(worker: ModelWorker, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int,
             first_prompt: int, mailbox: Any, role: Role | None = None, box: str = "",
             inline: Sequence[ChunkForward] = (), prefixes: Prefixes | None = None) -> Part:
    """This instance's part of a generation: a source (cuts at `role.tau`), the sink (`role.sources` > 0), or
    neither (`role` None). In a fused stage (backends/serverless/stream.py) it also runs `inline` forwards on its
    chunks and offers every chunk to `box`, then ("end", its chunk count) once it has finished."""
    part = _Collect(worker, mailbox, box, inline)
    if role is not None and role.sources:
        _sink(worker, model, prompts, attrs, step_seed, first_prompt, role, part, prefixes)
    elif role is not None:
        total = prompts.size * GenerateAttrs.of(attrs).n
        tails = part.drain(worker.generate_stream(model, prompts, attrs, step_seed=step_seed,
                                                  first_prompt=first_prompt, control=_Trigger(total, role.tau),
                                                  inline=inline, prefixes=prefixes))
        tail = tails[0] if tails else None
        mailbox.offer.remote(role.box, (role.rank, None if tail is None else [ray.put(tail)]))
        part.out.moved_out = 0 if tail is None else int(tail.samples.shape[0])
    else:
        part.drain(worker.generate_stream(model, prompts, attrs, step_seed=step_seed, first_prompt=first_prompt,
                                          inline=inline, prefixes=prefixes))
    if box:  # this instance has finished, after this many chunks (an async actor may take words out of order)
        mailbox.offer.remote(box, ("end", len(part.out.chunks)))
    part.out.ended = time.time()
    return part.out


def _sink(worker: ModelWorker, model: str, prompts: Batch, attrs: Mapping[str, Any], seed: int,
          first_prompt: int, role: Role, part: _Collect, prefixes: Prefixes | None) -> None:
    inbox = _Inbox(part.mailbox, role.box, role.sources)
    stream: Iterable[Any] = worker.generate_stream(model, prompts, attrs, step_seed=seed, first_prompt=first_prompt,
                                                   control=inbox, inline=part.inline, prefixes=prefixes)
    while True:
        own = part.drain(stream)
        if not own and inbox.heard_all:
            return
        came = inbox.receive()  # own rows exported: tails are there; own rows done: wait for the sources' word
        part.out.moved_in += sum(int(t.samples.shape[0]) for t in came)
        tails = own + came
        stream = score_chunks(worker, worker.resume_stream(model, tails, attrs, control=inbox), part.inline) \
            if tails else iter(())


class _Collect:
    """An instance's finished chunks (offered to the fused stage's box as they come) and inline outputs."""

    def __init__(self, worker: ModelWorker, mailbox: Any, box: str, inline: Sequence[ChunkForward]):
        self.worker, self.mailbox, self.box, self.inline = worker, mailbox, box, list(inline)
        self.out = Part()

    def drain(self, stream: Iterable[Any]) -> list[Tail]:
        """Collect a stream's chunks -> the tails it exported."""
        tails: list[Tail] = []
        for item in stream:
            if isinstance(item, Tail):
                tails.append(item)
                continue
            if isinstance(item, Scored):
                batch, now = item.batch, time.time()
                for node, (result, took) in item.outs.items():
                    self.out.outs.setdefault(node, []).append((result, batch["sample"]))
                    self.out.spans[node] = (self.out.spans.get(node, (now - took, 0.0))[0], now)
            elif isinstance(item, Batch):
                batch = item
            else:
                continue
            self.out.chunks.append(batch)
            if self.box:
                self.mailbox.offer.remote(self.box, [ray.put(batch)])
        return tails


class _Trigger:
    """A source's stream control: hand the rest over once a fraction `tau` of its sequences finished."""

    def __init__(self, total: int, tau: float):
        self.total, self.tau, self.remaining = total, tau, total

    def progress(self, remaining: int) -> None:
        self.remaining = remaining

    def should_export(self) -> bool:
        return should_migrate(self.total - self.remaining, self.total, self.tau)


class _Inbox:
    """The sink's stream control: export its own rows (to resume them with the tails) once tails are waiting."""

    def __init__(self, mailbox: Any, box: str, sources: int):
        self.mailbox, self.box, self.sources = mailbox, box, sources
        self.heard: set[int] = set()  # the sources whose word came (a retried source may send it twice)
        self.since = 0  # words read from the box
        self.pending: Any = mailbox.take_all.remote(box)

    @property
    def heard_all(self) -> bool:
        return len(self.heard) >= self.sources

    def progress(self, remaining: int) -> None:
        pass

    def should_export(self) -> bool:
        if self.heard_all:
            return False
        ready, _ = ray.wait([self.pending], timeout=0)
        return bool(ready)

    def receive(self) -> list[Tail]:
        """The words in the box (waiting for at least one) -> the tails among them."""
        if self.heard_all:
            return []
        words = ray.get(self.pending)
        self.since += len(words)
        tails = []
        for rank, tail in words:
            if rank not in self.heard:
                self.heard.add(rank)
                if tail is not None:
                    tails.append(ray.get(tail[0]))
        if not self.heard_all:
            self.pending = self.mailbox.take_all.remote(self.box, self.since)
        return tails


def merge(parts: Iterable[list[Batch]], prompts: Batch) -> Batch:
    """The instances' finished rows as one rollout in sample order (as `generate` returns it), with the prompts'
    fields per sample."""
    chunks = [b for part in parts for b in part]
    rollout = assemble(chunks, [b["sample"] for b in chunks])
    gids = rollout["group_id"].tolist()
    meta = {key: [values[int(g)] for g in gids] for key, values in prompts.meta.items()}
    meta["response"] = rollout.meta["response"]
    meta.update({k: v for k, v in rollout.meta.items() if k not in meta})  # a rollout's own (env_ended, ...)
    return Batch(rollout.size, rollout.tensors, meta, rollout.primary)
