"""The other worker groups' side of the fused generation stage (flowrl.runtime.gen_infer): forwards placed on
another group than generation get each chunk as soon as it arrives, one call at a time per group from a thread
of its own, so they run on their ranks while generation is still decoding (RLHFuse's overlap across groups).

- Chunks that queued up while a group was busy run together, one call per forward: the group never waits on a
  chunk, and fewer, larger calls cost less than one per chunk.
- `score-tail` (the generate node's `partial_below`): the unfinished samples' responses so far come too
  (`Live`); the group scores their tokens as they come (`ModelWorker.score_growing`, keeping each sample's KV
  cache on rank sample % world), and only the last tokens remain when a sample finishes (`Final`).
- `spill_to`: a forward of the generating model placed elsewhere may also be taken by a generation rank once its
  generation is over: chunks still queued for it go to whichever side is free first, each claimed once
  (RLHFuse hands freed generation workers the inference of the tail). Both sides hold the same weights during
  the stage (synced after every update).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from flowrl.ir.graph import Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import OUTPUT, concat, growing_rows, merge_rows
from flowrl.runtime.gen_infer.records import ELSEWHERE, Feed, Final, Finished, Live
from flowrl.runtime.gen_infer.results import Results
from flowrl.runtime.protocol import WorkerGroup
from flowrl.runtime.schedule import THREADS


def _drain(jobs: queue.SimpleQueue[Feed | None]) -> tuple[list[Feed], bool]:
    """Wait for one item, then take every item already queued; False once the end (None) was taken."""
    out: list[Feed] = []
    job = jobs.get()
    while job is not None:
        out.append(job)
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            return out, True
    return out, False


class _Work:
    """What one drain of an other group's queue holds for one forward."""

    def __init__(self, node: Node):
        self.node = node
        self.chunks: list[Batch] = []  # finished samples never sent live
        self.finals: list[Batch] = []  # finished samples the group holds state for
        self.live: list[Batch] = []  # `Growing` batches, oldest first

    def add(self, item: Feed) -> None:
        if isinstance(item, Finished):
            self.chunks.append(item.batch)
        elif isinstance(item, Final):
            self.finals.append(item.batch)
        else:
            self.live.append(item.batch)

    def latest(self, done: set[int]) -> list[tuple[Batch, torch.Tensor]]:
        """(batch, rows) holding each live sample's latest tokens, leaving out those in `done`."""
        where: dict[int, tuple[int, int]] = {}
        for b, batch in enumerate(self.live):
            for row, sample in enumerate(batch["sample"].tolist()):
                where[sample] = (b, row)
        rows: dict[int, list[int]] = {}
        for sample, (b, row) in where.items():
            if sample not in done:
                rows.setdefault(b, []).append(row)
        return [(self.live[b], torch.tensor(r, dtype=torch.long)) for b, r in sorted(rows.items())]


