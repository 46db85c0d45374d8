"""The contract between the single controller and backends (flowrl.runtime): everything the controller and the
fused-stage scheduler use of a worker group or a backend is declared here, and every backend implements all of
it. Nothing else is probed: a backend that lacks a capability says so through these fields, and the scheduler
declines with the reason (as a pass does), instead of silently losing fused stages or weight sync.

A backend (`backends/<name>/`, registered in `flowrl.backends`) decides where a group's ranks live (in-process,
threads, processes, Ray actors) and runs a call as `flowrl.runtime.dispatch` plans it: plan -> ranks -> merge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flowrl.ir.graph import Graph, Node

if TYPE_CHECKING:
    from flowrl.runtime.batch import Batch


class Future(Protocol):
    def result(self) -> Any: ...


class RankLostError(RuntimeError):
    """A rank of worker group `group` died during a call that the group cannot re-send by itself (a rank-by-rank
    call of a fused stage). The group is usable again after `recover()`; the caller re-runs its work."""

    def __init__(self, group: str, message: str):
        super().__init__(message)
        self.group = group


@dataclass(frozen=True)
class Usage:
    """One instance task of an elastic backend (`Backend.usage()`), what the cost report (flowrl.runtime.cost)
    charges: which pool, when it held its device (wall clock), and how that time went. `held_s` is what the
    cluster counted (the grant of its device to its return: `outside_s` is the part the task's own timers did
    not see, such as scheduling, argument transfer and the result's export), where the backend measured it."""

    pool: str  # the placement pool, or the stage kind (generation, inference, training) without one
    group: str
    pid: int
    began: float  # time.time() when the task started
    start_s: float  # building the models (a cold start; 0 when warm)
    load_s: float  # loading newer weights (from the object store, or back from host memory to the device)
    run_s: float  # the method itself
    cold: bool
    wait_s: float = 0.0  # a pre-warmed instance's time ready and waiting for its call (idle, held)
    prewarmed: bool = False  # started ahead of its stage
    ready_first: bool = False  # pre-warmed and ready before its call came: the stage did not wait for its start
    served: bool = True  # False: pre-warmed, then not needed (the call came before it was started, or never)
    device: str = ""  # where its models ran ("cuda:1", "cpu"; "" where the backend does not say)
    gpu: str = ""  # the GPU id the cluster assigned it ("" without one)
    kept_on_device: bool = False  # its models stayed on the device after it gave the device back: memory still held
    left_bytes: float = 0.0  # device memory it left allocated above what it found, giving the device back (CUDA)
    lost_s: float = 0.0  # an attempt whose process was lost: from its start to its retry's (the task re-ran)
    outside_s: float = 0.0  # held as the cluster counts it beyond the timers above (below 0: they saw more)
    # held_s is what the cluster counted (its records of the task came): True; False: the backend measures, but
    # this task's records never came, so its own timers' figures stand; None: the backend does not measure
    measured: bool | None = None

    @property
    def held_s(self) -> float:
        return self.start_s + self.load_s + self.wait_s + self.run_s + self.lost_s + self.outside_s

    @property
    def ahead_s(self) -> float:
        """Held before the call came: a pre-warmed instance's start-up, loading (a version newer than the one
        loaded ahead included) and waiting; 0 for an instance started by its call."""
        return self.start_s + self.load_s + self.wait_s if self.prewarmed else 0.0


@dataclass
class StreamedStage:
    """A fused gen-infer stage a group ran by itself (`WorkerGroup.stream_stage`): the rollout and each forward's
    output in sample order, the stage's metrics, and perf_counter times: when generation ended, and each
    forward's first and last chunk."""

    rollout: Batch
    outs: dict[str, Batch]
    metrics: dict[str, float]
    gen_end: float
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)


class WorkerGroup(Protocol):
    """SPMD ranks hosting some models (`ModelWorker`s).

    - `call` runs `ModelWorker.<method>(*args, **kwargs)` under `dispatch` ("split": data-parallel split of the
      batch and merge of the results; "broadcast": every rank gets the whole input, rank 0's result is returned;
      "rank0": only rank 0 runs), planned by `flowrl.runtime.dispatch`.
    - `on_rank` runs a method on one rank alone, pulling a stream (`generate_stream`, `resume_stream`) item by
      item: what the fused stage's scheduler drives (`per_rank` says whether the group can).
    - `inline`: its calls are plain calls on the caller's thread, in the controller's process (the local
      backend's one rank): nothing of it runs beside the controller's own work. Thread, process and Ray ranks
      run beside it (on threads of their own, in other processes, on other machines).
    - `colocated(models)`: those models live in one process per rank, so one call can train them together
      (fuse-train's interleaved schedule).
    - `recover()`: bring back dead ranks with the last weights they held (after a `RankLostError`).
    - `stream_stage(...)`: a group that cannot be driven rank by rank but streams a fused gen-infer stage on its
      own (the serverless pools: generation instances hand chunks to inference instances) runs it and returns
      a `StreamedStage`; None from every other group (the stage runs through `on_rank`, or unfused).
    """

    name: str
    world: int
    models: tuple[str, ...]
    inline: bool
    per_rank: bool
    why_not_per_rank: str  # the reason, when `per_rank` is False ("" otherwise)

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future: ...

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def colocated(self, models: Sequence[str]) -> bool: ...

    def recover(self) -> None: ...

    def stream_stage(self, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                     others: Mapping[str, WorkerGroup]) -> StreamedStage | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Backend(Protocol):
    """Where a plan runs. `after_update(model, group)` is called by the controller right after `model` was
    trained in `group`: it brings every other group holding `model` (split placement) up to date and returns
    the seconds it took (0.0 when no other group holds it, or when the groups share the weights in place).

    An asynchronous run (pass async-rollout) generates with older weights than it trains: `snapshot(model,
    group)` takes the weights `group` holds now (right after an update), `load_snapshot(model, group, weights)`
    loads them, later, into every other group holding `model` and returns the seconds it took. A backend whose
    groups share one copy of the weights cannot do that and says why in `why_not_async` ("" when it can)."""

    name: str
    why_not_async: str

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]: ...

    def begin_step(self, step: int) -> None:
        """The controller is about to run `step`: an elastic backend pre-warms the instances its stages will
        want from the step history; nothing for the others."""
        ...

    def after_update(self, model: str, group: str) -> float: ...

    def snapshot(self, model: str, group: str) -> Any: ...

    def load_snapshot(self, model: str, group: str, weights: Any) -> float: ...

    def metrics(self) -> dict[str, float]:
        """The backend's own figures since the last call, for the step's metrics (an elastic backend's scaling
        decisions); {} for the others."""
        ...

    def usage(self) -> Sequence[Usage] | None:
        """The instance tasks an elastic backend ran since the last call, for the cost report; None for a
        backend whose pools hold their devices the whole run."""
        ...

    def shutdown(self) -> None: ...


class Done:
    """An already-completed future (for groups that run calls synchronously)."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self._value, self._error = value, error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def done(fn: Any, *args: Any, **kwargs: Any) -> Done:
    """`fn(*args, **kwargs)` as a completed future; its exception surfaces at `result()`, like a remote call's."""
    try:
        return Done(fn(*args, **kwargs))
    except Exception as e:
        return Done(error=e)
