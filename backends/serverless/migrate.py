"""Cut-and-migrate on serverless generation instances (RLHFless; issue 15 item 5).

A generation call on N instances runs as N streams (`ModelWorker.generate_stream`: `generate`'s samples, same
seeds). The instance holding the prompts with the longest predicted responses (the last of the length-ranked
runs) is the *sink*; the others are *sources*. A source that has finished a fraction `tau` of its sequences
(flowrl.elastic.should_migrate) stops after a decode step, exports its unfinished rows with their decoding
state (KV cache, pending tokens, sampling generators: the engine's `Tail`), hands them to the sink through the
`Mailbox` and returns, releasing its device; a source that finishes before that says so. The sink checks its
box between decode steps: when tails came, it exports its own rows too and resumes them all as one batch
(`resume_stream`), so every row keeps its own sampling draws and the samples are those of a run without
migration. Having finished its own rows, the sink waits for every source's word (a tail or "finished"), so no
tail is ever left without an instance. Each instance returns its finished rows with their sample numbers;
`assemble` puts the rollout back in sample order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray

from flowrl.elastic.migrate import should_migrate
from flowrl.engines.chunked_generation import Tail
from flowrl.ir.attrs import GenerateAttrs
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import assemble
from flowrl.runtime.worker import ModelWorker

METHOD = "generate_migrating"  # the instance-side method name the group sends for a migrating generation


@dataclass(frozen=True)
class Role:
    """An instance's part in a migrating generation: `sources` > 0 for the sink (how many words to wait for)."""

    box: str
    tau: float
    sources: int = 0


def generate(worker: ModelWorker, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int,
             first_prompt: int, role: Role, mailbox: Any) -> tuple[list[Batch], dict[str, int]]:
    """This instance's part -> (the finished rows it decoded, as chunk batches with their `sample` numbers;
    {"moved_out": rows handed to the sink, "moved_in": rows taken from sources})."""
    if role.sources:
        return _sink(worker, mailbox, model, prompts, attrs, step_seed, first_prompt, role)
    total = prompts.size * GenerateAttrs.of(attrs).n
    control = _Trigger(total, role.tau)
    done, tails = _drain(worker.generate_stream(model, prompts, attrs, step_seed=step_seed,
                                                first_prompt=first_prompt, control=control))
    tail = tails[0] if tails else None
    mailbox.offer.remote(role.box, None if tail is None else [ray.put(tail)])
    return done, {"moved_out": 0 if tail is None else int(tail.samples.shape[0]), "moved_in": 0}


def _sink(worker: ModelWorker, mailbox: Any, model: str, prompts: Batch, attrs: Mapping[str, Any], seed: int,
          first_prompt: int, role: Role) -> tuple[list[Batch], dict[str, int]]:
    inbox = _Inbox(mailbox, role.box, role.sources)
    stream = worker.generate_stream(model, prompts, attrs, step_seed=seed, first_prompt=first_prompt, control=inbox)
    finished: list[Batch] = []
    moved_in = 0
    while True:
        done, own = _drain(stream)
        finished.extend(done)
        if not own and inbox.heard_all:
            return finished, {"moved_out": 0, "moved_in": moved_in}
        came = inbox.receive()  # own rows exported: tails are there; own rows done: wait for the sources' word
        moved_in += sum(int(t.samples.shape[0]) for t in came)
        tails = own + came
        if tails:
            stream = worker.resume_stream(model, tails, attrs, control=inbox)
        else:
            stream = iter(())


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
        self.heard = 0
        self.pending: Any = mailbox.take_all.remote(box)

    @property
    def heard_all(self) -> bool:
        return self.heard >= self.sources

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
        self.heard += len(words)
        if not self.heard_all:
            self.pending = self.mailbox.take_all.remote(self.box, self.heard)
        return [ray.get(w[0]) for w in words if w is not None]


def _drain(stream: Iterable[Any]) -> tuple[list[Batch], list[Tail]]:
    done: list[Batch] = []
    tails: list[Tail] = []
    for item in stream:
        if isinstance(item, Tail):
            tails.append(item)
        elif isinstance(item, Batch):
            done.append(item)
    return done, tails


def merge(parts: Iterable[list[Batch]], prompts: Batch) -> Batch:
    """The instances' finished rows as one rollout in sample order (as `generate` returns it), with the prompts'
    fields per sample."""
    chunks = [b for part in parts for b in part]
    rollout = assemble(chunks, [b["sample"] for b in chunks])
    gids = rollout["group_id"].tolist()
    meta = {key: [values[int(g)] for g in gids] for key, values in prompts.meta.items()}
    meta["response"] = rollout.meta["response"]
    return Batch(rollout.size, rollout.tensors, meta, rollout.primary)
