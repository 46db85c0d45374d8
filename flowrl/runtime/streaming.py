"""`fuse-gen-inference` at run time (flowrl.runtime): the controller-side scheduler of streamed generation.

The controller (`flowrl.runtime.fusion`) runs a fused stage (a generate node plus the forwards over its
rollout) as `GenInfer(...).run()`. Each generation rank runs `ModelWorker.generate_stream`, which yields chunks
of finished samples; the forwards run on each chunk while the rest is still decoding, and every result is put
back in sample order at the end (`assemble`), so downstream nodes see the numbers the unfused step computes.
What a chunk is and how chunks merge lives in `flowrl.runtime.chunks`; this module decides who runs what, when.

- One in-process rank (`_OneRank`, a local group beside a group elsewhere; a stage whose groups are all local
  runs unfused, see `flowrl.runtime.fusion`): generation and its own group's chunk forwards interleave there.
- Several ranks (any `RankGroup`: `world` and `on_rank(rank, method, ...)`, as `flowrl.runtime.ranks` (threads)
  and `flowrl.runtime.procs` (processes) provide; a Ray group can too): each rank is driven by a thread here.
  With `chunk_forwards = "own-rank"` (the pass's default) a rank runs the forwards on its own chunks between
  decode steps, where its prompts are cached; with "free-rank" finished chunks queue up and a rank whose
  generation is over takes forwards from the queue. When fewer than `migrate_below` of the samples are still
  decoding and forwards are queued, every rank hands its unfinished rows over (`Tail`) and they resume
  together on the fewest ranks that hold them (those with the most rows), so the other ranks are freed for
  the queued forwards (RLHFuse). Sampling state moves with the rows: same samples.

Forwards placed on another worker group (a `placement { }` that puts the reference, critic or reward model on
their own pool) do not wait for a generation rank: each chunk is sent to that group as soon as it arrives, one
call at a time per group from a thread of its own, so those forwards run on their ranks while generation is
still decoding on its own (RLHFuse's overlap across groups; unfused, that group idles until generation ends).
With `partial_below` on the generate node, once at most that fraction of a rank's samples is still decoding,
the rank also hands over the unfinished samples' responses so far (`Growing`) every `flush_steps`; the other
group scores their tokens as they come (`ModelWorker.score_growing`, keeping each sample's KV cache) and only
the last tokens remain when a tail sample finishes, so the tail's own forwards run under its decoding too.
A forward of the generating model placed elsewhere (`spill_to` = the generation group: the policy's old
log-probs on the train pool) may also be taken by a generation rank once its own generation is over: chunks
still queued for it go to whichever side is free first (`_claim`), as RLHFuse hands freed generation workers
the inference of the tail. Both sides hold the same weights during the stage (synced after every update).
"""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from flowrl.engines.streaming import Tail
from flowrl.ir.graph import Node
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import (
    OUTPUT,
    ChunkForward,
    Growing,
    Scored,
    assemble,
    concat,
    growing_rows,
    merge_rows,
    partial_of,
    rank_seed,
)
from flowrl.runtime.protocol import WorkerGroup
from flowrl.runtime.schedule import THREADS

ELSEWHERE = -1  # the `Timed.rank` of forwards run by another worker group


def _drain(jobs: queue.SimpleQueue[Any]) -> tuple[list[Any], bool]:
    """Wait for one job, then take every job already queued; False once the end (None) was taken."""
    out: list[Any] = []
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

    def add(self, kind: str, batch: Batch) -> None:
        {"chunk": self.chunks, "final": self.finals, "live": self.live}[kind].append(batch)

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


@dataclass
class Timed:
    """One piece of work of the stage: which rank ran it and when (seconds, perf_counter)."""

    what: str
    rank: int
    start: float
    end: float


class _Control:
    """Per-rank StreamControl: progress in, the export request out (thread-safe through the scheduler)."""

    def __init__(self, sched: GenInfer, rank: int, migratable: bool):
        self.sched, self.rank, self.migratable = sched, rank, migratable

    def progress(self, remaining: int) -> None:
        if self.migratable:
            self.sched.progress(self.rank, remaining)

    def should_export(self) -> bool:
        return self.migratable and self.rank in self.sched.exporting


