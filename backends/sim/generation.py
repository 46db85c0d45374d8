"""Generation on simulated instances (flowrl.backends.sim): a discrete-event simulation of continuous batching.

Each instance holds up to `slots` sequences at once; queued ones enter as others finish. Between two events an
instance's batch is fixed, so every decode iteration costs the same (`CostModel.decode_iter` at the batch and its
KV context at the segment's start) and the clock jumps straight to the next event: the next sequence to finish,
or sequences migrated to it arriving. Admitting sequences costs their prefill (a prompt once per instance: its
samples share it, as share-prefix and vLLM's prefix cache do), and each instance's call starts with the fixed
`gen_call_s` and `row_s` per sample. An instance releases its devices when it has
nothing left; a migration *sink* (`sinks`) not before each of its sources has released (it waits for every
source's word, as the serverless backend's sink does). A policy hook runs after every finish and may move an
instance's unfinished sequences elsewhere (`Gen.migrate`): they keep their progress and KV cache, which crosses
the link first.

A deduplicated prefill (`prefixes`, one `PrefixPart` an instance): after its call's setup an instance computes
the shared prompt prefixes it owns, then takes the others' from their owners once they are computed and have
crossed the link (or, past its patience, computes them itself); its prompts prefill only what follows their
prefix (`Seq.skip`). Each instance's prefill statistics come back in `GenResult.prefill`, in the serverless
instances' terms, for the policy to learn from.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.shapes import ModelShape

EPS = 1e-9


@dataclass
class Seq:
    sid: int
    prompt: int  # prompt id (samples of one prompt share its prefill)
    prompt_len: int
    length: int  # response tokens to generate
    skip: int = 0  # prompt tokens computed as a shared prefix (deduplicated prefill), not prefilled per prompt
    left: float = 0.0  # tokens still to generate
    finished_at: float | None = None
    done_on: int = -1  # the instance it finished on

    def __post_init__(self) -> None:
        self.left = float(self.length)

    @property
    def context(self) -> float:
        return self.prompt_len + self.length - self.left


@dataclass
class Instance:
    iid: int
    start: float  # when it may begin (weights loaded)
    queue: list[Seq]
    clock: float = 0.0
    running: list[Seq] = field(default_factory=list)
    total: int = 0  # sequences ever given to it
    finished: int = 0
    arriving: int = 0  # migrated sequences on their way in
    released: float | None = None
    busy: float = 0.0  # seconds it prefilled or decoded
    migrated_out: bool = False
    prefilled: set[int] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.released is None


@dataclass(frozen=True)
class PrefixPart:
    """An instance's part of a deduplicated prefill: prefix tokens it computes, the (owner instance, tokens)
    it takes, and how long it waits for an owner before computing those itself (None: as long as it takes)."""

    compute: int = 0
    take: tuple[tuple[int, int], ...] = ()
    patience_s: float | None = None


@dataclass
class GenResult:
    end: float
    instances: list[Instance]
    seqs: list[Seq]
    migrations: list[tuple[float, int, int, int]]  # (time, source, target, sequences)
    prefill: list[dict[str, float]] = field(default_factory=list)  # per instance, with `prefixes`


class Gen:
    """One generation stage. `plan[i]` is instance i's sequences in the order it takes them; `starts[i]` when
    it is ready. `hook(gen, instance, now)` runs after each of the instance's finishes."""

    def __init__(self, cost: CostModel, shape: ModelShape, tp: int, slots: int, plan: Sequence[Sequence[Seq]],
                 starts: Sequence[float] | None = None,
                 hook: Callable[[Gen, Instance, float], None] | None = None,
                 sinks: dict[int, set[int]] | None = None, prefixes: Sequence[PrefixPart] | None = None):
        if slots < 1:
            raise ValueError("an instance needs at least one slot")
        self.cost, self.shape, self.tp, self.slots, self.hook = cost, shape, tp, slots, hook
        self.sinks = {k: set(v) for k, v in (sinks or {}).items()}  # sink -> the sources it waits for
        self.prefixes = list(prefixes) if prefixes is not None else None
        starts = list(starts) if starts is not None else [0.0] * len(plan)
        self.inst = [Instance(i, s, list(q), clock=s, total=len(q)) for i, (q, s) in enumerate(zip(plan, starts,
                                                                                                   strict=True))]
        self.migrations: list[tuple[float, int, int, int]] = []
        self._heap: list[tuple[float, int, int, str]] = []
        self._version = [0] * len(self.inst)
        self._tie = itertools.count()
        self._arrivals: dict[int, list[Seq]] = {}
        self.seqs = [s for q in plan for s in q]

    def iter_s(self, inst: Instance) -> float:
        return self.cost.decode_iter(self.shape, len(inst.running), sum(s.context for s in inst.running), self.tp)

    def free_slots(self, inst: Instance) -> int:
        return self.slots - len(inst.running) - len(inst.queue) - inst.arriving if inst.active else 0

    def _advance(self, inst: Instance, now: float) -> None:
        """Move the instance's clock to `now`, its running sequences progressing at the current rate."""
        if inst.running and now > inst.clock:
            tokens = (now - inst.clock) / self.iter_s(inst)
            for s in inst.running:
                s.left = max(0.0, s.left - tokens)
            inst.busy += now - inst.clock
        inst.clock = max(inst.clock, now)

    def _admit(self, inst: Instance) -> None:
        new: list[Seq] = []
        while inst.queue and len(inst.running) + len(new) < self.slots:
            new.append(inst.queue.pop(0))
        fresh = [s for s in new if s.length == s.left and s.prompt not in inst.prefilled]
        prompts = {s.prompt: s.prompt_len - s.skip for s in fresh}
        inst.prefilled.update(prompts)
        prefill = self.cost.prefill_s(self.shape, sum(prompts.values()), self.tp)
        inst.clock += prefill
        inst.busy += prefill
        inst.running += new

    def _schedule(self, inst: Instance) -> None:
        self._version[inst.iid] += 1
        if not inst.running:
            if not inst.queue and not inst.arriving and inst.active and not self._waiting(inst):
                self._release(inst, inst.clock)
            return
        nxt = inst.clock + min(s.left for s in inst.running) * self.iter_s(inst)
        heapq.heappush(self._heap, (nxt, next(self._tie), inst.iid, f"finish:{self._version[inst.iid]}"))

    def _waiting(self, inst: Instance) -> bool:
        """A sink with a source that has not released yet (whose word has not come)."""
        return any(self.inst[s].active for s in self.sinks.get(inst.iid, ()))

    def _release(self, inst: Instance, when: float) -> None:
        inst.released = when
        for sink, sources in self.sinks.items():  # a sink idle only for this source's word releases with it
            k = self.inst[sink]
            if inst.iid in sources and k.active and not (k.running or k.queue or k.arriving) and not self._waiting(k):
                k.clock = max(k.clock, when)
                k.released = k.clock

    def migrate(self, source: Instance, target: Instance, now: float) -> None:
        """Move `source`'s unfinished sequences (running and queued) to `target`; their KV cache crosses the
        link first. The source releases its devices now."""
        if not target.active or target is source:
            raise ValueError(f"cannot migrate to instance {target.iid}: it is the source or has released its devices")
        self._advance(source, now)
        moving = source.running + source.queue
        source.running, source.queue, source.migrated_out = [], [], True
        target.arriving += len(moving)  # before the release: a sink idle for this source's word must not release
        self._release(source, now)
        self._version[source.iid] += 1
        if not moving:
            return
        kv = self.cost.kv_bytes(self.shape, sum(s.context for s in moving))
        arrive = now + self.cost.transfer_s(kv, self.tp, across_nodes=self.cost.cluster.nodes > 1)
        target.total += len(moving)
        source.total -= len(moving)
        self._arrivals.setdefault(target.iid, []).extend(moving)
        heapq.heappush(self._heap, (arrive, next(self._tie), target.iid, f"arrive:{len(moving)}"))
        self.migrations.append((now, source.iid, target.iid, len(moving)))

    def _prefill_prefixes(self) -> list[dict[str, float]]:
        """Each instance computes its own prefixes after its setup, then takes the others' (see the module
        docstring) -> the instances' prefill statistics."""
        assert self.prefixes is not None
        stats = [{"prefill_s": 0.0, "prefill_tokens": 0.0, "handover_s": 0.0, "handover_tokens": 0.0,
                  "handover_missed": 0.0} for _ in self.inst]
        done = []
        for inst, part, st in zip(self.inst, self.prefixes, stats, strict=True):
            d = self.cost.prefill_s(self.shape, part.compute, self.tp)
            inst.clock += d
            inst.busy += d
            st["prefill_s"], st["prefill_tokens"] = d, float(part.compute)
            done.append(inst.clock)
        for inst, part, st in zip(self.inst, self.prefixes, stats, strict=True):
            if not part.take:
                continue
            began = inst.clock
            arrive = max(done[owner] + self.cost.transfer_s(self.cost.kv_bytes(self.shape, tokens), self.tp,
                                                            across_nodes=self.cost.cluster.nodes > 1)
                         for owner, tokens in part.take)
            tokens = sum(t for _, t in part.take)
            if part.patience_s is not None and arrive - began > part.patience_s:  # gave up: computes them itself
                d = self.cost.prefill_s(self.shape, tokens, self.tp)
                inst.clock = began + part.patience_s + d
                inst.busy += d
                st["prefill_s"] += d
                st["prefill_tokens"] += tokens
                st["handover_missed"] = float(len(part.take))
            else:
                inst.clock = max(began, arrive)
                st["handover_tokens"] = float(tokens)
            st["handover_s"] = inst.clock - began
        return stats

    def run(self) -> GenResult:
        for inst in self.inst:  # the call's fixed cost (launch, sampling setup) and per-sample bookkeeping first
            setup = self.cost.f.gen_call_s + self.cost.f.row_s * len(inst.queue)
            inst.clock += setup
            inst.busy += setup
        prefill = self._prefill_prefixes() if self.prefixes is not None else []
        for inst in self.inst:
            self._admit(inst)
            self._schedule(inst)
        while self._heap:
            now, _, iid, what = heapq.heappop(self._heap)
            inst = self.inst[iid]
            kind, _, arg = what.partition(":")
            if kind == "finish":
                if int(arg) != self._version[iid] or not inst.active:
                    continue
                self._advance(inst, now)
                done = [s for s in inst.running if s.left <= EPS]
                for s in done:
                    s.left, s.finished_at, s.done_on = 0.0, now, iid
                inst.running = [s for s in inst.running if s.finished_at is None]
                inst.finished += len(done)
                self._admit(inst)
                if self.hook is not None:
                    self.hook(self, inst, now)
            else:  # sequences migrated here arrive (an instance receiving them is active: it had free slots)
                self._advance(inst, now)
                arrived = self._arrivals[iid][:int(arg)]
                self._arrivals[iid] = self._arrivals[iid][int(arg):]
                inst.arriving -= len(arrived)
                inst.queue += arrived
                self._admit(inst)
            if inst.active:
                self._schedule(inst)
        ends = [i.released for i in self.inst if i.released is not None]
        return GenResult(max(ends, default=0.0), self.inst, self.seqs, self.migrations, prefill)
