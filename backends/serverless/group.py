"""A serverless worker group: its calls run as instance tasks (backends/serverless/instance.py), as many at once
as the planned call has shards, each holding a device slot only while it runs.

Split calls (generation, forwards) spread over up to `world` instances, the pool's upper size; an update runs
on one instance (data-parallel training needs a process group, which tasks do not form; said in `notes`).
Generation assigns prompts by predicted length (flowrl.elastic): the step's prompts sorted by their past
response lengths, contiguous runs to instances, so instances holding short work finish and release their slot
early; the rollout is put back in the prompts' order. With `migrate_at` < 1 the instances cut and migrate
(backends/serverless/migrate.py): an instance that finished that fraction of its sequences hands the rest to
the one holding the longest predicted work and releases its slot. From the step history, the instances a
group's first call of a step will want are pre-warmed (instance.prewarm). The group's weights are versions in
the object store: an update's new state becomes the current version; `after_update` / `load_snapshot` hand a
version to the other groups holding the model (a reference, no copy: an instance loads it when it next needs
it).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

from flowrl.backends.serverless import migrate, prefill, stream
from flowrl.backends.serverless.instance import SLOT, Build, remote_prewarm, remote_serve
from flowrl.elastic.assign import ranked_runs
from flowrl.elastic.predict import LengthPredictor
from flowrl.elastic.prewarm import prewarm_delay
from flowrl.elastic.scale import DecodeCurve, ScaleChoice, choose_instances
from flowrl.ir.attrs import GenerateAttrs
from flowrl.ir.graph import Node
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import ChunkForward, assemble, concat
from flowrl.runtime.protocol import Future, StreamedStage, WorkerGroup
from flowrl.runtime.transport import pack
from flowrl.runtime.worker import PromptEncoder

# Without `placement`, a group's calls count in one elastic pool per stage kind.
STAGE_KINDS = {"generate": "generation", "logprobs": "inference", "values": "inference", "score": "inference",
               "update": "training", "update_fused": "training"}
VERSIONS = itertools.count(1)  # version numbers, unique across groups (0: the weights built from the seed)


@dataclass(frozen=True)
class Usage:
    """One instance task: which pool, when it held its slot (wall clock), and how that time went."""

    pool: str  # the placement pool, or the stage kind (generation, inference, training) without one
    group: str
    pid: int
    began: float  # time.time() when the task started
    start_s: float  # building the models (a cold start; 0 when warm)
    load_s: float  # loading newer weights from the object store
    run_s: float  # the method itself
    cold: bool
    wait_s: float = 0.0  # a pre-warmed instance's time ready and waiting for its call (idle, held)
    prewarmed: bool = False  # started ahead of its stage (`prewarm`)
    ready_first: bool = False  # pre-warmed and ready before its call came: the stage did not wait for its start
    served: bool = True  # False: pre-warmed, then not needed (the call came before it was started, or never)
    lost_s: float = 0.0  # an attempt whose process was lost: from its start to its retry's (Ray re-ran the task)

    @property
    def held_s(self) -> float:
        return self.start_s + self.load_s + self.wait_s + self.run_s + self.lost_s

    @property
    def ahead_s(self) -> float:
        """Held before the call came: a pre-warmed instance's start-up, loading (a version newer than the one
        loaded ahead included) and waiting; 0 for an instance started by its call."""
        return self.start_s + self.load_s + self.wait_s if self.prewarmed else 0.0


@dataclass(frozen=True)
class Policy:
    """A pool's elastic policy (`run { cost_weight, prewarm, prewarm_margin, migrate_at, dedup_prefill }`);
    `predict`, `assign` and `scale` switch mechanisms off one at a time for the ablation (bench/serverless.py)."""

    cost_weight: float = 0.5  # 1 buys the fastest generation, 0 the fewest device-seconds
    prewarm: bool = True
    margin_s: float = 0.05
    tau: float = 0.7  # cut-and-migrate once this fraction of an instance's sequences finished (1: never)
    predict: bool = True  # per-prompt length prediction (off: every prompt predicted at the last batch mean)
    assign: bool = True  # length-ranked assignment (off: prompts in their data order)
    scale: bool = True  # the cost-aware instance count (off: the pool's upper size)
    dedup: str = "auto"  # deduplicated prefill: auto | handover | local | off (backends/serverless/prefill.py)


@dataclass(frozen=True)
class Warm:
    """A pre-warmed instance: its mailbox box and its task's results."""

    box: str
    refs: list[ray.ObjectRef]