class Feeder:
    """The other groups of one stage: a queue and a thread each, the samples sent live, the spill claims."""

    def __init__(self, gen: Node, forwards: Sequence[Node], other: Mapping[str, WorkerGroup], results: Results,
                 run_on_generation_rank: Callable[[int, Node, Batch], Batch], partial_below: float):
        self.other, self.results = other, results
        self.run_on_generation_rank = run_on_generation_rank
        self.forwards = [f for f in forwards if f.worker_group in other]
        self.queues: dict[str, queue.SimpleQueue[Feed | None]] = {name: queue.SimpleQueue() for name in other}
        self.lock = threading.Lock()
        # Groups that score samples while they decode: the stage asks for it (partial_below) and each sample's
        # state can stay on one rank (one rank, or ranks callable one by one).
        grows = {name for name, g in other.items() if g.world == 1 or g.per_rank}
        self.grows = grows if partial_below > 0 else set()
        self.grown: set[int] = set()  # samples that went out while decoding
        self.partials = 0
        # `spill_to` forwards: their queued chunks, newest last, and the chunks either side has claimed, by
        # (node, id(chunk)): a chunk is held by `spillable` until claimed, then by `claimed`, so its id() names it
        # for the whole stage.
        self.spills = {f.id for f in self.forwards if f.attrs.get("spill_to") == gen.worker_group}
        self.spillable: deque[tuple[Node, Batch]] = deque()
        self.claimed: dict[tuple[str, int], Batch] = {}
        self.taken = 0  # chunk forwards a generation rank took
        self.stage = uuid.uuid4().hex  # keys the other groups' state of this stage's growing samples

    def start(self) -> Callable[[], None]:
        """Start a thread per other group; the returned call ends them and re-raises a failed forward."""
        join = THREADS.start([partial(self._loop, q) for q in self.queues.values()])

        def stop() -> None:
            for q in self.queues.values():
                q.put(None)
            join()
        return stop

    # -- what the generation side hands over ---------------------------------------------------------------
    def chunk(self, chunk: Batch) -> None:
        """Queue a chunk of finished samples for every forward placed elsewhere (its samples that went out while
        decoding as `Final`: their group holds their state)."""
        with self.lock:
            grown = torch.tensor([s in self.grown for s in chunk["sample"].tolist()], dtype=torch.bool)
        for node in self.forwards:
            jobs = self.queues[str(node.worker_group)]
            if node.worker_group not in self.grows or not grown.any():
                self._queue(jobs, node, chunk)
                continue
            if not grown.all():
                self._queue(jobs, node, chunk.select((~grown).nonzero().squeeze(1)))
            jobs.put(Final(node, chunk.select(grown.nonzero().squeeze(1))))

    def live(self, batch: Batch) -> None:
        """Queue unfinished samples' responses so far for the groups that score them while they decode."""
        with self.lock:
            self.grown.update(batch["sample"].tolist())
            self.partials += 1
        for node in self.forwards:
            if node.worker_group in self.grows:
                self.queues[str(node.worker_group)].put(Live(node, batch))

    def spill(self) -> tuple[Node, Batch] | None:
        """The newest queued chunk of a `spill_to` forward nobody took yet, claimed for a generation rank (the
        other group works through its queue oldest first)."""
        with self.lock:
            while self.spillable:
                node, chunk = self.spillable.pop()
                if (node.id, id(chunk)) not in self.claimed:
                    self.claimed[(node.id, id(chunk))] = chunk
                    return node, chunk
        return None

    def take(self, rank: int, node: Node, chunk: Batch) -> None:
        """Run a `spill_to` forward on a generation rank (it holds the same weights as `node`'s group)."""
        t0 = time.perf_counter()
        out = self.run_on_generation_rank(rank, node, chunk)
        with self.lock:
            self.taken += 1
        self.results.output(node, out, chunk["sample"], t0, rank)

    # -- the other group's thread -----------------------------------------------------------------------------
    def _queue(self, jobs: queue.SimpleQueue[Feed | None], node: Node, chunk: Batch) -> None:
        if node.id in self.spills:
            with self.lock:
                self.spillable.append((node, chunk))
        jobs.put(Finished(node, chunk))

    def _claim(self, node: Node, chunks: Sequence[Batch]) -> list[Batch]:
        """The chunks of `node` nobody took yet, now taken by its group (each runs exactly once)."""
        if node.id not in self.spills:
            return list(chunks)
        with self.lock:
            mine = [c for c in chunks if (node.id, id(c)) not in self.claimed]
            self.claimed.update(((node.id, id(c)), c) for c in mine)
        return mine

    def _loop(self, jobs: queue.SimpleQueue[Feed | None]) -> None:
        """Run one other group's forwards as items are queued; of samples still decoding, only their latest
        tokens count. After an error, only drain."""
        failed: BaseException | None = None
        more = True
        while more:
            items, more = _drain(jobs)
            work: dict[str, _Work] = {}
            for item in items:
                work.setdefault(item.node.id, _Work(item.node)).add(item)
            for w in work.values():
                if failed is None:
                    try:
                        if chunks := self._claim(w.node, w.chunks):
                            self._forward(w.node, concat(chunks))
                        if w.finals or w.live:
                            self._score_growing(w)
                    except BaseException as e:  # re-raised when the stage joins this thread
                        failed = e
        if failed is not None:
            raise failed

    def _forward(self, node: Node, chunk: Batch) -> None:
        """Run `node` on finished samples on its own worker group (its ranks share them)."""
        t0 = time.perf_counter()
        out = self.other[str(node.worker_group)].call(node.op, node.model, chunk, dict(node.attrs),
                                                      dispatch=node.dispatch).result()
        self.results.output(node, out, chunk["sample"], t0, ELSEWHERE)

    def _score_growing(self, w: _Work) -> None:
        """One call per rank of `w.node`'s group: bring the live samples up to date, score the finished ones."""
        finals = concat(w.finals) if w.finals else None
        done = set(finals["sample"].tolist()) if finals is not None else set()
        live = [growing_rows(b.select(rows), False) for b, rows in w.latest(done)]
        rows = concat(([growing_rows(finals, True)] if finals is not None else []) + live)
        group = self.other[str(w.node.worker_group)]
        args: tuple[Any, ...] = (w.node.model, w.node.op, rows, dict(w.node.attrs))
        kwargs = dict(node=w.node.id, stage=self.stage)
        t0 = time.perf_counter()
        if group.world == 1:
            out = group.call("score_growing", *args, dispatch="rank0", **kwargs).result()
        else:  # a sample's state lives on rank sample % world; finals come first in `rows`, so in order
            owner = rows["sample"] % group.world
            parts = [(mine, group.on_rank(r, "score_growing", w.node.model, w.node.op, rows.select(mine),
                                          dict(w.node.attrs), **kwargs))
                     for r in range(group.world) if len(mine := (owner == r).nonzero().squeeze(1))]
            out = merge_rows([(m[rows["final"][m].bool()], o) for m, o in parts], len(done))
        if finals is None:
            self.results.timed(w.node.id, ELSEWHERE, t0)
            return
        field = OUTPUT[str(w.node.op)]
        out = out[:, : finals["response_ids"].shape[1]] if out.dim() == 2 else out
        self.results.output(w.node, finals.derive(field, **{field: out}), finals["sample"], t0, ELSEWHERE)
