"""Device-time as the cluster counts it (serverless backend, for the cost report): how long Ray had each instance
task's resources reserved for it, read from Ray's task events, not from timers inside the task.

A task's device slot is reserved from the moment Ray grants its lease until the lease goes back: argument
transfer, module imports, the result's export and a lost attempt's last moments included, none of which the
instance's own timers see. Ray's owner (here, the driver) records each task attempt's state transitions with
their wall-clock times and reports them to the GCS, which keeps them without a dashboard (what `ray.timeline()`
reads): PENDING_NODE_ASSIGNMENT (asking for resources), SUBMITTED_TO_WORKER (the lease granted, the task pushed
to its worker), RUNNING, FINISHED or FAILED. An attempt holds its slot from SUBMITTED_TO_WORKER to FINISHED or
FAILED.

Two reservations that no attempt's own events show are counted too:
- Ray keeps a leased worker, and its resources, for the next task of the same shape (function and resources)
  when that task was already waiting as the last one ended: the slot is never given back between the two. That
  gap (from the first's end to the second's grant, on the same worker) is charged to the second task; a task
  that was not yet waiting when the worker freed up got a new lease (the slot was free in between).
- A lease that needs a new worker process holds its resources while the raylet starts that process (Python and
  Ray: most of a second here), and the owner pushes whichever task of the shape is waiting when it is ready
  (maybe not the one that asked for it: another lease may have freed up first). A worker launched while one of
  the run's tasks was waiting for its grant, whose first task came within READY_TO_TASK_S of its being ready
  (the GCS worker table's `worker_launch_time_ms`, `worker_launched_time_ms`), is counted from its launch,
  charged to that first task. Workers Ray starts on its own (its pool at start-up, or ahead of a backlog of
  requests, holding nothing) run no task that soon, or none.

Measured against a second driver sampling `ray.available_resources()` every 10 ms on the same cluster, over the
same run: tests/ray/test_serverless_held.py. The driver reports its task events every
`RAY_task_events_report_interval_ms` (Ray's default 1000; flowrl's Session sets 20 before it starts or joins
Ray), so a step's tasks are there within tens of milliseconds of their end: `TaskClock.held` waits for them.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import ray

READY_TO_TASK_S = 0.5  # a worker whose first task came later than this after it was ready was not started for it
WAIT_S = 10.0  # how long `held` waits for a finished task's events before counting it as unmeasured


@dataclass(frozen=True)
class Attempt:
    """One attempt of a task, as Ray's task events tell it (wall-clock seconds; None: not reached)."""

    name: str  # the task's name: its instance's ledger token
    attempt: int
    worker: str  # the worker (process) that ran it, hex ("" before a lease)
    shape: str  # the function and resources: tasks of one shape can reuse a lease
    queued: float | None  # PENDING_NODE_ASSIGNMENT: asking for its resources
    granted: float | None  # SUBMITTED_TO_WORKER: the lease granted, the slot reserved
    ended: float | None  # FINISHED or FAILED: the lease goes back (unless the next task of its shape takes it)

    @property
    def done(self) -> bool:
        return self.granted is not None and self.ended is not None


def held_by_task(attempts: Iterable[Attempt], started: Mapping[str, tuple[float, float]] | None = None
                 ) -> dict[str, float]:
    """Seconds each task (by name) had its resources reserved, all its attempts together (`held_by_attempt`)."""
    return {name: sum(each) for name, each in held_by_attempt(attempts, started).items()}


def held_by_attempt(attempts: Iterable[Attempt], started: Mapping[str, tuple[float, float]] | None = None
                    ) -> dict[str, list[float]]:
    """Seconds each task's attempts (by name, in attempt order) had their resources reserved: every attempt's
    grant to end, plus, where the next task of the same shape on the same worker was already waiting when an
    attempt ended (Ray kept the lease), the gap to its grant, charged to that next task; plus, with `started`
    (worker -> when its process was launched and when it was ready), a worker's start-up for a lease, charged to
    the task that waited longest when it was launched, and the wait from ready to its first task's grant, charged
    to that task when it was waiting by then (the module docstring). Attempts not yet granted or ended count
    nothing."""
    done = sorted((a for a in attempts if a.done), key=lambda a: (a.worker, a.granted))
    held: dict[tuple[str, int], float] = {(a.name, a.attempt): 0.0 for a in done}
    firsts: dict[str, Attempt] = {}
    for prev, a in zip([None, *done], done, strict=False):
        assert a.granted is not None and a.ended is not None
        held[(a.name, a.attempt)] += a.ended - a.granted
        if (prev is not None and prev.worker == a.worker and prev.shape == a.shape and prev.ended is not None
                and a.queued is not None and a.queued <= prev.ended <= a.granted):
            held[(a.name, a.attempt)] += a.granted - prev.ended  # the lease kept for it: the slot never went back
        firsts.setdefault(a.worker, a)
    for worker, (launch, ready) in (started or {}).items():
        f = firsts.get(worker)
        if f is None or f.granted is None or f.granted - ready > READY_TO_TASK_S:
            continue  # ran none of the run's tasks, or idle long after it was ready: not started for a lease
        if any(w.queued is not None and w.granted is not None and w.queued <= launch < w.granted for w in done):
            held[(f.name, f.attempt)] += max(0.0, f.granted - launch)  # the lease's slot, while it started
    out: dict[str, list[float]] = {}
    for name, attempt in sorted(held):
        out.setdefault(name, []).append(held[(name, attempt)])
    return out


