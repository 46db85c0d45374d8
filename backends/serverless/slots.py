"""The device slots a serverless run's instances hold, counted by its driver, so that nothing waits holding a
slot that what it waits for may need (a deadlock on a cluster with few slots).

A task blocked in `ray.get` gives its CPU back to Ray but keeps its custom resource, and three kinds of instance
wait that way: a pre-warmed instance for its call, a migration sink for its sources' words, a fused stage's
forward instance for its chunks. (A deduplicated prefill's taker waits for its owner no longer than computing
the prefix itself would take: it cannot hang.) The rules, all in the driver:
- instances that wait on one another (a migrating generation's sources and sink, a streamed stage's generation
  and forward instances) are started only as many as there are slots for now (`room`), so Ray grants them all
  at once and every one that waits has its peers running;
- a call that finds fewer slots free than it asks for first tells the other pools' pre-warmed instances that
  they are not needed (`make_room`): they return at once and give their slots back, so an idle instance never
  keeps a call from starting;
- pre-warming starts no more instances than there are free slots (`room`).
The count is the slots of the cluster when the run started (`total`; None where it has none yet, an autoscaling
cluster scaled to zero: then nothing is capped) less this run's tasks that have not returned; another driver's
tasks on a shared cluster are not seen (a joined run fails with `acquire_timeout`'s error rather than hang).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from flowrl.backends.serverless.held import TaskClock
from flowrl.backends.serverless.instance import SLOT
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import PoolDecl, Range

# a pool's pre-warmed instances waiting for their call: told they are not needed -> the stats refs of those told
Yield = Callable[[], list[Any]]


class Slots:
    def __init__(self, total: int | None):
        self.total = total if total else None
        self.lock = threading.Lock()
        self.out: dict[Any, str] = {}  # a task's stats ref -> its pool, for each task not yet returned
        self.leaving: set[Any] = set()  # pre-warmed instances told they are not needed: about to return
        self.yielders: dict[str, Yield] = {}
        self.keepers: list[Callable[[], None]] = []

    def register(self, pool: str, yielder: Yield, keeper: Callable[[], None]) -> None:
        """`pool`'s ways to release its idle pre-warmed instances, and to start its lower bound's again."""
        with self.lock:
            self.yielders[pool] = yielder
            self.keepers.append(keeper)

    def refill(self) -> None:
        """A call returned: every pool starts again the instances of its lower bound it let go (as slots allow)."""
        with self.lock:
            keepers = list(self.keepers)
        for keep in keepers:  # outside the lock: a keeper takes its pool's lock, then this one's (room)
            keep()

    def forget(self) -> None:
        """After the run: drop the references to the tasks' results (and the pools' callbacks)."""
        with self.lock:
            self.out, self.leaving, self.yielders, self.keepers = {}, set(), {}, []

    def taken(self, pool: str, ref: Any) -> None:
        """A task of `pool` was submitted: it holds (or waits for) a slot until `ref` (its stats) is ready."""
        with self.lock:
            self.out[ref] = pool

    def _busy(self) -> int:
        """Slots held or asked for by this run's tasks that have not returned (those leaving aside)."""
        if not self.out:
            return 0
        refs = list(self.out)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for ref in done:
            self.out.pop(ref, None)
            self.leaving.discard(ref)
        return len(self.out) - len(self.leaving)

    def room(self, want: int) -> int:
        """How many of `want` instances can be granted now (`want` where the cluster's slots are not known)."""
        with self.lock:
            if self.total is None:
                return want
            return max(0, min(want, self.total - self._busy()))

    def make_room(self, pool: str, want: int) -> int:
        """Before `pool` starts `want` instances: when fewer slots are free, the other pools' idle pre-warmed
        instances are released -> the slots free for it now (at most `want`; `want` where not known)."""
        with self.lock:
            if self.total is None:
                return want
            free = self.total - self._busy()
            yielders = [y for p, y in self.yielders.items() if p != pool] if free < want else []
        for y in yielders:  # outside the lock: a yielder takes its pool's own lock
            let_go = y()
            with self.lock:
                self.leaving.update(r for r in let_go if r in self.out)
        return self.room(want)


