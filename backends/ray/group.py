"""`RayWorkerGroup`: a worker group as N Ray actors (ranks) in one placement group, behind the `WorkerGroup`
protocol the single controller drives.

A call is planned by `dispatch.plan` (what each rank gets), sent to the ranks, and its `RayFuture` collects the
ranks' results into one (`dispatch.merge`). A dead rank is not a lost run: the future notices the death, the
group rebuilds its ranks in the same placement-group bundles, brings them back to the last weights they held,
joins a fresh process group, and re-sends the call from the future's copy of the inputs. Survivors are rebuilt
too: they may be blocked in a collective with the dead peer (torchelastic restarts the whole worker group for
the same reason).

"The last weights they held" is a snapshot of rank 0's state in the object store, taken every `snapshot_every`
state-changing calls, plus the calls made since, which are replayed: an update is deterministic for the same
weights, inputs and seeds, and a snapshot after every update would copy the whole state every step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flowrl.backends.ray.actor import RankActor
from flowrl.errors import FlowError
from flowrl.ir.graph import ModelDecl, Node
from flowrl.runtime import dispatch, interrupt
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import STREAMS
from flowrl.runtime.protocol import RankLostError, StreamedStage, WorkerGroup

if TYPE_CHECKING:
    from flowrl.backends.ray.sync import WeightSync

log = logging.getLogger("flowrl.ray")

MAX_RESTARTS = 3  # per call: a rank that keeps dying is a bug, not bad luck
PEER_GRACE_S = 10.0  # after a rank's error, how long to look for a dead peer that caused it
CLOSE_TIMEOUT_S = 10.0  # shutting down: how long a rank gets to close its environment pools before it is killed


class WorkerError(RuntimeError):
    """A worker raised an exception that could not be brought back as its own type."""


class WorkerLostError(RuntimeError):
    """A rank died and could not be brought back."""


class RankLost(Exception):
    """A rank's process died (caught and recovered from inside a call; raised by `setup` at start)."""


@dataclass(frozen=True)
class GroupSpec:
    """What the ranks of one worker group are: their models, count and per-rank resources."""

    name: str
    models: tuple[ModelDecl, ...]
    all_models: tuple[ModelDecl, ...]
    world: int
    bundle: Mapping[str, float]  # resources of one rank (a placement-group bundle)
    seed: int
    device: str
    crash_on_call: Mapping[int, int | tuple[str, int]] = field(default_factory=dict)  # test hook: rank -> n (first processes only)
    snapshot_every: int = 10  # state-changing calls between snapshots (the ones since are replayed on a restart)

    @property
    def threads(self) -> int:
        return max(1, int(self.bundle.get("CPU", 1.0)))


class RayFuture:
    """The ranks' pending results of one call. `result()` waits, recovers dead ranks, merges."""

    def __init__(self, group: RayWorkerGroup, plan: dispatch.Plan, refs: list[ray.ObjectRef]):
        self.group, self.plan, self.refs = group, plan, refs
        self.sent_to = group.restarts  # which incarnation of the ranks got the call
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self) -> Any:
        if not self._done:
            try:
                self._value = self.group._finish(self.plan, self.refs, self.sent_to)
            except BaseException as e:
                self._error = e
                raise
            finally:
                self._done = True
        if self._error is not None:
            raise self._error
        return self._value