class GenInfer:
    """One step's fused generation + forwards over a RankGroup (see the module docstring)."""

    def __init__(self, ranks: WorkerGroup, gen: Node, forwards: Sequence[Node], prompts: Batch, step_seed: int,
                 other: Mapping[str, WorkerGroup], on_chunk: Callable[[Batch], None] | None = None):
        self.ranks, self.gen, self.forwards, self.prompts = ranks, gen, list(forwards), prompts
        self.step_seed, self.other = step_seed, other  # other: worker groups of forwards placed elsewhere
        self.on_chunk = on_chunk  # called with each chunk of finished samples (rewards scored beside generation)
        self.attrs = dict(gen.attrs)
        self.n = int(str(self.attrs.get("n", 1)))
        self.total = prompts.size * self.n
        self.chunks: list[Batch] = []
        # node id -> (first chunk, output, its rows' sample numbers): one entry per forward call
        self.results: dict[str, list[tuple[int, Batch, torch.Tensor]]] = {f.id: [] for f in self.forwards}
        self.timeline: list[Timed] = []
        self.arrivals: list[float] = []
        self.migrated = 0
        self.lock = threading.Lock()
        self.remaining: dict[int, int] = {}
        self.exporting: set[int] = set()
        self.triggered = False
        self.queued = 0  # forwards waiting for a rank that is not generating
        self.own_rank = bool(self._inline())  # generating ranks score their own chunks
        self.inlined = 0  # chunks whose forwards their own rank ran
        # One queue of (kind, forward, batch) per other group, drained in order by a thread of its own; kind is
        # "chunk" (finished samples), "live" (a `Growing` batch) or "final" (finished samples that went out live).
        self.elsewhere: dict[str, queue.SimpleQueue[tuple[str, Node, Batch] | None]] = {
            name: queue.SimpleQueue() for name in other}
        # Groups that score samples while they decode: the stage asks for it (partial_below) and each sample's
        # state can stay on one rank (one rank, or ranks callable one by one).
        self.grows = {name for name, g in other.items() if g.world == 1 or g.per_rank}
        if partial_of(self.attrs) <= 0 or not self.grows:
            self.grows, self.attrs["partial_below"] = set(), 0
        self.grown: set[int] = set()  # samples that went out while decoding
        # Forwards a generation rank may take once its generation is over (`spill_to`, see the module docstring):
        # their queued chunks, newest last, and the chunks either side has claimed, by (node, id(chunk)): a chunk is
        # held by `spillable` until claimed, then by `claimed`, so its id() names it for the whole stage.
        self.spills = {f.id for f in self.forwards
                       if f.worker_group in self.other and f.attrs.get("spill_to") == gen.worker_group}
        self.spillable: deque[tuple[Node, Batch]] = deque()
        self.claimed: dict[tuple[str, int], Batch] = {}
        self.taken = 0  # chunk forwards a generation rank took
        self.partials = 0
        self.stage = uuid.uuid4().hex  # keys the other groups' state of this stage's growing samples

    # -- the two drivers -------------------------------------------------------------------------------
    def run(self) -> tuple[Batch, dict[str, Batch], dict[str, float]]:
        start = time.perf_counter()
        join = THREADS.start([partial(self._elsewhere_loop, q) for q in self.elsewhere.values()])
        try:
            if self.ranks.inline:  # a generator on this thread: pulled between forwards
                self._run_inline()
            else:
                self._run_threads()
        finally:
            for q in self.elsewhere.values():
                q.put(None)
            join()  # re-raises a failed forward of another group
        return self._finish(start)

    def _run_inline(self) -> None:
        """One rank: each chunk's forwards run as soon as it arrives, then decoding resumes."""
        stream = self.ranks.on_rank(0, "generate_stream", self.gen.model, self.prompts, self.attrs,
                                    step_seed=self.step_seed)
        t0 = time.perf_counter()
        for batch in stream:
            self.timeline.append(Timed("generate", 0, t0, time.perf_counter()))
            if isinstance(batch, Growing):
                self._grow(batch.batch)
                t0 = time.perf_counter()
                continue
            cid = self._add_chunk(batch)
            for node in self._here(cid):
                self._forward(0, cid, node)
            t0 = time.perf_counter()
        while (job := self._spill()) is not None:
            self._take(0, *job)

    def _run_threads(self) -> None:
        events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        jobs: list[queue.Queue[Any]] = [queue.Queue() for _ in range(self.ranks.world)]
        join = THREADS.start([partial(self._rank_loop, r, jobs[r], events) for r in range(self.ranks.world)])
        try:
            self._schedule(jobs, events)
        finally:
            for q in jobs:
                q.put(None)
            join()

    def _schedule(self, jobs: list[queue.Queue[Any]], events: queue.Queue[tuple[Any, ...]]) -> None:
        shards = self.prompts.split(self.ranks.world)
        offsets = [sum(s.size for s in shards[:i]) for i in range(len(shards))]
        capacity = math.ceil(self.total / max(1, len(shards)))
        generating: set[int] = set()
        for r, (shard, first) in enumerate(zip(shards, offsets, strict=True)):
            self.remaining[r] = shard.size * self.n
            generating.add(r)
            jobs[r].put(("stream", "generate_stream", (self.gen.model, shard, self.attrs),
                         dict(step_seed=rank_seed(self.step_seed, r), first_prompt=first,
                              control=_Control(self, r, True) if len(shards) > 1 else None,  # 1: no tail to move
                              inline=self._inline())))
        busy = set(generating)
        pending: deque[tuple[int, Node]] = deque()
        tails: dict[int, Tail] = {}
        held: set[int] = set()  # ranks asked to export, kept idle until every tail is in
        while generating or pending or busy:
            kind, rank, *payload = events.get()
            if kind == "error":
                raise payload[0]
            if kind == "chunk":
                item = payload[0]
                cid = self._add_chunk(item.batch if isinstance(item, Scored) else item)
                done = self._record_scored(rank, cid, item) if isinstance(item, Scored) else set()
                pending.extend((cid, node) for node in self._here(cid) if node.id not in done)
                self.inlined += bool(done)
            elif kind == "tail":
                tails[rank] = payload[0]
            elif kind in ("stream_end", "done"):
                busy.discard(rank)
                if kind == "stream_end":
                    generating.discard(rank)
                    if rank in self.exporting:
                        held.add(rank)
            if self.exporting and held >= self.exporting:
                for dest, group in self._destinations(tails, capacity).items():
                    jobs[dest].put(("stream", "resume_stream", (self.gen.model, group, self.attrs),
                                    dict(control=_Control(self, dest, False))))
                    generating.add(dest)
                    busy.add(dest)
                self.exporting, held, tails = set(), set(), {}
            for r in range(self.ranks.world):
                if r in busy or r in held:
                    continue
                if pending:
                    cid, node = pending.popleft()
                    busy.add(r)
                    jobs[r].put(("forward", cid, node))
                elif r not in generating and (job := self._spill()) is not None:
                    busy.add(r)
                    jobs[r].put(("take", *job))
            with self.lock:
                self.queued = len(pending)

    def _rank_loop(self, rank: int, jobs: queue.Queue[Any], events: queue.Queue[tuple[Any, ...]]) -> None:
        while (job := jobs.get()) is not None:
            try:
                if job[0] == "stream":
                    _, method, args, kwargs = job
                    t0 = time.perf_counter()
                    for item in self.ranks.on_rank(rank, method, *args, **kwargs):
                        now = time.perf_counter()
                        self.timeline.append(Timed("generate", rank, t0, now))
                        if isinstance(item, Growing):  # queued here, before this rank's later chunks
                            self._grow(item.batch)
                        else:
                            events.put(("tail" if isinstance(item, Tail) else "chunk", rank, item))
                        t0 = time.perf_counter()
                    with self.lock:  # before the event: a later trigger must not count these rows
                        self.remaining[rank] = 0
                    events.put(("stream_end", rank))
                elif job[0] == "take":
                    self._take(rank, job[1], job[2])
                    events.put(("done", rank))
                else:
                    self._forward(rank, job[1], job[2])
                    events.put(("done", rank))
            except BaseException as e:  # surfaced by the scheduler, which then stops every rank
                events.put(("error", rank, e))

    def _elsewhere_loop(self, jobs: queue.SimpleQueue[tuple[str, Node, Batch] | None]) -> None:
        """Run one other group's forwards as chunks are queued. Chunks that queued up while the group was busy
        run together, one call per forward: the group never waits on a chunk, and the fewer, larger calls
        cost less than one per chunk; of samples still decoding, only their latest tokens count. After an
        error, only drain."""
        failed: BaseException | None = None
        more = True
        while more:
            batch, more = _drain(jobs)
            work: dict[str, _Work] = {}
            for kind, node, part in batch:
                work.setdefault(node.id, _Work(node)).add(kind, part)
            for w in work.values():
                if failed is None:
                    try:
                        if chunks := self._claim(w.node, w.chunks):
                            self._forward_elsewhere(w.node, concat(chunks))
                        if w.finals or w.live:
                            self._score_growing(w)
                    except BaseException as e:  # re-raised when the stage joins this thread
                        failed = e
        if failed is not None:
            raise failed

    # -- pieces --------------------------------------------------------------------------------------
    def _here(self, cid: int) -> list[Node]:
        """Chunk `cid`'s forwards that run on the generation group; those of other groups are queued for them
        (its samples that went out while decoding as "final": the group holds their state)."""
        chunk = self.chunks[cid]
        with self.lock:
            grown = torch.tensor([s in self.grown for s in chunk["sample"].tolist()], dtype=torch.bool)
        for node in self.forwards:
            if node.worker_group not in self.elsewhere:
                continue
            jobs = self.elsewhere[node.worker_group]
            if node.worker_group not in self.grows or not grown.any():
                self._queue(jobs, node, chunk)
                continue
            if not grown.all():
                self._queue(jobs, node, chunk.select((~grown).nonzero().squeeze(1)))
            jobs.put(("final", node, chunk.select(grown.nonzero().squeeze(1))))
        return [node for node in self.forwards if node.worker_group not in self.elsewhere]

    def _queue(self, jobs: queue.SimpleQueue[tuple[str, Node, Batch] | None], node: Node, chunk: Batch) -> None:
        """Queue finished samples for `node`'s group (and, for a `spill_to` forward, for a free generation rank)."""
        if node.id in self.spills:
            with self.lock:
                self.spillable.append((node, chunk))
        jobs.put(("chunk", node, chunk))

    def _claim(self, node: Node, chunks: Sequence[Batch]) -> list[Batch]:
        """The chunks of `node` nobody took yet, now taken by the caller (a `spill_to` forward's chunks can be
        taken by its group or by a free generation rank: each runs exactly once)."""
        if node.id not in self.spills:
            return list(chunks)
        with self.lock:
            mine = [c for c in chunks if (node.id, id(c)) not in self.claimed]
            self.claimed.update(((node.id, id(c)), c) for c in mine)
        return mine

    def _spill(self) -> tuple[Node, Batch] | None:
        """The newest queued chunk of a `spill_to` forward nobody took yet, claimed for a generation rank (the
        other group works through its queue oldest first)."""
        with self.lock:
            while self.spillable:
                node, chunk = self.spillable.pop()
                if (node.id, id(chunk)) not in self.claimed:
                    self.claimed[(node.id, id(chunk))] = chunk
                    return node, chunk
        return None

    def _take(self, rank: int, node: Node, chunk: Batch) -> None:
        """Run a `spill_to` forward on a generation rank (it holds the same weights as `node`'s group)."""
        t0 = time.perf_counter()
        out = self.ranks.on_rank(rank, node.op, node.model, chunk, dict(node.attrs))
        with self.lock:
            self.taken += 1
        self._result(node, out, chunk["sample"], t0, rank)

    def _grow(self, live: Batch) -> None:
        """Queue unfinished samples' responses so far for the groups that score them while they decode."""
        with self.lock:
            self.grown.update(live["sample"].tolist())
            self.partials += 1
        for node in self.forwards:
            if node.worker_group in self.grows:
                self.elsewhere[node.worker_group].put(("live", node, live))

    def _inline(self) -> list[ChunkForward]:
        """The forwards each generating rank runs on its own chunks between its decode steps ("own-rank", the
        pass's default): the prompts are in its cache and no chunk waits for a free rank. "free-rank" leaves
        every chunk to ranks that are not generating (RLHFuse's split). Migrated tails' chunks go to free ranks."""
        if str(self.attrs.get("chunk_forwards", "own-rank")) != "own-rank":
            return []
        return [ChunkForward(f.id, str(f.op), str(f.model), dict(f.attrs)) for f in self.forwards
                if f.worker_group not in self.other]

    def _record_scored(self, rank: int, cid: int, item: Scored) -> set[str]:
        now = time.perf_counter()
        with self.lock:
            meta = self.chunks[cid].meta  # the rank scored the chunk before its prompt fields were added
            for node_id, (out, secs) in item.outs.items():
                self.results[node_id].append((cid, Batch(out.size, out.tensors, meta, out.primary),
                                              self.chunks[cid]["sample"]))
                self.timeline.append(Timed(node_id, rank, now - secs, now))
        return set(item.outs)

    def progress(self, rank: int, remaining: int) -> None:
        """Called by rank threads each decode step; fires the migration once (RLHFuse's trigger)."""
        with self.lock:
            self.remaining[rank] = remaining
            left = sum(self.remaining.values())
            # Migrating frees ranks for the forwards. With free-rank scoring they wait for exactly that; when each
            # rank scores its own chunks, only forwards still queued would gain, else the tail stays put.
            worth_it = not self.own_rank or self.queued > 0
            if not self.triggered and worth_it and \
                    0 < left < float(str(self.attrs.get("migrate_below", 0.2))) * self.total:
                self.triggered = True
                self.exporting = {r for r, k in self.remaining.items() if k > 0}

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

    def _add_chunk(self, batch: Batch) -> int:
        """Record a chunk, with the prompt fields `generate` gives its rows (by global prompt index)."""
        groups = batch["group_id"].tolist()
        meta = {k: [v[g] for g in groups] for k, v in self.prompts.meta.items()}
        meta["response"] = batch.meta["response"]
        chunk = Batch(batch.size, batch.tensors, meta, batch.primary)
        with self.lock:
            self.chunks.append(chunk)
            self.arrivals.append(time.perf_counter())
            cid = len(self.chunks) - 1
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        return cid

    def _forward(self, rank: int, cid: int, node: Node) -> None:
        """Run `node` on chunk `cid` on a generation rank."""
        chunk = self.chunks[cid]
        t0 = time.perf_counter()
        out = self.ranks.on_rank(rank, node.op, node.model, chunk, dict(node.attrs))
        self._result(node, out, chunk["sample"], t0, rank)

    def _forward_elsewhere(self, node: Node, chunk: Batch) -> None:
        """Run `node` on finished samples on its own worker group (its ranks share them)."""
        t0 = time.perf_counter()
        out = self.other[node.worker_group].call(node.op, node.model, chunk, dict(node.attrs),
                                                 dispatch=node.dispatch).result()
        self._result(node, out, chunk["sample"], t0, ELSEWHERE)

    def _score_growing(self, w: _Work) -> None:
        """One call per rank of `w.node`'s group: bring the live samples up to date, score the finished ones."""
        finals = concat(w.finals) if w.finals else None
        done = set(finals["sample"].tolist()) if finals is not None else set()
        live = [growing_rows(b.select(rows), False) for b, rows in w.latest(done)]
        rows = concat(([growing_rows(finals, True)] if finals is not None else []) + live)
        group = self.other[str(w.node.worker_group)]
        world = group.world
        args = (w.node.model, w.node.op, rows, dict(w.node.attrs))
        kwargs = dict(node=w.node.id, stage=self.stage)
        t0 = time.perf_counter()
        if world == 1:
            out = group.call("score_growing", *args, dispatch="rank0", **kwargs).result()
        else:  # a sample's state lives on rank sample % world; finals come first in `rows`, so in order
            owner = rows["sample"] % world
            parts = [(mine, group.on_rank(r, "score_growing", w.node.model, w.node.op, rows.select(mine),
                                          dict(w.node.attrs), **kwargs))
                     for r in range(world) if len(mine := (owner == r).nonzero().squeeze(1))]
            out = merge_rows([(m[rows["final"][m].bool()], o) for m, o in parts], len(done))
        if finals is None:
            with self.lock:
                self.timeline.append(Timed(w.node.id, ELSEWHERE, t0, time.perf_counter()))
            return
        field = OUTPUT[str(w.node.op)]
        out = out[:, : finals["response_ids"].shape[1]] if out.dim() == 2 else out
        self._result(w.node, finals.derive(field, **{field: out}), finals["sample"], t0, ELSEWHERE)

    def _result(self, node: Node, out: Batch, samples: torch.Tensor, t0: float, rank: int) -> None:
        with self.lock:
            self.results[node.id].append((len(self.results[node.id]), out, samples))
            self.timeline.append(Timed(node.id, rank, t0, time.perf_counter()))

    def _finish(self, start: float) -> tuple[Batch, dict[str, Batch], dict[str, float]]:
        samples = [c["sample"] for c in self.chunks]
        rollout = assemble(self.chunks, samples)
        outs = {}
        for node_id, parts in self.results.items():
            parts.sort(key=lambda p: p[0])
            outs[node_id] = assemble([b for _, b, _ in parts], [rows for _, _, rows in parts])
        gen_end = max(self.arrivals)
        infer = [t for t in self.timeline if t.what != "generate"]
        busy = sum(t.end - t.start for t in infer)
        overlap = sum(max(0.0, min(t.end, gen_end) - t.start) for t in infer)
        metrics = {"fusion/chunks": float(len(self.chunks)), "fusion/migrated": float(self.migrated),
                   "fusion/inline_chunks": float(self.inlined), "fusion/grown": float(len(self.grown)),
                   "fusion/taken": float(self.taken),
                   "fusion/partials": float(self.partials),
                   "fusion/workers": float(self.ranks.world), "fusion/gen_s": gen_end - start,
                   "fusion/infer_s": busy, "fusion/overlap_s": overlap,
                   "fusion/overlap_frac": overlap / busy if busy > 0 else 0.0}
        return rollout, outs, metrics
