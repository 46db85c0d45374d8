"""Device-time as the cluster counts it (serverless backend, for the cost report): how long Ray had each instance
task's resources reserved for it, read from Ray's task events, not from timers inside the task.

A task's device slot is reserved from the moment Ray grants its lease until the lease goes back: argument
transfer, module imports, the result's export and a lost attempt's last moments included, none of which the
instance's own timers see. Ray's owner (here, the driver) records each task attempt's state transitions with
their wall-clock times and reports them to the GCS, which keeps them without a dashboard (what `ray.timeline()`
reads): PENDING_NODE_ASSIGNMENT (asking for resources), SUBMITTED_TO_WORKER (the lease granted, the task pushed
to its worker), RUNNING, FINISHED or FAILED. An attempt holds its slot from SUBMITTED_TO_WORKER to FINISHED or
FAILED.

Ray keeps a leased worker, and its resources, for the next task of the same shape (function and resources)
when that task was already waiting as the last one ended: the slot is never given back between the two. That
gap (from the first's end to the second's grant, on the same worker) is counted, charged to the second task;
a task that was not yet waiting when the worker freed up got a new lease (the slot was free in between).

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


def held_by_task(attempts: Iterable[Attempt]) -> dict[str, float]:
    """Seconds each task (by name) had its resources reserved: every attempt's grant to end, plus, where the
    next task of the same shape on the same worker was already waiting when an attempt ended (Ray kept the
    lease), the gap to its grant, charged to that next task. Attempts not yet granted or ended count nothing."""
    done = sorted((a for a in attempts if a.done), key=lambda a: (a.worker, a.granted))
    out: dict[str, float] = {}
    for prev, a in zip([None, *done], done, strict=False):
        assert a.granted is not None and a.ended is not None
        held = a.ended - a.granted
        if (prev is not None and prev.worker == a.worker and prev.shape == a.shape and prev.ended is not None
                and a.queued is not None and a.queued <= prev.ended <= a.granted):
            held += a.granted - prev.ended  # the lease kept for it: the slot never went back
        out[a.name] = out.get(a.name, 0.0) + held
    return out


class TaskClock:
    """Reads this driver's task events from the GCS (the accessor `ray.timeline()` uses; no dashboard needed)."""

    def __init__(self, prefix: str):
        self.prefix = prefix  # the names of this run's instance tasks start with it
        self.job = ray.get_runtime_context().get_job_id()

    def attempts(self) -> list[Attempt]:
        """Every attempt of this run's named tasks recorded so far (this job's, names under `prefix`)."""
        from ray.core.generated import common_pb2, gcs_pb2

        status = common_pb2.TaskStatus
        # not a public API (ray._private.state is what ray.timeline() reads), pinned by the tests against Ray's own
        # resource accounting
        accessor = ray._private.state.state._connect_and_get_accessor()
        out: list[Attempt] = []
        for raw in accessor.get_task_events():
            ev = gcs_pb2.TaskEvents.FromString(raw)
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

    def held(self, names: Collection[str], wait_s: float = WAIT_S) -> tuple[dict[str, float], list[str]]:
        """(seconds held by each of `names`, the names whose events did not come within `wait_s`) for tasks
        that have returned: each one's last attempt ended and every attempt was granted."""
        deadline = time.monotonic() + wait_s
        while True:
            got = self.attempts()
            missing = _incomplete(got, names)
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # the driver reports its events every RAY_task_events_report_interval_ms
        held = held_by_task(got)
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