@dataclass(frozen=True)
class Acquire:
    """`run { acquire_timeout }` on a cluster flowrl joined: a pool that cannot get its lower bound of device
    slots within `timeout_s` fails with an error naming it, what it asked for and what the cluster has, instead
    of waiting for good. (A local Ray instance flowrl started is sized to the flow: nothing to wait for there.)"""

    timeout_s: float
    clock: TaskClock
    pools: Mapping[str, PoolDecl]  # the flow's pools by name

    def lower_bounds(self, asked: Mapping[str, float]) -> None:
        """Before the run: every pool's lower bound fits in the cluster's slots, waiting at most `timeout_s` for
        an autoscaling cluster to add them."""
        pools = list(self.pools.values())
        need = {p.name: p.gpus.lo for p in pools if isinstance(p.gpus, Range) and p.gpus.lo > 0}
        if not need:
            return
        deadline = time.monotonic() + self.timeout_s
        device = _device_of(asked)
        while True:
            have = float(ray.cluster_resources().get(device, 0.0)) / asked[device]  # instances it holds
            short = [p for p in pools if need.get(p.name, 0) > have]
            if not short or time.monotonic() >= deadline:
                break
            time.sleep(0.1)  # an autoscaler adds nodes in seconds to minutes: polled, not raced
        if short:
            p = short[0]
            raise FlowError(_unmet(p, need[p.name], asked, self.timeout_s))

    def granted(self, name: str, tokens: Sequence[str], refs: Sequence[Any], asked: Mapping[str, float]) -> None:
        """During a call: once `timeout_s` passed without every instance returning, at least one of them (the
        pool's lower bound, at most all of them) must have been granted its slot; else the error."""
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout_s, fetch_local=False)
        if len(ready) == len(refs):
            return
        pool = self.pools.get(name)
        lower = pool.gpus.lo if pool is not None and isinstance(pool.gpus, Range) else 1
        want = max(1, min(lower, len(tokens)))
        got = {a.name for a in self.clock.attempts() if a.granted is not None} & set(tokens)
        done = {t for t, r in zip(tokens, refs, strict=True) if r in ready}
        if len(got | done) >= want:
            return
        raise FlowError(_unmet(pool, want, asked, self.timeout_s, name))


def _device_of(asked: Mapping[str, float]) -> str:
    """The resource that stands for an instance's device in what it asks for: GPU, or the logical slot."""
    return next((k for k in asked if k != "CPU"), SLOT)


def _unmet(pool: PoolDecl | None, want: int, asked: Mapping[str, float], timeout_s: float,
           group: str = "") -> Diagnostic:
    name = pool.name if pool is not None else group
    device = _device_of(asked)
    total, free = ray.cluster_resources(), ray.available_resources()
    each = ", ".join(f"{k}: {v:g}" for k, v in asked.items())
    line = None
    if pool is not None and Path(pool.loc.path).is_file():
        lines = Path(pool.loc.path).read_text(encoding="utf-8").splitlines()
        line = lines[pool.loc.line - 1] if 0 < pool.loc.line <= len(lines) else None
    return Diagnostic(
        f"pool `{name}` could not get {want} device slot(s) within {timeout_s:g}s (each instance asks for "
        f"{{{each}}}); the Ray cluster has {total.get(device, 0.0):g} `{device}` ({free.get(device, 0.0):g} free) and "
        f"{total.get('CPU', 0.0):g} CPU ({free.get('CPU', 0.0):g} free)",
        pool.loc if pool is not None else None,
        hint=f"lower the pool's lower bound (`gpus = LO..HI`), add nodes with --resources '{{\"{SLOT}\": N}}', or "
             "wait longer (`run { acquire_timeout = SECONDS }`)",
        source_line=line)