def lost_attempts(attempts: Mapping[str, Sequence[tuple[int, float]]], finished: Mapping[str, Usage]) -> list[Usage]:
    """Attempts whose process was lost (Ray re-ran their task), from the ledger's records (token -> (pid, start)
    of each attempt) and the usage each task's returning attempt reported: each lost one held its slot from its
    start to the next attempt's start, and forced a replacement to start (counted as a cold start)."""
    out = []
    for token, tried in attempts.items():
        kept = finished[token]
        ordered = sorted(tried, key=lambda a: a[1])
        for (pid, began), (_, retried) in zip(ordered, ordered[1:], strict=False):
            if pid != kept.pid:
                out.append(Usage(kept.pool, kept.group, pid, began, 0.0, 0.0, 0.0, True, lost_s=retried - began))
    return out


class ServerlessFuture:
    def __init__(self, group: ServerlessGroup, plan: dispatch.Plan, refs: list[list[ray.ObjectRef]],
                 order: list[int] | None, choice: ScaleChoice | None = None, first: bool = False,
                 boxes: Sequence[str] = (), migrating: Batch | None = None, tokens: Sequence[str] = ()):
        self.group, self.plan, self.refs, self.order, self.choice = group, plan, refs, order, choice
        self.tokens = list(tokens)  # each instance task's token in the ledger of attempts
        self.migrating = migrating  # a migrating generation's (ranked) prompts
        self.first = first  # the group's first call of the step (the one pre-warming aims at)
        self.boxes = list(boxes)  # mailbox boxes to close after: pre-warmed instances', a migration's
        self.sent = time.perf_counter()

    def result(self) -> Any:
        try:
            return self.group.finish(self.plan, self.refs, self.order, self.choice, self.sent, self.first,
                                     self.migrating, self.tokens)
        finally:
            for box in self.boxes:
                self.group.mailbox.close.remote(box)


def _chunk_forward(node: Node) -> ChunkForward:
    return ChunkForward(node.id, str(node.op), str(node.model), dict(node.attrs))


def _gather(outs: dict[str, list[tuple[Batch, Any]]], spans: dict[str, tuple[float, float]],
            more: Mapping[str, list[tuple[Batch, Any]]], more_spans: Mapping[str, tuple[float, float]]) -> None:
    for node, got in more.items():
        outs.setdefault(node, []).extend(got)
    for node, (a, b) in more_spans.items():
        old = spans.get(node)
        spans[node] = (a, b) if old is None else (min(old[0], a), max(old[1], b))


def _in_order(out: Batch, rows: list[int] | None, order: list[int] | None) -> Batch:
    """A forward's output over a ranked rollout, in the prompts' own order (as the rollout is put back)."""
    if rows is None or order is None:
        return out
    back = out.select(rows)
    if "group_id" in back.tensors:
        back.tensors["group_id"] = torch.tensor(order)[back["group_id"].long()]
    return back


