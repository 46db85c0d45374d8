"""A serverless worker group (the WorkerGroup contract of flowrl.runtime.protocol): its calls run as instance
tasks (backends/serverless/instance.py), as many at once as the planned call has shards, each holding a device
only while it runs.

Split calls (generation, forwards) spread over up to `world` instances, the pool's upper size; an update runs
on one instance (data-parallel training needs a process group, which tasks do not form; said in `notes`).
Around the calls, one module a concern: how many instances generate and which prompts each gets
(backends/serverless/scaling.py), cut-and-migrate between generation instances (migrate.py), the deduplicated
prefill's planning (prefill.py), a fused gen-infer stage streamed between pools (streamed.py, the instances'
side in stream.py), multi-turn generations that give their devices back while tools run (env_release.py),
pre-warming from the step history (prewarm.py), the devices the run's pools hold (slots.py), and the ledger of
finished tasks the cost report reads (ledger.py). Those collaborators start and collect instances through the
group's public methods (`room`, `take_warm`, `submit`, `collect`, `close_boxes`, `refill`). The group's weights
are versions in the object store: an update's new state becomes the current version; `after_update` /
`load_snapshot` hand a version to the other groups holding the model (a reference, no copy: an instance loads it
when it next needs it).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from flowrl.backends.serverless import migrate, prefill, streamed
from flowrl.backends.serverless.devices import Devices
from flowrl.backends.serverless.env_release import EnvRelease
from flowrl.backends.serverless.instance import Build, remote_serve
from flowrl.backends.serverless.ledger import Ledger, usage_of
from flowrl.backends.serverless.prewarm import Prewarmer, Warm
from flowrl.backends.serverless.scaling import Policy, Scaler
from flowrl.backends.serverless.slots import Acquire, Slots
from flowrl.elastic.late import late_start, update_slack
from flowrl.elastic.prefill import PrefillRates
from flowrl.elastic.scale import ScaleChoice
from flowrl.ir.graph import Node
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import concat
from flowrl.runtime.env_rollout import env_spec_of
from flowrl.runtime.protocol import Future, StreamedStage, Usage, WorkerGroup
from flowrl.runtime.transport import pack
from flowrl.runtime.worker import PromptEncoder

# Without `placement`, a group's calls count in one elastic pool per stage kind.
STAGE_KINDS = {"generate": "generation", "logprobs": "inference", "values": "inference", "score": "inference",
               "update": "training", "update_fused": "training"}
VERSIONS = itertools.count(1)  # version numbers, unique across groups (0: the weights built from the seed)


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
            self.group.close_boxes(self.boxes)


class _Released:
    """A multi-turn generation's future: its rounds run in a thread of their own (env_release.py)."""

    def __init__(self, released: EnvRelease, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.out: list[Batch] = []
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(released, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, released: EnvRelease, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.out.append(released.generate(*args, **kwargs))
        except BaseException as e:  # re-raised by result()
            self.error.append(e)

    def result(self) -> Batch:
        self.thread.join()
        if self.error:
            raise self.error[0]
        return self.out[0]


class ServerlessGroup:
    inline = False
    per_rank = False
    why_not_per_rank = ("serverless instances are tasks, one call each: a fused stage's rank-by-rank streams need "
                        "long-lived ranks (the pools stream a gen-infer stage themselves: stream_stage)")

    def __init__(self, name: str, pool: str | None, build: Build, world: int, run_id: str, *, cpus: float = 1.0,
                 crash_on_call: tuple[str, int, str] | None = None, policy: Policy | None = None,
                 mailbox: Any = None, slots: Slots | None = None, floor: int = 0,
                 acquire: Acquire | None = None, devices: Devices | None = None,
                 track: Callable[[str, Any], None] | None = None):
        self.name, self.pool, self.build, self.world = name, pool, build, world
        self.models = tuple(m.name for m in build.models)
        self.key = (run_id, name)
        self.cpus = cpus
        self.devices = devices or Devices(cpus=cpus)  # a GPU (share) where the cluster has GPUs, else a slot
        self.options: dict[str, Any] = self.devices.options()  # each instance task's
        self.state: dict[str, tuple[int, list[Any]]] = {m: (0, []) for m in self.models}
        self.pads: dict[str, int] = {}
        self.crash_on_call = crash_on_call  # tests: (method, n, marker file): its n-th call loses an instance
        self.calls: dict[str, int] = {}
        self.policy = policy = policy or Policy()
        # the mailbox (a Ray actor) hands pre-warmed instances their calls and migrating instances their tails
        self.mailbox = mailbox
        self.boxes = itertools.count()
        self.scaler = Scaler(name, world, policy)
        self.ledger = Ledger()  # finished tasks and figures, taken by the controller (any thread may finish)
        # the run's device slots (shared by its pools): nothing waits holding a slot what it waits for needs
        self.slots = slots
        self.acquire = acquire  # how long a call may wait for its first instance on a joined cluster
        self.track = track  # told each instance task's name and a result of it (held.TaskClock reads it by id)
        self.prewarm = Prewarmer(self.key, build, mailbox, policy.margin_s, policy.prewarm, self.boxes,
                                 self.wanted, self.options, slots, min(floor, world), track)
        if slots is not None:
            slots.register(name, (self.devices.resource, self.devices.gpus or 1.0), self.prewarm.yield_idle,
                           self.prewarm.keep_floor)
        self.encoders: dict[str, PromptEncoder] = {}  # generating models' prompt tokenization (prefill planning)
        self.prefill = PrefillRates()  # the deduplicated prefill's measured rates (flowrl.elastic.prefill)
        self.slack_s: float | None = None  # a streamed stage's: how long its forward instances could start late
        self.released = EnvRelease(self)  # multi-turn generations: env hosts, latency history

    def start(self) -> None:
        """One instance builds the models once (the pool's first cold start) and tells how each tokenizes
        prompts: their pad ids, and for a deduplicated prefill the generating models' tokenization."""
        encoders = {m: self.call("prompt_encoder", m, dispatch="rank0").result() for m in self.models}
        self.pads = {m: int(e.tokenizer.pad_id) for m, e in encoders.items()}
        if self.policy.dedup != "off":
            self.encoders = {m.name: encoders[m.name] for m in self.build.models
                             if m.role == "policy" and m.engine != "vllm"}

    def wanted(self) -> dict[str, tuple[int, list[Any]]]:
        """The model versions an instance started now loads (model -> (version, its refs in the store))."""
        return {m: self.state[m] for m in self.models}

    # ---- the WorkerGroup protocol --------------------------------------------------------------------
    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        mode = dispatch
        return self._call(method, args, mode, kwargs)

    def _call(self, method: str, args: tuple[Any, ...], mode: str, kwargs: dict[str, Any]) -> Future:
        if method == "generate" and self.policy.env_release and len(args) > 2 and env_spec_of(args[2]) is not None:
            # multi-turn: rounds of instances that give their devices back while tools run (env_release.py)
            return _Released(self.released, args, kwargs)
        world = 1 if method in dispatch.UPDATES else self.world
        order, choice, sink = None, None, None
        if method == "generate" and args and isinstance(args[1], Batch):
            # a migrating generation's instances wait on one another: no more than can run at once
            args, world, order, gen = self.scaler.shards(args, self.room(self.world))
            choice, sink = gen.choice, gen.sink
        elif method not in dispatch.UPDATES and mode == "split":
            rows = next((a.size for a in args if isinstance(a, Batch)), 0)
            world, _ = self.scaler.forward(method, rows)
        plan = dispatch.plan(method, args, kwargs, mode, world)
        self.room(len(plan.calls))  # idle pre-warmed instances of other pools make way
        migrating = args[1] if method == "generate" and len(plan.calls) > 1 and self.policy.tau < 1.0 else None
        migration = self.new_box("migrate") if migrating is not None else ""
        new = next(VERSIONS) if method in dispatch.UPDATES else 0
        wanted = self.wanted()
        self.calls[method] = self.calls.get(method, 0) + 1
        crash = self.crash_on_call
        marker = crash[2] if crash is not None and (crash[0], crash[1]) == (method, self.calls[method]) else None
        first, warm = self.take_warm(len(plan.calls), method)
        refs: list[list[ray.ObjectRef]] = []
        shares, shared = self.shares(plan)
        boxes = [w.box for w in warm] + ([migration] if migrating is not None else []) + ([shared] if shared else [])
        tokens: list[str] = []
        for c in plan.calls:
            lost = marker if c.rank == 0 else None
            how, kw = method, {**c.kwargs, **({"share": shares[c.rank]} if shares else {})}
            if migrating is not None:
                how, kw = migrate.METHOD, {**kw, "first_prompt": c.offset, "mailbox": self.mailbox,
                                           "role": self.role(c.rank, len(plan.calls), migration, sink)}
            got, token = self.submit(warm, how, c.args, kw, new, lost, wanted)
            refs.append(got)
            tokens.append(token)
        if method in dispatch.UPDATES:
            trained = [args[0]] if isinstance(args[0], str) else list(args[0])
            for m in trained:  # the new version: the update's weights and optimizer state, kept in the store
                self.state[m] = (new, [refs[0][2], m, refs[0][3]])
        return ServerlessFuture(self, plan, refs, order, choice, first, boxes, migrating, tokens)

    # ---- what the group's collaborators start and collect instances with (streamed.py, env_release.py) ----
    def new_box(self, kind: str) -> str:
        """A fresh name for a Mailbox box (or an instance task) of this group: `RUN/GROUP/KIND-N`."""
        return f"{self.key[0]}/{self.name}/{kind}-{next(self.boxes)}"

    def take_warm(self, shards: int, method: str) -> tuple[bool, list[Warm]]:
        """A call of `shards` instances comes: (whether it is the step's first, the pre-warmed instances it
        takes; `submit` hands them their calls)."""
        return self.prewarm.arrived(shards, method)

    def submit(self, warm: list[Warm], how: str, args: tuple[Any, ...], kw: Mapping[str, Any], new: int = 0,
               lost: str | None = None, wanted: Mapping[str, Any] | None = None
               ) -> tuple[list[ray.ObjectRef], str]:
        """One instance task running `how(*args, **kw)` on the model versions `wanted` (default: `wanted()`),
        a pre-warmed instance from `warm` if any is left -> (its 4 results, its token in the ledger)."""
        wanted = self.wanted() if wanted is None else wanted
        if warm:  # a pre-warmed instance takes the call from its box
            w = warm.pop()
            self.mailbox.put.remote(w.box, [ray.put((dict(wanted), how, args, dict(kw), new, lost))])
            return w.refs, w.box
        token = self.new_box("task")
        ledger = (self.mailbox, token) if self.mailbox is not None else None
        refs = remote_serve.options(**self.options, num_returns=4, name=token).remote(
            self.key, self.build, dict(wanted), how, args, dict(kw), new, lost, ledger)
        if self.track is not None:
            self.track(token, refs[0])
        if self.slots is not None:
            self.slots.taken(self.name, refs[1])
        return list(refs), token

    def asked(self) -> dict[str, float]:
        """What each instance task asks Ray for."""
        return self.devices.asks()

    def room(self, want: int, beside: Mapping[str, int] | None = None) -> int | None:
        """Instances of this pool (at most `want`) that can hold a device at once now, with `beside` (group ->
        instances) of other pools started beside them (this pool's idle pre-warmed ones count as its own; other
        pools' make way): the most a call whose instances wait on one another may use. None: no slots counted
        (a group made without the run's `Slots`)."""
        if self.slots is None:
            return None
        return self.slots.make_room(self.name, want, beside, self.prewarm.waiting())

    def close_boxes(self, boxes: Sequence[str]) -> None:
        """Boxes whose instances returned: forgotten by the Mailbox (what they held is unpinned)."""
        for box in boxes:
            self.mailbox.close.remote(box)

    def refill(self) -> None:
        """A call returned: the pools' lower bounds let go for it are kept warm again."""
        if self.slots is not None:
            self.slots.refill()

    def note(self, metrics: Mapping[str, float]) -> None:
        """The group's own figures for the step's metrics."""
        self.ledger.note(metrics)

    def record(self, used: Sequence[Usage], tokens: Sequence[str]) -> None:
        """Finished instance tasks, each with its token, for the cost report."""
        self.ledger.record(used, tokens)

    # ---- a fused gen-infer stage, streamed by the pools themselves (backends/serverless/streamed.py) -----
    def stream_stage(self, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                     others: Mapping[str, WorkerGroup]) -> StreamedStage | None:
        """Generation on this pool's instances, each running its own group's forwards on its chunks and
        offering every chunk to one instance of each other serverless group with forwards of the stage."""
        return streamed.stream_stage(self, gen, forwards, prompts, seed, others)

    def late_s(self) -> float:
        """How long after the first chunk a streamed stage's forward instances start (flowrl.elastic.late, as
        the simulator's `RLHFless.late_s`)."""
        return late_start(self.slack_s, self.policy.late)

    def learn_slack(self, waits: Sequence[float], late: float) -> None:
        """What each forward instance waited for chunks this step, started `late` after the first chunk: the
        slack the stage had after it, into the moving mean."""
        self.slack_s = update_slack(self.slack_s, waits, late)

    def collect(self, method: str, refs: Sequence[Sequence[ray.ObjectRef]], tokens: Sequence[str],
                 first: bool) -> tuple[list[Any], list[Usage]]:
        """A call's instance results and their usage (recorded for the cost report and the ledger)."""
        if self.acquire is not None:  # a joined cluster: fail, naming the pool, rather than wait for good
            self.acquire.granted(self.pool or self.name, tokens, [r[1] for r in refs], self.asked())
        got = ray.get([r[0] for r in refs] + [r[1] for r in refs])
        used = [self.usage_for(method, st) for st in got[len(refs):]]
        learned = prefill.learned(self.prefill, [st["prefill"] for st in got[len(refs):] if "prefill" in st])
        self.ledger.note({f"prefill/{self.name}/{k}": v for k, v in learned.items()})
        self.ledger.record(used, tokens)
        self.prewarm.learn(used, first)
        return got[:len(refs)], used

    def rollout(self, parts: Sequence[migrate.Part], prompts: Batch) -> tuple[list[Batch], Batch]:
        """Generation instances' parts -> (each instance's finished rows as one batch, the rollout in sample
        order); what moved between them goes to the metrics."""
        if len(parts) > 1 and self.policy.tau < 1.0:
            self.ledger.note({f"migrate/{self.name}/moved": float(sum(p.moved_in for p in parts)),
                              f"migrate/{self.name}/sources": float(sum(1 for p in parts if p.moved_out))})
        rows = [concat(part.chunks) if part.chunks else Batch(0, {}) for part in parts]
        return rows, migrate.merge([[r] for r in rows if r.size], prompts)

    def shares(self, plan: dispatch.Plan) -> tuple[list[prefill.Share], str]:
        """A generation's deduplicated prefill: each instance's `Share` and the box owners offer prefixes in
        (([], "") when it does not apply; prefill.shares_for)."""
        shares, box, decided = prefill.shares_for(plan, self.encoders, self.policy.dedup, self.prefill,
                                                  lambda: self.new_box("prefill"),
                                                  self.mailbox)
        self.ledger.note({f"prefill/{self.name}/{k}": v for k, v in decided.items()})
        return shares, box

    def role(self, rank: int, shards: int, box: str, sink: int | None) -> migrate.Role | None:
        """A generation instance's part in cut-and-migrate: `sink` (the generation plan's, Scaler.shards:
        flowrl.elastic.migration_sink) takes the tails, the others are sources; None without migration (one
        shard, no sink, or `migrate_at` = 1)."""
        if shards < 2 or sink is None or self.policy.tau >= 1.0:
            return None
        return migrate.Role(box, self.policy.tau, shards - 1 if rank == sink else 0, rank)

    def finish(self, plan: dispatch.Plan, refs: list[list[ray.ObjectRef]], order: list[int] | None,
               choice: ScaleChoice | None = None, sent: float = 0.0, first: bool = False,
               migrating: Batch | None = None, tokens: Sequence[str] = ()) -> Any:
        results, used = self.collect(plan.method, refs, tokens, first)
        model = plan.calls[0].args[0] if plan.calls[0].args else None
        if migrating is not None:  # each instance's Part: its finished rows, what moved
            results, merged = self.rollout(results, migrating)
        if plan.method == "generate":
            self.ledger.note(self.scaler.measure(results, used, choice, time.perf_counter() - sent))
        if migrating is None:
            merged = dispatch.merge(plan, results, self.pads.get(model, 0) if isinstance(model, str) else 0)
        if plan.method == "generate" and isinstance(merged, Batch):
            merged = self.scaler.learn_and_restore(merged, order)
        elif plan.method not in dispatch.UPDATES and plan.mode == "split":
            rows = [next((a.size for a in c.args if isinstance(a, Batch)), 0) for c in plan.calls]
            self.ledger.note(self.scaler.learn_forward(plan.method, rows, used))
        self.refill()  # the lower bounds let go for this call are kept warm again
        return merged

    def pool_of(self, method: str) -> str:
        """The pool a call's instances count in: the group's `placement` pool, else its stage kind."""
        if self.pool is not None:
            return self.pool
        return STAGE_KINDS.get(method, "setup")  # start-up (the first instance's build) and checkpoints

    def usage_for(self, method: str, st: Mapping[str, Any]) -> Usage:
        """An instance task's stats as the usage the cost report reads, in the pool its call counts in."""
        return usage_of(self.pool_of(method), self.name, st)

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

    # ---- what the controller takes once a step ----------------------------------------------------------
    def begin_step(self, began: float) -> None:
        """A step starts (perf_counter `began`): pre-warm from the step history (prewarm.py)."""
        self.prewarm.begin_step(began)

    def take_usage(self) -> list[Usage]:
        """The instance tasks finished since the last call (pre-warmed ones released unused included, once they
        have returned)."""
        for st, method, box in self.prewarm.returned():
            self.ledger.record([self.usage_for(method, st)], [box])
            self.mailbox.close.remote(box)
        return self.ledger.take_usage()

    def take_finished(self) -> dict[str, Usage]:
        """Ledger token -> the usage of each instance task that returned since the last call."""
        return self.ledger.take_finished()

    def take_metrics(self) -> dict[str, float]:
        return self.ledger.take_metrics()

    def close(self) -> None:
        """Stop pre-warming and release the instances still waiting; stop the env hosts."""
        self.prewarm.close()
        self.released.close()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait (at most `timeout_s`) until the instances released unused have returned."""
        self.prewarm.wait_returned(timeout_s)

    def forget(self) -> None:
        """After the run: drop every object reference the group holds (its weights' versions, its instances'
        results), so that nothing of the run stays pinned in a node's object store once the driver lets go of
        the group (an autoscaler removes only nodes that hold no object, no actor and no task)."""
        self.state = {m: (0, []) for m in self.models}
        self.prewarm.forget()
