"""The devices a serverless run's instances hold, counted by its driver, so that nothing waits holding a device
that what it waits for may need (a deadlock on a cluster with few devices).

A task blocked in `ray.get` gives its CPU back to Ray but keeps its device (a GPU share or a `device_slot`), and
three kinds of instance wait that way: a pre-warmed instance for its call, a migration sink for its sources'
words, a fused stage's forward instance for its chunks. (A deduplicated prefill's taker waits for its owner no
longer than computing the prefix itself would take: it cannot hang.) The rules, all in the driver:
- instances that wait on one another (a migrating generation's sources and sink, a streamed stage's generation
  and forward instances) are started only as many as there are devices for now (`room`), so Ray grants them all
  at once and every one that waits has its peers running;
- a call that finds fewer devices free than it asks for first tells the other pools' pre-warmed instances that
  they are not needed (`make_room`): they return at once and give their devices back, so an idle instance never
  keeps a call from starting;
- pre-warming starts no more instances than there are free devices (`room`).
Each pool asks for one resource (`Devices.resource`: GPU or device_slot) in its own amount (a whole GPU, a
`gpu_fraction` of one, one slot); what is free of a resource is the cluster's total of it *now* (read at each
decision: a cluster that grows is counted as it grows, and one scaled to zero has none, so nothing that waits on
a peer starts beyond one instance until the autoscaler has added a node) less what this run's tasks that have not
returned ask for. Another driver's tasks on a shared cluster are not seen (a joined run fails with
`acquire_timeout`'s error rather than hang).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from flowrl.backends.serverless.devices import SLOT, line_at
from flowrl.backends.serverless.held import TaskClock
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import PoolDecl, Range

# a pool's pre-warmed instances waiting for their call: told they are not needed -> the stats refs of those told
Yield = Callable[[], list[Any]]


def cluster_total(resource: str) -> float:
    """The cluster's total of `resource` now (its alive nodes')."""
    return float(ray.cluster_resources().get(resource, 0.0))


class Slots:
    """The run's devices as its pools hold them: each pool's ask (resource, amount an instance), its tasks not
    yet returned, and the cluster's totals as `capacity` reads them (the live cluster by default)."""

    def __init__(self, capacity: Callable[[str], float] = cluster_total):
        self.capacity = capacity
        self.lock = threading.Lock()
        self.asks: dict[str, tuple[str, float]] = {}  # pool -> (the resource an instance takes, how much of it)
        self.out: dict[Any, str] = {}  # a task's stats ref -> its pool, for each task not yet returned
        self.leaving: set[Any] = set()  # pre-warmed instances told they are not needed: about to return
        self.yielders: dict[str, Yield] = {}
        self.keepers: list[Callable[[], None]] = []

    def register(self, pool: str, ask: tuple[str, float], yielder: Yield, keeper: Callable[[], None]) -> None:
        """`pool`'s ask (resource, amount an instance) and its ways to release its idle pre-warmed instances
        and to start its lower bound's again."""
        with self.lock:
            self.asks[pool] = ask
            self.yielders[pool] = yielder
            self.keepers.append(keeper)

    def refill(self) -> None:
        """A call returned: every pool starts again the instances of its lower bound it let go (as devices allow)."""
        with self.lock:
            keepers = list(self.keepers)
        for keep in keepers:  # outside the lock: a keeper takes its pool's lock, then this one's (room)
            keep()

    def forget(self) -> None:
        """After the run: drop the references to the tasks' results (and the pools' callbacks)."""
        with self.lock:
            self.out, self.leaving, self.yielders, self.keepers = {}, set(), {}, []

    def taken(self, pool: str, ref: Any) -> None:
        """A task of `pool` was submitted: it holds (or waits for) its device until `ref` (its stats) is ready."""
        with self.lock:
            self.out[ref] = pool

    def _free(self, beside: Mapping[str, int]) -> dict[str, float]:
        """What is free of each resource the pools ask for: the cluster's total now less what this run's tasks
        that have not returned hold or ask for (those leaving aside) and what `beside` (pool -> instances to be
        started with the one asking) will take."""
        if self.out:
            refs = list(self.out)
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            for ref in done:
                self.out.pop(ref, None)
                self.leaving.discard(ref)
        free = {resource: self.capacity(resource) for resource, _ in self.asks.values()}
        taking = [(p, 1) for r, p in self.out.items() if r not in self.leaving] + list(beside.items())
        for pool, n in taking:
            resource, amount = self.asks[pool]
            free[resource] -= n * amount
        return free

    def _room(self, pool: str, want: int, beside: Mapping[str, int], mine: int) -> int:
        free = self._free(beside)
        resource, amount = self.asks[pool]
        free[resource] += mine * amount  # held by the pool's own waiting instances, which the call takes
        if any(v < -1e-9 for v in free.values()):
            return 0  # the instances beside it cannot all start now
        return max(0, min(want, int(free[resource] / amount + 1e-9)))

    def room(self, pool: str, want: int, beside: Mapping[str, int] | None = None, mine: int = 0) -> int:
        """How many of `want` instances of `pool` can hold their devices at once now, with `beside` (pool ->
        instances) started at the same time; `mine`: the pool's own idle pre-warmed instances, which count as
        its (they hold their devices already)."""
        with self.lock:
            return self._room(pool, want, beside or {}, mine)

    def make_room(self, pool: str, want: int, beside: Mapping[str, int] | None = None, mine: int = 0) -> int:
        """`room`, after releasing the other pools' idle pre-warmed instances when fewer devices are free than
        `pool` (and `beside`) want."""
        with self.lock:
            short = self._room(pool, want, beside or {}, mine) < want
            yielders = [y for p, y in self.yielders.items() if p != pool] if short else []
        for y in yielders:  # outside the lock: a yielder takes its pool's own lock
            let_go = y()
            with self.lock:
                self.leaving.update(r for r in let_go if r in self.out)
        return self.room(pool, want, beside, mine)


