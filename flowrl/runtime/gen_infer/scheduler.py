"""`GenInfer` (flowrl.runtime.gen_infer): who runs what, when, in one step's fused generation stage.

The controller (`flowrl.runtime.fusion`) runs a fused stage (a generate node plus the forwards over its rollout)
as `GenInfer(...).run()`. Each generation rank runs `ModelWorker.generate_stream`, which yields chunks of
finished samples; the forwards run on each chunk while the rest is still decoding, and every result is put back
in sample order at the end (`Results.finish`), so downstream nodes see the numbers the unfused step computes.
Forwards placed on another worker group are the `Feeder`'s (flowrl.runtime.gen_infer.feeder).

- One inline rank (the local backend's group beside a group elsewhere, or beside rewards scored by workers):
  generation and its own group's chunk forwards interleave on this thread.
- Several ranks (any group with `per_rank`: threads, process and Ray ranks): each rank is driven by a thread
  here. With `chunk_forwards = "own-rank"` (the pass's default) a rank runs the forwards on its own chunks
  between decode steps, where its prompts are cached; with "free-rank" finished chunks queue up and a rank whose
  generation is over takes forwards from the queue. When fewer than `migrate_below` of the samples are still
  decoding and forwards are queued, every rank hands its unfinished rows over (`Tail`) and they resume together
  on the fewest ranks that hold them (those with the most rows), so the other ranks are freed for the queued
  forwards (RLHFuse). Sampling state moves with the rows: same samples.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from flowrl.engines.chunked_generation import Tail
from flowrl.ir.attrs import GenerateAttrs
from flowrl.ir.graph import Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import ChunkForward, Growing, Scored
from flowrl.runtime.dispatch import rank_seed
from flowrl.runtime.gen_infer.feeder import Feeder
from flowrl.runtime.gen_infer.records import (
    ChunkReady,
    Event,
    Failed,
    Forward,
    Job,
    JobDone,
    Stream,
    StreamEnded,
    TailReady,
    Take,
)
from flowrl.runtime.gen_infer.results import Results
from flowrl.runtime.protocol import WorkerGroup
from flowrl.runtime.schedule import THREADS


class Migration:
    """RLHFuse's trigger: the ranks' unfinished rows, and which ranks were asked to hand theirs over."""

    def __init__(self, total: int, below: float, own_rank: bool):
        self.total, self.below, self.own_rank = total, below, own_rank
        self.lock = threading.Lock()
        self.remaining: dict[int, int] = {}
        self.exporting: set[int] = set()
        self.triggered = False
        self.queued = 0  # forwards waiting for a rank that is not generating

    def progress(self, rank: int, remaining: int) -> None:
        """Called by rank threads each decode step; fires the migration once."""
        with self.lock:
            self.remaining[rank] = remaining
            left = sum(self.remaining.values())
            # Migrating frees ranks for the forwards. With free-rank scoring they wait for exactly that; when each
            # rank scores its own chunks, only forwards still queued would gain, else the tail stays put.
            worth_it = not self.own_rank or self.queued > 0
            if not self.triggered and worth_it and 0 < left < self.below * self.total:
                self.triggered = True
                self.exporting = {r for r, k in self.remaining.items() if k > 0}

    def asked(self, rank: int) -> bool:
        with self.lock:
            return rank in self.exporting


class _Control:
    """Per-rank StreamControl: progress in, the export request out."""

    def __init__(self, migration: Migration, rank: int, migratable: bool):
        self.migration, self.rank, self.migratable = migration, rank, migratable

    def progress(self, remaining: int) -> None:
        if self.migratable:
            self.migration.progress(self.rank, remaining)

    def should_export(self) -> bool:
        return self.migratable and self.migration.asked(self.rank)


class GenInfer:
    """One step's fused generation + forwards over a group's ranks (see the module docstring)."""

    def __init__(self, ranks: WorkerGroup, gen: Node, forwards: Sequence[Node], prompts: Batch, step_seed: int,
                 other: Mapping[str, WorkerGroup], on_chunk: Callable[[Batch], None] | None = None):
        self.ranks, self.gen, self.forwards, self.prompts = ranks, gen, list(forwards), prompts
        self.step_seed = step_seed
        self.attrs = dict(gen.attrs)  # what the generation ranks get (score-tail's key switched off below)
        self.a = GenerateAttrs.of(gen.attrs)
        self.n = self.a.n
        self.total = prompts.size * self.n
        self.results = Results(self.forwards, prompts, on_chunk)
        self.feeder = Feeder(gen, self.forwards, other, self.results, self._on_generation_rank,
                             self.a.partial_below)
        if not self.feeder.grows:
            self.attrs["partial_below"] = 0  # nobody scores samples while they decode: the stream sends none
        self.here = [f for f in self.forwards if f.worker_group not in other]  # forwards on the generation group
        self.migration = Migration(self.total, self.a.migrate_below, own_rank=bool(self._inline()))
        self.migrated = 0
        self.inlined = 0  # chunks whose forwards their own rank ran

    def run(self) -> tuple[Batch, dict[str, Batch], dict[str, float]]:
        start = time.perf_counter()
        stop = self.feeder.start()
        try:
            if self.ranks.inline:  # a generator on this thread: pulled between forwards
                self._run_inline()
            else:
                self._run_threads()
        finally:
            stop()  # re-raises a failed forward of another group
        counters = {"fusion/migrated": float(self.migrated), "fusion/inline_chunks": float(self.inlined),
                    "fusion/grown": float(len(self.feeder.grown)), "fusion/taken": float(self.feeder.taken),
                    "fusion/partials": float(self.feeder.partials)}
        return self.results.finish(start, self.ranks.world, counters)

    # -- one inline rank ----------------------------------------------------------------------------------------
    def _run_inline(self) -> None:
        """Each chunk's forwards run as soon as it arrives, then decoding resumes."""
        stream = self.ranks.on_rank(0, "generate_stream", self.gen.model, self.prompts, self.attrs,
                                    step_seed=self.step_seed)
        t0 = time.perf_counter()
        for batch in stream:
            self.results.timed("generate", 0, t0)
            if isinstance(batch, Growing):
                self.feeder.live(batch.batch)
                t0 = time.perf_counter()
                continue
            cid = self._add(batch)
            for node in self.here:
                self._forward(0, cid, node)
            t0 = time.perf_counter()
        while (job := self.feeder.spill()) is not None:
            self.feeder.take(0, *job)

    # -- a thread per rank ---------------------------------------------------------------------------------------
    def _run_threads(self) -> None:
        events: queue.Queue[Event] = queue.Queue()
        jobs: list[queue.Queue[Job | None]] = [queue.Queue() for _ in range(self.ranks.world)]
        join = THREADS.start([partial(self._rank_loop, r, jobs[r], events) for r in range(self.ranks.world)])
        try:
            self._schedule(jobs, events)
        finally:
            for q in jobs:
                q.put(None)
            join()

    def _schedule(self, jobs: list[queue.Queue[Job | None]], events: queue.Queue[Event]) -> None:
        shards = self.prompts.split(self.ranks.world)
        offsets = [sum(s.size for s in shards[:i]) for i in range(len(shards))]
        capacity = math.ceil(self.total / max(1, len(shards)))
        generating: set[int] = set()
        for r, (shard, first) in enumerate(zip(shards, offsets, strict=True)):
            self.migration.remaining[r] = shard.size * self.n
            generating.add(r)
            control = _Control(self.migration, r, True) if len(shards) > 1 else None  # 1: no tail to move
            jobs[r].put(Stream("generate_stream", (self.gen.model, shard, self.attrs),
                               dict(step_seed=rank_seed(self.step_seed, r), first_prompt=first, control=control,
                                    inline=self._inline())))
        busy = set(generating)
        pending: deque[tuple[int, Node]] = deque()
        tails: dict[int, Tail] = {}
        held: set[int] = set()  # ranks asked to export, kept idle until every tail is in
        while generating or pending or busy:
            event = events.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, ChunkReady):
                item = event.item
                cid = self._add(item.batch if isinstance(item, Scored) else item)
                done = self.results.scored(event.rank, cid, item) if isinstance(item, Scored) else set()
                pending.extend((cid, node) for node in self.here if node.id not in done)
                self.inlined += bool(done)
            elif isinstance(event, TailReady):
                tails[event.rank] = event.tail
            else:  # StreamEnded or JobDone
                busy.discard(event.rank)
                if isinstance(event, StreamEnded):
                    generating.discard(event.rank)
                    if self.migration.asked(event.rank):
                        held.add(event.rank)
            with self.migration.lock:
                exporting = set(self.migration.exporting)
            if exporting and held >= exporting:
                for dest, group in self._destinations(tails, capacity).items():
                    jobs[dest].put(Stream("resume_stream", (self.gen.model, group, self.attrs),
                                          dict(control=_Control(self.migration, dest, False))))
                    generating.add(dest)
                    busy.add(dest)
                with self.migration.lock:
                    self.migration.exporting = set()
                held, tails = set(), {}
            for r in range(self.ranks.world):
                if r in busy or r in held:
                    continue
                if pending:
                    cid, node = pending.popleft()
                    busy.add(r)
                    jobs[r].put(Forward(cid, node))
                elif r not in generating and (job := self.feeder.spill()) is not None:
                    busy.add(r)
                    jobs[r].put(Take(*job))
            with self.migration.lock:
                self.migration.queued = len(pending)

    def _rank_loop(self, rank: int, jobs: queue.Queue[Job | None], events: queue.Queue[Event]) -> None:
        while (job := jobs.get()) is not None:
            try:
                if isinstance(job, Stream):
                    t0 = time.perf_counter()
                    for item in self.ranks.on_rank(rank, job.method, *job.args, **job.kwargs):
                        self.results.timed("generate", rank, t0)
                        if isinstance(item, Growing):  # queued here, before this rank's later chunks
                            self.feeder.live(item.batch)
                        elif isinstance(item, Tail):
                            events.put(TailReady(rank, item))
                        else:
                            events.put(ChunkReady(rank, item))
                        t0 = time.perf_counter()
                    with self.migration.lock:  # before the event: a later trigger must not count these rows
                        self.migration.remaining[rank] = 0
                    events.put(StreamEnded(rank))
                elif isinstance(job, Take):
                    self.feeder.take(rank, job.node, job.chunk)
                    events.put(JobDone(rank))
                else:
                    self._forward(rank, job.cid, job.node)
                    events.put(JobDone(rank))
            except BaseException as e:  # surfaced by the scheduler, which then stops every rank
                events.put(Failed(rank, e))

    # -- pieces ----------------------------------------------------------------------------------------------------
    def _add(self, batch: Batch) -> int:
        cid = self.results.add_chunk(batch)
        self.feeder.chunk(self.results.chunk(cid))
        return cid

    def _inline(self) -> list[ChunkForward]:
        """The forwards each generating rank runs on its own chunks between its decode steps ("own-rank", the
        pass's default): the prompts are in its cache and no chunk waits for a free rank. "free-rank" leaves
        every chunk to ranks that are not generating (RLHFuse's split). Migrated tails' chunks go to free ranks."""
        if self.a.chunk_forwards != "own-rank":
            return []
        return [ChunkForward(f.id, str(f.op), str(f.model), dict(f.attrs)) for f in self.here]

    def _destinations(self, tails: Mapping[int, Tail], capacity: int) -> dict[int, list[Tail]]:
        """The fewest ranks that hold every unfinished row; the ranks with the most rows keep theirs."""
        if not tails:
            return {}
        rows = sum(len(t.samples) for t in tails.values())
        order = sorted(tails, key=lambda r: (-len(tails[r].samples), r))
        dests = order[: max(1, math.ceil(rows / max(capacity, 1)))]
        out: dict[int, list[Tail]] = {d: [] for d in dests}
        load = dict.fromkeys(dests, 0)
        for r in order:
            dest = r if r in out else min(dests, key=lambda d: (load[d], d))
            out[dest].append(tails[r])
            load[dest] += len(tails[r].samples)
            if dest != r:
                self.migrated += len(tails[r].samples)
        return out

    def _forward(self, rank: int, cid: int, node: Node) -> None:
        """Run `node` on chunk `cid` on a generation rank."""
        chunk = self.results.chunk(cid)
        t0 = time.perf_counter()
        out = self.ranks.on_rank(rank, node.op, node.model, chunk, dict(node.attrs))
        self.results.output(node, out, chunk["sample"], t0, rank)

    def _on_generation_rank(self, rank: int, node: Node, chunk: Batch) -> Batch:
        out: Batch = self.ranks.on_rank(rank, node.op, node.model, chunk, dict(node.attrs))
        return out