class TaskClock:
    """Reads this driver's task events from the GCS (the accessor `ray.timeline()` uses; no dashboard needed)."""

    def __init__(self, prefix: str):
        self.prefix = prefix  # the names of this run's instance tasks start with it
        self.job = ray.get_runtime_context().get_job_id()

    def attempts(self) -> list[Attempt]:
        """Every attempt of this run's named tasks recorded so far (this job's, names under `prefix`)."""
        from ray.core.generated import common_pb2, gcs_pb2

        status = common_pb2.TaskStatus  # type: ignore[attr-defined]  # generated protobuf, no stubs
        # not a public API (ray._private.state is what ray.timeline() reads), pinned by the tests against Ray's own
        # resource accounting
        accessor = ray._private.state.state._connect_and_get_accessor()
        out: list[Attempt] = []
        for raw in accessor.get_task_events():
            ev = gcs_pb2.TaskEvents.FromString(raw)  # type: ignore[attr-defined]
            info = ev.task_info
            if ev.job_id.hex() != self.job or not info.name.startswith(self.prefix):
                continue
            ts = ev.state_updates.state_ts_ns
            ended = [ts[s] for s in (status.Value("FINISHED"), status.Value("FAILED")) if s in ts]
            out.append(Attempt(
                info.name, ev.attempt_number, ev.state_updates.worker_id.hex(),
                f"{info.func_or_class_name}:{sorted(info.required_resources.items())}",
                _at(ts, status.Value("PENDING_NODE_ASSIGNMENT")), _at(ts, status.Value("SUBMITTED_TO_WORKER")),
                min(ended) / 1e9 if ended else None))
        return settled(out)

    def started(self) -> dict[str, tuple[float, float]]:
        """Worker (hex id) -> (when the raylet launched its process, when it was ready: wall clock), for this
        job's workers that a raylet launched (not drivers)."""
        from ray.core.generated import gcs_pb2

        accessor = ray._private.state.state._connect_and_get_accessor()
        out = {}
        for raw in accessor.get_worker_table():
            w = gcs_pb2.WorkerTableData.FromString(raw)  # type: ignore[attr-defined]
            mine = not w.job_id or w.job_id.hex() == self.job  # a worker process serves one job
            if mine and 0 < w.worker_launch_time_ms < 2**62 and w.worker_launched_time_ms < 2**62:  # drivers: none
                out[w.worker_address.worker_id.hex()] = (w.worker_launch_time_ms / 1e3,
                                                         w.worker_launched_time_ms / 1e3)
        return out

    def held(self, names: Collection[str], wait_s: float = WAIT_S) -> tuple[dict[str, list[float]], list[str]]:
        """(seconds held by each attempt of each of `names`, the names whose events did not come within
        `wait_s`) for tasks that have returned: each one's last attempt ended and every attempt was granted."""
        deadline = time.monotonic() + wait_s
        while True:
            got = self.attempts()
            missing = _incomplete(got, names)
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # the driver reports its events every RAY_task_events_report_interval_ms
        held = held_by_attempt(got, self.started())
        return {n: held[n] for n in names if n in held and n not in missing}, missing


def settled(attempts: Sequence[Attempt]) -> list[Attempt]:
    """`attempts` with each attempt that a later attempt of its task superseded ended (when it has no end of
    its own) where the retry asked for its resources: its worker was lost, and Ray gave its slot back then."""
    retried: dict[tuple[str, int], float] = {}
    for a in attempts:
        if a.queued is not None:
            retried[(a.name, a.attempt - 1)] = a.queued
    return [replace(a, ended=retried[(a.name, a.attempt)])
            if a.ended is None and a.granted is not None and (a.name, a.attempt) in retried else a for a in attempts]


def _at(ts: Mapping[int, int], state: int) -> float | None:
    return ts[state] / 1e9 if state in ts else None


def _incomplete(attempts: Sequence[Attempt], names: Collection[str]) -> list[str]:
    """The names whose task has no attempt yet, or an attempt not yet granted and ended."""
    seen: dict[str, bool] = {}
    for a in attempts:
        if a.name in names:
            seen[a.name] = seen.get(a.name, True) and a.done
    return [n for n in names if not seen.get(n, False)]