@dataclass(frozen=True)
class Acquire:
    """`run { acquire_timeout }` on a cluster flowrl joined: a pool that cannot get its lower bound of devices
    within `timeout_s` fails with an error naming it, what it asked for and what the cluster has, instead of
    waiting for good. (A local Ray instance flowrl started is sized to the flow: nothing to wait for there.)"""

    timeout_s: float
    clock: TaskClock
    pools: Mapping[str, PoolDecl]  # the flow's pools by name

    def lower_bounds(self, asked: Mapping[str, Mapping[str, float]]) -> None:
        """Before the run: every pool's lower bound fits in the cluster's devices (`asked`: pool -> what one of
        its instances takes), waiting at most `timeout_s` for an autoscaling cluster to add them. Nothing of the
        run asks for them yet, so the autoscaler is told what to add (`request_resources`, Ray's call for it: the
        lower bounds' instances as bundles); the request is withdrawn once they fit or the wait ends."""
        pools = [p for p in self.pools.values() if p.name in asked]
        need = {p.name: p.gpus.lo for p in pools if isinstance(p.gpus, Range) and p.gpus.lo > 0}
        if not need or all(need[p] <= _holds(asked[p]) for p in need):
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[dict(asked[p]) for p, n in need.items() for _ in range(n)])
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                short = [p for p in pools if need.get(p.name, 0) > _holds(asked[p.name])]
                if not short or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)  # an autoscaler adds nodes in seconds to minutes: polled, not raced
        finally:
            request_resources()  # withdrawn: from here on the run's own tasks are the demand
        if short:
            p = short[0]
            raise FlowError(_unmet(p, need[p.name], asked[p.name], self.timeout_s))

    def granted(self, name: str, tokens: Sequence[str], refs: Sequence[Any], asked: Mapping[str, float]) -> None:
        """During a call: once `timeout_s` passed without every instance returning, at least one of them (the
        pool's lower bound, at most all of them) must have been granted its device; else the error."""
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout_s, fetch_local=False)
        if len(ready) == len(refs):
            return
        pool = self.pools.get(name)
        lower = pool.gpus.lo if pool is not None and isinstance(pool.gpus, Range) else 1
        want = max(1, min(lower, len(tokens)))
        got = {a.name for a in self.clock.attempts(tokens) if a.granted is not None}
        done = {t for t, r in zip(tokens, refs, strict=True) if r in ready}
        if len(got | done) >= want:
            return
        raise FlowError(_unmet(pool, want, asked, self.timeout_s, name))


def _device_of(asked: Mapping[str, float]) -> str:
    """The resource that stands for an instance's device in what it asks for: GPU, or the logical slot."""
    return next((k for k in asked if k != "CPU"), SLOT)


def _holds(asked: Mapping[str, float]) -> float:
    """How many instances asking `asked` the cluster's devices hold now."""
    device = _device_of(asked)
    return cluster_total(device) / asked[device]


def _unmet(pool: PoolDecl | None, want: int, asked: Mapping[str, float], timeout_s: float,
           group: str = "") -> Diagnostic:
    name = pool.name if pool is not None else group
    device = _device_of(asked)
    total, free = ray.cluster_resources(), ray.available_resources()
    each = ", ".join(f"{k}: {v:g}" for k, v in asked.items())
    line = line_at(pool.loc) if pool is not None else None
    what = "GPU(s)" if device != SLOT else "device slot(s)"
    add = ("add nodes with GPUs (or let the autoscaler: a node type with `GPU`)" if device != SLOT else
           f"add nodes with --resources '{{\"{SLOT}\": N}}'")
    return Diagnostic(
        f"pool `{name}` could not get {want} {what} within {timeout_s:g}s (each instance asks for "
        f"{{{each}}}); the Ray cluster has {total.get(device, 0.0):g} `{device}` ({free.get(device, 0.0):g} free) and "
        f"{total.get('CPU', 0.0):g} CPU ({free.get('CPU', 0.0):g} free)",
        pool.loc if pool is not None else None,
        hint=f"lower the pool's lower bound (`gpus = LO..HI`), {add}, or wait longer (`run {{ acquire_timeout = "
             "SECONDS }`)",
        source_line=line)