class RayWorkerGroup:
    """N ranks of `ModelWorker`s (one actor process per rank, all the group's models colocated in it)."""

    inline = False
    per_rank = True
    why_not_per_rank = ""

    def __init__(self, spec: GroupSpec, pg: PlacementGroup, sync: WeightSync | None = None):
        self.spec, self.pg, self.sync = spec, pg, sync
        self.name, self.world = spec.name, spec.world
        self.models = tuple(m.name for m in spec.models)
        self.pads: dict[str, int] = {}  # model -> its tokenizer's pad id (filled by `setup`)
        self.restarts = 0  # rank rebuilds so far (each rebuilds every rank of the group)
        self._snapshot: ray.ObjectRef | None = None  # rank 0's state at the last snapshot (None: initial weights)
        self._since: list[dispatch.Plan] = []  # state-changing calls after that snapshot, in order
        self.actors = self._spawn(first=True)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def _spawn(self, first: bool) -> list[Any]:
        spec = self.spec
        remote = ray.remote(RankActor)
        actors = []
        for rank in range(spec.world):
            options: dict[str, Any] = {
                "num_cpus": spec.bundle.get("CPU", 0.0), "num_gpus": spec.bundle.get("GPU", 0.0),
                "max_restarts": 0, "name": None,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            }
            actors.append(remote.options(**options).remote(
                spec.models, spec.all_models, seed=spec.seed, device=spec.device, rank=rank, world=spec.world,
                threads=spec.threads, crash_on_call=spec.crash_on_call.get(rank) if first else None))
        return actors

    def setup(self) -> None:
        """Wait for the ranks to build their models, join the process group, restore the last weights."""
        self._gather([a.ready.remote() for a in self.actors], "starting")
        self.pads = dict(zip(self.models, self._gather([self.actors[0].run.remote("pad_id", m) for m in self.models],
                                                       "starting"), strict=True))
        if self.world > 1:
            host, port = ray.get(self.actors[0].address.remote())
            self._gather([a.join.remote(host, port) for a in self.actors], "joining the process group")
        if self._snapshot is not None:
            self._gather([a.run.remote("load_state_dict", self._snapshot) for a in self.actors], "restoring")
        for plan in self._since:
            self._gather(self._submit(plan), f"replaying {plan.method}")

    def _rebuild(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.restarts += 1
        log.warning("worker group %s: a rank died; restarting its %d rank(s) from the last weights they held",
                    self.name, self.world)
        self.actors = self._spawn(first=False)
        self.setup()

    def kill(self) -> None:
        try:  # let each rank close its environment pools' processes first (a killed actor cannot)
            ray.get([a.run.remote("close") for a in self.actors], timeout=CLOSE_TIMEOUT_S)
        except Exception:  # a rank dead or stuck: killed below all the same
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone, or Ray is shutting down: nothing left to stop
                pass
        self.actors = []

    # ---- the WorkerGroup protocol --------------------------------------------------------------------
    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> RayFuture:
        model = args[0] if args and isinstance(args[0], str) else None
        if self.sync is not None:
            # Split placement: a model trained in another group is brought up to date before it is used here.
            for m in (model,) if model in self.models else self.models:
                self.sync.pull(m, self.name)
        plan = _plan(method, args, kwargs, dispatch, self.world)
        return RayFuture(self, plan, self._submit(plan))

    # ---- one rank at a time (the fuse-gen-inference scheduler, flowrl.runtime.gen_infer) -------
    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method` on rank `rank` alone; a stream (generate_stream, resume_stream) is pulled item by item (or
        every TICK_S without one), carrying the rank's progress up and the scheduler's export request down."""
        if method in STREAMS:
            return self._stream(rank, method, args, kwargs)
        return self._one(rank, self.actors[rank].run.remote(method, *args, **kwargs), method)

    def _stream(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
        control = kwargs.pop("control", None)
        actor = self.actors[rank]
        self._one(rank, actor.stream_open.remote(method, args, kwargs, control is not None), method)
        export = False
        while True:
            kind, item, remaining = self._one(rank, actor.stream_next.remote(export), method)
            if control is not None and remaining is not None:
                control.progress(remaining)
                export = control.should_export()
            if kind == "end":
                return
            if kind == "item":
                yield item

    def _one(self, rank: int, ref: ray.ObjectRef, what: str) -> Any:
        try:
            return self._gather([ref], f"{what} on rank {rank}")[0]
        except RankLost as lost:  # a rank-by-rank call is not re-sent here: the fused stage recovers and re-runs
            raise RankLostError(self.name, f"worker group {self.name}: {lost} during a fused stage") from None

    def colocated(self, models: Sequence[str]) -> bool:
        return all(m in self.models for m in models)  # each rank's models share its one actor process

    def stream_stage(self, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                     others: Mapping[str, WorkerGroup]) -> StreamedStage | None:
        return None  # its ranks are driven one by one (per_rank)

    def recover(self) -> None:
        """Rebuild every rank from the last weights they held (after a rank was lost mid-call)."""
        self._rebuild()

    def state_dict(self) -> dict[str, Any]:
        # Every rank takes part (a ZeRO trainer gathers its partitions onto rank 0); rank 0's is the whole state.
        state: dict[str, Any] = self.call("state_dict", dispatch="broadcast").result()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.call("load_state_dict", {k: v for k, v in state.items() if k in self.models},
                  dispatch="broadcast").result()

    def stats(self) -> list[dict[str, Any]]:
        """Each rank's own counters (which ranks ran what; used by tests)."""
        values: list[dict[str, Any]] = ray.get([a.stats.remote() for a in self.actors])
        return values

    # ---- running calls -------------------------------------------------------------------------------
    def _submit(self, plan: dispatch.Plan) -> list[ray.ObjectRef]:
        shared = {i: ray.put(plan.calls[0].args[i]) for i in plan.shared}  # one copy in the store for all ranks
        refs = []
        for c in plan.calls:
            args = tuple(shared.get(i, a) for i, a in enumerate(c.args))
            refs.append(self.actors[c.rank].run.remote(plan.method, *args, **c.kwargs))
        return refs

    def _finish(self, plan: dispatch.Plan, refs: list[ray.ObjectRef], sent_to: int) -> Any:
        """Collect a call's results, rebuilding the ranks and re-sending the call when a rank died. (A call
        that was in flight beside the one that found the death is re-sent to the rebuilt ranks as they are.)"""
        pending: list[ray.ObjectRef] | None = refs
        for attempt in range(MAX_RESTARTS + 1):
            try:
                if pending is None:
                    if self.restarts == sent_to:
                        self._rebuild()
                    sent_to = self.restarts
                    pending = self._submit(plan)
                values = self._gather(pending, plan.method)
                break
            except RankLost as lost:
                interrupt.check()  # a rank Ctrl-C killed is not brought back
                if attempt == MAX_RESTARTS:
                    raise WorkerLostError(f"worker group {self.name}: a rank died {attempt + 1} times running "
                                          f"{plan.method}; giving up ({lost})") from None
                pending = None
        if plan.method in dispatch.MUTATING:
            self._remember(plan)
        model = plan.calls[0].args[0] if plan.calls[0].args else None
        merged = dispatch.merge(plan, values, self.pads.get(model, 0) if isinstance(model, str) else 0)
        if plan.method in dispatch.UPDATES and self.sync is not None and plan.calls[0].args:
            trained = plan.calls[0].args[0]  # a model name, or a list of them (update_fused)
            for model in [trained] if isinstance(trained, str) else trained:
                self.sync.updated(model, self.name)
        return merged

    def _remember(self, plan: dispatch.Plan) -> None:
        """Keep what a rebuilt rank needs to reach the ranks' current state."""
        self._since.append(plan)
        if plan.method == "load_state_dict" or len(self._since) >= self.spec.snapshot_every:
            # Every rank takes part, as in `state_dict`; rank 0's result stays in the object store, never fetched.
            refs = [a.run.remote("state_dict") for a in self.actors]
            self._snapshot = refs[0]
            self._since = []

    def _gather(self, refs: Sequence[ray.ObjectRef], what: str) -> list[Any]:
        """Results in order, in completion order: a dead rank raises `RankLost`, a worker's exception is
        re-raised as its own type with the worker's traceback."""
        rank_of = {r: i for i, r in enumerate(refs)}
        values: dict[ray.ObjectRef, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ref = ready[0]
            try:
                values[ref] = ray.get(ref)
            except RayActorError as e:
                raise RankLost(f"rank {rank_of[ref]} of worker group {self.name} died while {what}: {_death(e)}"
                               ) from None
            except RayTaskError as e:
                # A collective fails on every rank when one rank dies: look for a dead peer before blaming this one.
                if self.world > 1 and pending and _peer_died(pending):
                    raise RankLost(f"a peer of rank {rank_of[ref]} died") from None
                raise unwrap(e, f"worker group {self.name}, rank {rank_of[ref]}, {what}") from None
        return [values[r] for r in refs]


def _plan(method: str, args: Sequence[Any], kwargs: Mapping[str, Any], mode: str, world: int) -> dispatch.Plan:
    try:
        return dispatch.plan(method, args, kwargs, mode, world)
    except dispatch.DispatchError as e:
        raise FlowError(str(e)) from None


def _peer_died(pending: Sequence[ray.ObjectRef]) -> bool:
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PEER_GRACE_S)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError:
            return True
        except Exception:  # another rank's own error: not a death
            continue
    return False


def _death(e: RayActorError) -> str:
    """Ray's reason for the death; for an actor whose constructor raised, that includes its traceback."""
    return str(e).strip()[-3000:] or "no reason given"


def unwrap(err: RayTaskError, where: str) -> BaseException:
    """The worker's exception as its own type (so `except ValueError` and the controller's 'ValueError: ...'
    work), its message followed by the worker's traceback instead of Ray's wrapper text."""
    cause = getattr(err, "cause", None)
    tb = str(getattr(cause, "remote_traceback", None) or getattr(err, "traceback_str", "") or "").rstrip()
    if isinstance(cause, FlowError):  # already a user-facing message
        return cause
    if not isinstance(cause, Exception):
        return WorkerError(f"{where}: the worker raised an exception that could not be sent back\n{tb}")
    message = f"{cause}\n--- in {where} ---\n{tb}"
    cls = type(cause)
    try:
        clean = type(cls.__name__, (cls,), {"__str__": lambda self: message, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__})
        out: BaseException = cls.__new__(clean)
        out.args = cause.args
        out.__dict__.update(cause.__dict__)
        return out
    except Exception:  # an exception class that cannot be subclassed like this
        return WorkerError(f"{type(cause).__name__}: {message}")

