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

What is read is bounded by what is asked: `TaskClock` sends the GCS's own GetTaskEvents request (what
`ray.util.state.list_tasks(filters=[("task_id", "=", ...)])` sends through a dashboard, which flowrl's sessions do
not start and a joined cluster may not run), one a task, filtered by the task's id, which the GCS looks up in an
index: the pools tell the clock each task's id as they submit it (`track`). A read costs the step's tasks, not the
run's or the cluster's. Measured after 5,000 tasks of a run (2 busy cores, load 18-28): 10 tasks by id in 2-45
ms a read, where the whole table took 450-1,240 ms and a filter by task name (which the GCS answers by scanning
the job's events) 370-1,390 ms.
A task not tracked is asked for by its name and this driver's job.
Ray keeps a bounded number of task events (`task_events_max_num_task_in_gcs`) and may drop some on the way (each
reply counts this job's dropped events): a task whose events do not come, or whose events Ray said it dropped, is
charged by its own timers and said so (`Usage.measured` false; the cost report's `cost/measured_frac`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray

READY_TO_TASK_S = 0.5  # a worker whose first task came later than this after it was ready was not started for it
WAIT_S = 10.0  # how long `held` waits for a finished task's events before counting it as unmeasured
DROPPED_WAIT_S = 1.0  # ... and at most this long once Ray says it dropped events of this job meanwhile


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
    """Reads this run's task events from the GCS, asking for this driver's job and the named tasks only (no
    dashboard needed), and keeps the attempts it has read: a lease kept from one task to the next, or a worker
    started for a lease, links a task to the one before it on its worker, which an earlier read saw."""

    def __init__(self, prefix: str, wait_s: float = WAIT_S):
        self.prefix = prefix  # the names of this run's instance tasks start with it
        self.wait_s = wait_s  # how long `held` waits for a returned task's events
        self.job = ray.get_runtime_context().get_job_id()
        self.seen: dict[str, dict[int, Attempt]] = {}  # every attempt read so far: name -> attempt number -> it
        self.on: dict[str, dict[tuple[str, int], Attempt]] = {}  # the same by the worker that ran it
        self.workers: dict[str, tuple[float, float] | None] = {}  # worker -> (launched, ready), None: not launched
        self.charged: set[str] = set()  # workers whose start-up a task was charged (never twice)
        self.dropped = 0  # this job's task status events Ray reported dropped, as the last reply said
        self.ids: dict[str, bytes] = {}  # a tracked task's name -> its task id (until its held time is read)
        self._stub: Any = None

    def track(self, name: str, ref: Any) -> None:
        """Task `name` was submitted; `ref` is one of its results (it carries the task's id)."""
        self.ids[name] = ref.task_id().binary()

    def _query(self, names: Collection[str]) -> list[Any]:
        """One GetTaskEvents request a task (by its id where tracked, else this job's tasks of its name), sent
        together -> their replies."""
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        if self._stub is None:  # the GCS's own service, which ray.util.state reaches through a dashboard
            address = ray._private.worker.global_worker.gcs_client.address  # type: ignore[attr-defined]
            channel = init_grpc_channel(address, [("grpc.max_receive_message_length", 64 << 20)])
            self._stub = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(channel)
        equal = gcs_service_pb2.FilterPredicate.EQUAL  # type: ignore[attr-defined]  # generated, no stubs
        sent = []
        for name in names:  # the filters of a request all hold: one task a request
            request = gcs_service_pb2.GetTaskEventsRequest()  # type: ignore[attr-defined]
            if name in self.ids:  # looked up in the GCS's index of task ids
                task = request.filters.task_filters.add()
                task.task_id, task.predicate = self.ids[name], equal
            else:  # the job's events scanned for the name
                job = request.filters.job_filters.add()
                job.job_id, job.predicate = bytes.fromhex(self.job), equal
                named = request.filters.task_name_filters.add()
                named.task_name, named.predicate = name, equal
            request.filters.exclude_driver = True
            sent.append(self._stub.GetTaskEvents.future(request, timeout=30))
        return [f.result() for f in sent]

    def attempts(self, names: Collection[str]) -> list[Attempt]:
        """Every attempt of the tasks `names` (this run's) recorded so far; kept for later reads."""
        from ray.core.generated import common_pb2

        status = common_pb2.TaskStatus  # type: ignore[attr-defined]  # generated protobuf, no stubs
        out: list[Attempt] = []
        for reply in self._query([n for n in names if n.startswith(self.prefix)]):
            self.dropped = max(self.dropped, int(reply.num_status_task_events_dropped))
            for ev in reply.events_by_task:
                info = ev.task_info
                ts = ev.state_updates.state_ts_ns
                ended = [ts[s] for s in (status.Value("FINISHED"), status.Value("FAILED")) if s in ts]
                out.append(Attempt(
                    info.name, ev.attempt_number, ev.state_updates.worker_id.hex(),
                    f"{info.func_or_class_name}:{sorted(info.required_resources.items())}",
                    _at(ts, status.Value("PENDING_NODE_ASSIGNMENT")), _at(ts, status.Value("SUBMITTED_TO_WORKER")),
                    min(ended) / 1e9 if ended else None))
        out = settled(out)
        for a in out:
            old = self.seen.setdefault(a.name, {}).get(a.attempt)
            if old is not None:  # read again: its worker may be known now
                self.on.get(old.worker, {}).pop((a.name, a.attempt), None)
            self.seen[a.name][a.attempt] = a
            self.on.setdefault(a.worker, {})[(a.name, a.attempt)] = a
        return out

    def started(self, workers: Collection[str]) -> dict[str, tuple[float, float]]:
        """Worker (hex id) -> (when the raylet launched its process, when it was ready: wall clock), for those
        of `workers` that a raylet launched (not drivers); each read once."""
        from ray._raylet import WorkerID
        from ray.core.generated import gcs_pb2

        accessor = ray._private.state.state._connect_and_get_accessor()
        for worker in set(workers) - set(self.workers) - {""}:
            raw = accessor.get_worker_info(WorkerID(bytes.fromhex(worker)))
            w = gcs_pb2.WorkerTableData.FromString(raw) if raw else None  # type: ignore[attr-defined]
            launched = w is not None and 0 < w.worker_launch_time_ms < 2**62 and w.worker_launched_time_ms < 2**62
            self.workers[worker] = (w.worker_launch_time_ms / 1e3, w.worker_launched_time_ms / 1e3) \
                if w is not None and launched else None
        return {k: v for k in workers if (v := self.workers.get(k)) is not None}

    def held(self, names: Collection[str], wait_s: float | None = None) -> tuple[dict[str, list[float]], list[str]]:
        """(seconds held by each attempt of each of `names`, the names whose events did not come within
        `wait_s`, or that Ray said it dropped) for tasks that have returned: each one's last attempt ended and
        every attempt was granted. Polled at 10 ms, then less often (up to 0.2 s), asking only for the names
        still incomplete; once Ray says it dropped events of this job meanwhile, at most DROPPED_WAIT_S more."""
        names = set(names)
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        dropped, delay, missing = self.dropped, 0.01, sorted(names)
        while True:
            self.attempts(missing)
            mine = [a for n in names for a in self.seen.get(n, {}).values()]
            missing = _incomplete(mine, names)
            if not missing or time.monotonic() >= deadline:
                break  # (events that never come: those tasks are charged by their own timers)
            if self.dropped > dropped:  # some may be among the dropped: not worth the whole wait
                deadline, dropped = min(deadline, time.monotonic() + DROPPED_WAIT_S), self.dropped
            time.sleep(delay)  # the driver reports its events every RAY_task_events_report_interval_ms
            delay = min(2 * delay, 0.2)
        workers = {a.worker for a in mine if a.done}
        launches = {w: t for w, t in self.started(workers).items() if w not in self.charged}
        context: dict[tuple[str, int], Attempt] = {}
        for w in workers:  # what came before on their workers: the attempt before the first of these (a lease
            # kept for them), or all of a worker's (its first task is charged its start-up) where it is new
            hist = sorted((a for a in self.on[w].values() if a.done), key=lambda a: a.granted or 0.0)
            first = next(i for i, a in enumerate(hist) if a.name in names)
            context.update({(a.name, a.attempt): a for a in hist[0 if w in launches else max(0, first - 1):]})
        if launches:  # a worker launched while a task of the run waited for its grant (any worker's)
            since = min(t[0] for t in launches.values())
            context.update({(a.name, a.attempt): a for each in self.seen.values() for a in each.values()
                            if a.done and (a.granted or 0.0) >= since})
        held = held_by_attempt(context.values(), launches)
        self.charged.update(w for w in launches
                            if min((a for a in context.values() if a.worker == w),
                                   key=lambda a: a.granted or 0.0).name in names)
        for n in names:
            self.ids.pop(n, None)
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