class ServerlessGroup:
    inline = False
    per_rank = False
    why_not_per_rank = ("serverless instances are tasks, one call each: a fused stage's rank-by-rank streams need "
                        "long-lived ranks (the pools stream a gen-infer stage themselves: stream_stage)")

    def __init__(self, name: str, pool: str | None, build: Build, world: int, run_id: str, *, cpus: float = 1.0,
                 crash_on_call: tuple[str, int, str] | None = None, policy: Policy = Policy(),
                 mailbox: Any = None):
        self.name, self.pool, self.build, self.world = name, pool, build, world
        self.models = tuple(m.name for m in build.models)
        self.key = (run_id, name)
        self.cpus = cpus
        self.state: dict[str, tuple[int, list[Any]]] = {m: (0, []) for m in self.models}
        self.pads: dict[str, int] = {}
        self.usage: list[Usage] = []
        self.lengths = LengthPredictor()  # per prompt id: what its samples' response lengths were
        self.crash_on_call = crash_on_call  # tests: (method, n, marker file): its n-th call loses an instance
        self.calls: dict[str, int] = {}
        self.policy = policy
        self.decode: dict[int, float] = {}  # measured seconds per decode step, by the samples an instance decodes
        self.overhead_s = 0.0  # a generation task's time beyond decoding (starting, loading, returning)
        self.metrics: dict[str, float] = {}  # the scaling decisions since last taken
        # pre-warming: from the step history, start the instances the group's first call of a step will want
        # `ready_s + margin_s` before the earliest that call came in any step; the mailbox (a Ray actor) hands
        # pre-warmed instances their calls and migrating instances their tails
        self.mailbox = mailbox
        self.lock = threading.Lock()  # the timer thread starts instances while the controller calls
        self.offsets: list[float] = []  # per step: seconds from step start to the group's first call
        self.needed = 0  # instances the last first call used, when it had to build models (0: all were warm)
        self.ready_s = 0.0  # how long a cold instance took to build and load (the last measured)
        self.step_began: float | None = None
        self.first_pending = False  # the step's first call has not come yet
        self.timer: threading.Timer | None = None
        self.warm: list[Warm] = []  # started, waiting for their call
        self.unused: list[tuple[Warm, str]] = []  # told they are not needed; their usage not yet taken
        self.boxes = itertools.count()
        self.first_method = "generate"  # the method of the step's first call (its pool counts unused instances)
        self.finished: dict[str, Usage] = {}  # ledger token -> the usage its finished attempt reported
        self.encoders: dict[str, PromptEncoder] = {}  # generating models' prompt tokenization (prefill planning)
        self.prefill = prefill.Measured()

    def start(self) -> None:
        """One instance builds the models once (the pool's first cold start) and tells how each tokenizes
        prompts: their pad ids, and for a deduplicated prefill the generating models' tokenization."""
        encoders = {m: self.call("prompt_encoder", m, dispatch="rank0").result() for m in self.models}
        self.pads = {m: int(e.tokenizer.pad_id) for m, e in encoders.items()}
        if self.policy.dedup != "off":
            self.encoders = {m.name: encoders[m.name] for m in self.build.models
                             if m.role == "policy" and m.engine != "vllm"}

    # ---- the WorkerGroup protocol --------------------------------------------------------------------
    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        mode = dispatch
        return self._call(method, args, mode, kwargs)

    def _call(self, method: str, args: tuple[Any, ...], mode: str, kwargs: dict[str, Any]) -> Future:
        world = 1 if method in dispatch.UPDATES else self.world
        order, choice = None, None
        if method == "generate" and args and isinstance(args[1], Batch):
            args, world, order, choice = self._shards(args)
        plan = dispatch.plan(method, args, kwargs, mode, world)
        migrating = args[1] if method == "generate" and len(plan.calls) > 1 and self.policy.tau < 1.0 else None
        migration = f"{self.key[0]}/{self.name}/migrate-{next(self.boxes)}" if migrating is not None else ""
        new = next(VERSIONS) if method in dispatch.UPDATES else 0
        wanted = {m: self.state[m] for m in self.models}
        self.calls[method] = self.calls.get(method, 0) + 1
        crash = self.crash_on_call
        marker = crash[2] if crash is not None and (crash[0], crash[1]) == (method, self.calls[method]) else None
        first, warm = self._arrived(len(plan.calls), method)
        refs: list[list[ray.ObjectRef]] = []
        shares, shared = self._shares(method, plan)
        boxes = [w.box for w in warm] + ([migration] if migrating is not None else []) + ([shared] if shared else [])
        tokens: list[str] = []
        for c in plan.calls:
            lost = marker if c.rank == 0 else None
            how, kw = method, {**c.kwargs, **({"share": shares[c.rank]} if shares else {})}
            if migrating is not None:
                how, kw = migrate.METHOD, {**kw, "first_prompt": c.offset, "mailbox": self.mailbox,
                                           "role": self._role(c.rank, len(plan.calls), migration)}
            got, token = self._submit(warm, wanted, how, c.args, kw, new, lost)
            refs.append(got)
            tokens.append(token)
        if method in dispatch.UPDATES:
            trained = [args[0]] if isinstance(args[0], str) else list(args[0])
            for m in trained:  # the new version: the update's weights and optimizer state, kept in the store
                self.state[m] = (new, [refs[0][2], m, refs[0][3]])
        return ServerlessFuture(self, plan, refs, order, choice, first, boxes, migrating, tokens)

    def _submit(self, warm: list[Warm], wanted: Mapping[str, Any], how: str, args: tuple[Any, ...],
                kw: Mapping[str, Any], new: int = 0, lost: str | None = None) -> tuple[list[ray.ObjectRef], str]:
        """One instance task (a pre-warmed instance from `warm`, if any is left) -> (its 4 results, its token)."""
        if warm:  # a pre-warmed instance takes the call from its box
            w = warm.pop()
            self.mailbox.put.remote(w.box, [ray.put((dict(wanted), how, args, dict(kw), new, lost))])
            return w.refs, w.box
        token = f"{self.key[0]}/{self.name}/task-{next(self.boxes)}"
        ledger = (self.mailbox, token) if self.mailbox is not None else None
        refs = remote_serve.options(num_cpus=self.cpus, resources={SLOT: 1}, num_returns=4).remote(
            self.key, self.build, dict(wanted), how, args, dict(kw), new, lost, ledger)
        return list(refs), token

    # ---- a fused gen-infer stage, streamed by the pools themselves (backends/serverless/stream.py) -------
    def stream_stage(self, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                     others: Mapping[str, WorkerGroup]) -> StreamedStage | None:
        """Generation on this pool's instances, each running its own group's forwards on its chunks and
        offering every chunk to one instance of each other serverless group with forwards of the stage."""
        away: dict[str, list[ChunkForward]] = {}
        for f in forwards:
            if f.worker_group != self.name:
                away.setdefault(f.worker_group, []).append(_chunk_forward(f))
        consumers = {name: others[name] for name in away}
        if not all(isinstance(g, ServerlessGroup) for g in consumers.values()):
            return None
        started = time.perf_counter()
        args, world, order, choice = self._shards((str(gen.model), prompts, dict(gen.attrs)))
        plan = dispatch.plan("generate", args, {"step_seed": seed}, "split", world)
        box = f"{self.key[0]}/{self.name}/stream-{next(self.boxes)}" if away else ""
        first, warm = self._arrived(len(plan.calls), "generate")
        here = [_chunk_forward(f) for f in forwards if f.worker_group == self.name]
        made = []
        migration = f"{self.key[0]}/{self.name}/migrate-{next(self.boxes)}"
        shares, shared = self._shares("generate", plan)
        for c in plan.calls:
            kw = {**c.kwargs, "first_prompt": c.offset, "box": box, "inline": here, "mailbox": self.mailbox,
                  "role": self._role(c.rank, len(plan.calls), migration),
                  **({"share": shares[c.rank]} if shares else {})}
            made.append(self._submit(warm, {m: self.state[m] for m in self.models}, migrate.METHOD, c.args, kw))
        if away:  # the forward instances start with the first chunk (or once a generation instance returned)
            ray.wait([self.mailbox.take_all.remote(box, 0), *[r[1] for r, _ in made]], num_returns=1)
        jobs: list[tuple[ServerlessGroup, str, list[ray.ObjectRef], str]] = []
        for name, fs in away.items():
            g = consumers[name]
            assert isinstance(g, ServerlessGroup)
            _, waiting = g._arrived(1, fs[0].op)
            refs, token = g._submit(waiting, {m: g.state[m] for m in g.models}, stream.CONSUME, (fs,),
                                    {"box": box, "producers": len(plan.calls), "mailbox": self.mailbox})
            jobs.append((g, fs[0].op, refs, token))
        parts, used = self._collect("generate", [r for r, _ in made], [t for _, t in made], first)
        for done in [migration, shared] if shared else [migration]:
            self.mailbox.close.remote(done)
        outs: dict[str, list[tuple[Batch, Any]]] = {}
        wall_spans: dict[str, tuple[float, float]] = {}
        for part in parts:
            _gather(outs, wall_spans, part.outs, part.spans)
        for g, op, refs, token in jobs:
            (theirs, spans, busy), st = ray.get([refs[0], refs[1]])
            u = g._usage(op, st)
            u = replace(u, run_s=busy, wait_s=u.wait_s + max(0.0, u.run_s - busy))  # waiting for chunks: idle
            g.usage.append(u)
            g.finished[token] = u
            _gather(outs, wall_spans, theirs, spans)
        if box:
            self.mailbox.close.remote(box)  # its chunks are no longer pinned in the object store
        shift = time.time() - time.perf_counter()  # wall clock -> perf_counter
        gen_end = max(part.ended for part in parts)
        chunks, rollout = self._rollout(parts, args[1])
        self._measure(chunks, used, choice, gen_end - shift - started)
        rows = self._restore_rows(rollout, order)
        rollout = self._learn_and_restore(rollout, order)
        return StreamedStage(
            rollout, {n: _in_order(assemble([o for o, _ in got_], [s for _, s in got_]), rows, order)
                      for n, got_ in outs.items()},
            {"fusion/chunks": float(sum(len(p.chunks) for p in parts)), "fusion/workers": float(len(plan.calls)),
             "fusion/gen_s": gen_end - shift - started},
            gen_end - shift, {n: (a - shift, b - shift) for n, (a, b) in wall_spans.items()})

    def _shards(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], int, list[int] | None, ScaleChoice | None]:
        """A generation's (model, prompts, attrs) over this pool: the instance count (the cost-aware choice),
        the prompts in length-ranked order -> (args, instances, the ranked order or None, the choice or None)."""
        world, order, choice = self.world, None, None
        if world > 1:
            choice = self._scale(args[1], args[2] if len(args) > 2 else {})
            world = choice.chosen.instances if choice is not None else world
            if self.policy.assign:
                args, order = self._ranked(args, world)
        return args, world, order, choice

    def _collect(self, method: str, refs: Sequence[Sequence[ray.ObjectRef]], tokens: Sequence[str],
                 first: bool) -> tuple[list[Any], list[Usage]]:
        """A call's instance results and their usage (recorded for the cost report and the ledger)."""
        got = ray.get([r[0] for r in refs] + [r[1] for r in refs])
        used = [self._usage(method, st) for st in got[len(refs):]]
        self._learn_prefill([st["prefill"] for st in got[len(refs):] if "prefill" in st])
        self.usage.extend(used)
        self.finished.update(zip(tokens, used, strict=False))
        self._learn_start(used, first)
        return got[:len(refs)], used

    def _rollout(self, parts: Sequence[migrate.Part], prompts: Batch) -> tuple[list[Batch], Batch]:
        """Generation instances' parts -> (each instance's finished rows as one batch, the rollout in sample
        order); what moved between them goes to the metrics."""
        self._migrated(parts)
        rows = [concat(part.chunks) if part.chunks else Batch(0, {}) for part in parts]
        return rows, migrate.merge([[r] for r in rows if r.size], prompts)

    def _shares(self, method: str, plan: dispatch.Plan) -> tuple[list[prefill.Share], str]:
        """A generation's deduplicated prefill: each instance's `Share` and the box owners offer prefixes in
        (([], "") when it does not apply: not a generation, share-prefix off, vLLM, `dedup_prefill = "off"`)."""
        if method != "generate" or not plan.calls or len(plan.calls[0].args) < 3:
            return [], ""
        model, _, attrs = plan.calls[0].args[:3]
        a = GenerateAttrs.of(attrs)
        if model not in self.encoders or not a.share_prefix or self.mailbox is None:
            return [], ""
        shards = [c.args[1] for c in plan.calls]
        if not all(isinstance(b, Batch) and "prompt" in b.meta for b in shards):
            return [], ""
        box = f"{self.key[0]}/{self.name}/prefill-{next(self.boxes)}"
        shares, decided = prefill.plan_shares(
            self.encoders[model], [t for b in shards for t in b.meta["prompt"]], a.max_tokens, a.prefix_min_len,
            [b.size for b in shards], self.policy.dedup, self.prefill, box, self.mailbox)
        if not decided["prefixes"]:
            return [], ""
        self.metrics.update({f"prefill/{self.name}/{k}": v for k, v in decided.items()})
        return shares, box

    def _learn_prefill(self, stats: Sequence[Mapping[str, float]]) -> None:
        """What the instances' deduplicated prefill measured: the rates the next decision uses, and the step's
        metrics (prefix tokens computed, saved against every prompt prefilling its prefix, handed over)."""
        if not stats:
            return
        self.prefill.learn(stats)
        g = f"prefill/{self.name}/"
        computed = sum(s["prefill_tokens"] for s in stats)
        self.metrics[g + "computed_tokens"] = computed
        self.metrics[g + "saved_tokens"] = sum(s["skipped_tokens"] for s in stats) - computed
        self.metrics[g + "prefill_s"] = sum(s["prefill_s"] for s in stats)
        for key in ("handover_tokens", "handover_bytes", "handover_s", "handover_missed"):
            self.metrics[g + key] = sum(s[key] for s in stats)

    def _role(self, rank: int, shards: int, box: str) -> migrate.Role | None:
        """A generation instance's part in cut-and-migrate: the last shard (the longest predicted work) is the
        sink, the others sources; None without migration (one shard, or `migrate_at` = 1)."""
        if shards < 2 or self.policy.tau >= 1.0:
            return None
        return migrate.Role(box, self.policy.tau, shards - 1 if rank == shards - 1 else 0, rank)

    def _migrated(self, parts: Sequence[migrate.Part]) -> None:
        if len(parts) > 1 and self.policy.tau < 1.0:
            self.metrics[f"migrate/{self.name}/moved"] = float(sum(p.moved_in for p in parts))
            self.metrics[f"migrate/{self.name}/sources"] = float(sum(1 for p in parts if p.moved_out))

    def _restore_rows(self, rollout: Batch, order: list[int] | None) -> list[int] | None:
        """The row order `_learn_and_restore` puts a ranked rollout back in (None: not ranked)."""
        if order is None or "group_id" not in rollout.tensors:
            return None
        original = torch.tensor(order)[rollout["group_id"].long()]
        return sorted(range(rollout.size), key=lambda i: (int(original[i]), i))

    def finish(self, plan: dispatch.Plan, refs: list[list[ray.ObjectRef]], order: list[int] | None,
               choice: ScaleChoice | None = None, sent: float = 0.0, first: bool = False,
               migrating: Batch | None = None, tokens: Sequence[str] = ()) -> Any:
        results, used = self._collect(plan.method, refs, tokens, first)
        model = plan.calls[0].args[0] if plan.calls[0].args else None
        if migrating is not None:  # each instance's Part: its finished rows, what moved
            results, merged = self._rollout(results, migrating)
        if plan.method == "generate":
            self._measure(results, used, choice, time.perf_counter() - sent)
        if migrating is None:
            merged = dispatch.merge(plan, results, self.pads.get(model, 0) if isinstance(model, str) else 0)
        if plan.method == "generate" and isinstance(merged, Batch):
            merged = self._learn_and_restore(merged, order)
        return merged

    def pool_of(self, method: str) -> str:
        """The pool a call's instances count in: the group's `placement` pool, else its stage kind."""
        if self.pool is not None:
            return self.pool
        return STAGE_KINDS.get(method, "setup")  # start-up (the first instance's build) and checkpoints

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(self.why_not_per_rank)

    def colocated(self, models: Sequence[str]) -> bool:
        return all(m in self.models for m in models)  # an instance builds all of its group's models

    def recover(self) -> None:
        pass  # nothing long-lived to bring back: the next task starts on any process

    def state_dict(self) -> dict[str, Any]:
        return dict(self.call("state_dict", dispatch="rank0").result())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for m, s in state.items():
            if m in self.state:
                self.state[m] = (next(VERSIONS), [ray.put(pack(s))])

    # ---- pre-warming from the step history -------------------------------------------------------------
    def begin_step(self, began: float) -> None:
        """A step starts (perf_counter `began`): release instances started for the last one and not used, and
        when the history says the group's first call has had to build models, start as many instances as it
        used so that they are ready `margin_s` before the earliest that call has come."""
        with self.lock:
            self._release_warm()
            self.step_began, self.first_pending = began, True
            delay = prewarm_delay(self.offsets, self.ready_s, self.policy.margin_s)
            if not self.policy.prewarm or self.mailbox is None or delay is None or not self.needed:
                return
            self.timer = threading.Timer(delay, self._prewarm, args=(began, self.needed))
            self.timer.daemon = True
            self.timer.start()

    def _prewarm(self, began: float, n: int) -> None:
        with self.lock:
            if self.step_began != began or not self.first_pending:  # too late: the call came first
                return
            wanted = {m: self.state[m] for m in self.models}
            for _ in range(n):
                box = f"{self.key[0]}/{self.name}/{next(self.boxes)}"
                started: Any = remote_prewarm.options(num_cpus=self.cpus, resources={SLOT: 1}, num_returns=4).remote(
                    self.key, self.build, wanted, self.mailbox, box)
                self.warm.append(Warm(box, list(started)))

    def _arrived(self, shards: int, method: str) -> tuple[bool, list[Warm]]:
        """A call comes: (whether it is the step's first, the pre-warmed instances it takes)."""
        with self.lock:
            first = self.first_pending
            if first:
                self.first_pending = False
                if self.timer is not None:
                    self.timer.cancel()
                if self.step_began is not None:
                    self.offsets.append(time.perf_counter() - self.step_began)
            taken, self.warm = self.warm[:shards], self.warm[shards:]
            if first:
                self.first_method = method
            return first, taken

    def _learn_start(self, used: Sequence[Usage], first: bool) -> None:
        """From a finished call: how long a cold start takes, and whether the step's first call needed one."""
        cold = [u.start_s + u.load_s for u in used if u.cold]
        if cold:
            self.ready_s = max(cold)
        if first:
            self.needed = len(used) if cold else 0

    def _release_warm(self) -> None:
        for w in self.warm:
            self.mailbox.put.remote(w.box, None)
            self.unused.append((w, self.first_method))
        self.warm = []

    def _usage(self, method: str, st: Mapping[str, Any]) -> Usage:
        return Usage(self.pool_of(method), self.name, int(st["pid"]), float(st["began"]), float(st["start_s"]),
                     float(st["load_s"]), float(st["run_s"]), bool(st["cold"]), float(st["wait_s"]),
                     bool(st["prewarmed"]), bool(st["ready_first"]), bool(st["served"]))

    def close(self) -> None:
        """Stop pre-warming and release the instances still waiting."""
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
            self.step_began = None
            if self.mailbox is not None:
                self._release_warm()

    # ---- cost-aware instance count ---------------------------------------------------------------------
    def _scale(self, prompts: Batch, attrs: Mapping[str, Any]) -> ScaleChoice | None:
        """How many instances generate this step: flowrl.elastic's argmin of cost_weight * T(N) / T_ref +
        (1 - cost_weight) * C(N) / C_ref over N = 1..world, from the prompts' predicted lengths and this run's
        measured seconds per decode step. None (all `world`) until a first generation was measured."""
        if not self.decode or not self.policy.scale:
            return None
        predicted = self._predicted(prompts)
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        samples = int(str(attrs.get("n", 1))) if isinstance(attrs, Mapping) else 1
        return choose_instances(predicted, samples, range(1, self.world + 1), DecodeCurve(self.decode),
                                self.policy.cost_weight, start_s=self.overhead_s,
                                profiles=self.lengths.predict_profiles(ids, samples, fallback=0.0)
                                if self.policy.predict else None)

    def _measure(self, results: Sequence[Any], used: Sequence[Usage], choice: ScaleChoice | None,
                 wall_s: float) -> None:
        """Learn seconds per decode step (by the samples an instance decoded) and the tasks' overhead from this
        generation; log the choice and its predicted vs measured time and device-seconds."""
        for out, u in zip(results, used, strict=True):
            if isinstance(out, Batch) and out.size and "response_mask" in out.tensors:
                steps = max(1, int(out["response_mask"].sum(1).max()))
                per_step = u.run_s / steps
                old = self.decode.get(out.size)
                self.decode[out.size] = per_step if old is None else 0.5 * old + 0.5 * per_step
        self.overhead_s = sum(u.held_s - u.run_s for u in used if not u.cold) / max(1, sum(not u.cold for u in used))
        g = f"scale/{self.name}/"
        self.metrics[g + "instances"] = float(len(used))
        self.metrics[g + "measured_T_s"] = wall_s
        self.metrics[g + "measured_C_s"] = sum(u.held_s for u in used)
        if choice is not None:
            self.metrics[g + "predicted_T_s"] = choice.chosen.time_s
            self.metrics[g + "predicted_C_s"] = choice.chosen.device_s
            for c in choice.candidates:
                self.metrics[f"{g}T_s@{c.instances}"] = c.time_s
                self.metrics[f"{g}C_s@{c.instances}"] = c.device_s

    def take_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out

    # ---- length-ranked assignment ----------------------------------------------------------------------
    def _ranked(self, args: tuple[Any, ...], instances: int) -> tuple[tuple[Any, ...], list[int]]:
        """The prompts reordered by predicted response length (shortest first), so each instance's contiguous
        shard holds prompts of similar length; `order[i]` is the original position of the i-th prompt."""
        prompts: Batch = args[1]
        runs = ranked_runs(self._predicted(prompts), instances)
        order = [i for run in runs for i in run]
        return (args[0], prompts.select(order), *args[2:]), order

    def _predicted(self, prompts: Batch) -> list[float]:
        """Each prompt's predicted response length (without prediction: the last batch's mean for all)."""
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        if not self.policy.predict:
            return [self.lengths.mean] * len(ids)
        return self.lengths.predict(ids, fallback=0.0)

    def _learn_and_restore(self, rollout: Batch, order: list[int] | None) -> Batch:
        """The rollout in the prompts' own order (each sample's group id names its prompt there again), and the
        predictor taught this step's lengths."""
        rollout = _in_order(rollout, self._restore_rows(rollout, order), order)
        ids = rollout.meta.get("prompt_id")
        if ids is not None:
            lengths = rollout["response_mask"].sum(1).tolist()
            self.lengths.observe([int(i) for i in ids], [float(x) for x in lengths])
        return rollout

    def take_usage(self) -> list[Usage]:
        """The instance tasks finished since the last call (pre-warmed ones released unused included, once they
        have returned)."""
        with self.lock:
            if self.unused:
                done, _ = ray.wait([w.refs[1] for w, _ in self.unused], num_returns=len(self.unused), timeout=0)
                ready = set(done)
                for w, method in [x for x in self.unused if x[0].refs[1] in ready]:
                    self.usage.append(self._usage(method, ray.get(w.refs[1])))
                    self.finished[w.box] = self.usage[-1]
                    self.mailbox.close.remote(w.box)
                self.unused = [x for x in self.unused if x[0].refs[1] not in ready]
            out, self.usage = self.usage, []
        return out

    def take_finished(self) -> dict[str, Usage]:
        """Ledger token -> the usage of each instance task that returned since the last call."""
        with self.lock:
            out, self.finished = self.finished, {}
        return out
