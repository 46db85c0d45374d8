"""Pre-warming a serverless pool from its step history: a timer thread that starts the instances a group's first
call of a step will want, so that they are ready `margin_s` before the earliest that call has come.

A pre-warmed instance is an `instance.prewarm` task: it builds and loads its models, then waits (holding its
device, idle) for the call the driver puts in its Mailbox box. A pool with a lower bound (`gpus = LO..HI`, LO > 0)
keeps LO instances waiting all along (`floor`: held and counted), started again after each call takes them.
Nothing starts beyond the run's free device slots, and waiting instances make way for another pool's call that
finds none free (`yield_idle`; backends/serverless/slots.py). The step's first call takes the waiting
instances (`arrived`); at the next step those it did not take are told they are not needed (`release`), and
their usage is read once they have returned (`returned`). The timer thread and the controller meet under this
object's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from flowrl.backends.serverless.instance import Build, remote_prewarm
from flowrl.backends.serverless.slots import Slots
from flowrl.elastic.prewarm import learn_start, prewarm_plan
from flowrl.runtime.protocol import Usage


@dataclass(frozen=True)
class Warm:
    """A pre-warmed instance: its mailbox box and its task's results."""

    box: str
    refs: list[ray.ObjectRef]


class Prewarmer:
    """One pool's pre-warming. `wanted()` gives the model versions an instance started now should load;
    `options` the task's Ray resources (the same as the pool's other instance tasks)."""

    def __init__(self, key: tuple[str, str], build: Build, mailbox: Any, margin_s: float, enabled: bool,
                 boxes: Iterator[int], wanted: Callable[[], Mapping[str, Any]], options: Mapping[str, Any],
                 slots: Slots | None = None, floor: int = 0, track: Callable[[str, Any], None] | None = None):
        self.key, self.build, self.mailbox, self.margin_s = key, build, mailbox, margin_s
        self.enabled = enabled
        self.boxes, self.wanted, self.options = boxes, wanted, dict(options)
        self.lock = threading.Lock()  # the timer thread starts instances while the controller calls
        self.offsets: list[float] = []  # per step: seconds from step start to the group's first call
        self.needed = 0  # instances the last first call used, when it had to build models (0: all were warm)
        self.ready_s = 0.0  # how long a cold instance took to build and load (the last measured)
        self.step_began: float | None = None
        self.first_pending = False  # the step's first call has not come yet
        self.timer: threading.Timer | None = None
        self.warm: list[Warm] = []  # started, waiting for their call
        self.unused: list[tuple[Warm, str]] = []  # told they are not needed; their usage not yet taken
        self.first_method = "generate"  # the method of the step's first call (its pool counts unused instances)
        self.slots = slots  # the run's device slots: never start more than are free (backends/serverless/slots.py)
        self.floor = floor  # instances kept warm all along (the pool's lower bound `gpus = LO..HI`)
        self.track = track  # told each instance task's name and a result of it (held.TaskClock reads it by id)

    def begin_step(self, began: float) -> None:
        """A step starts (perf_counter `began`): release instances started for the last one and not used (but
        `floor` of them), start the `floor` ones missing, and when the history says the group's first call has
        had to build models, start as many instances as it used, timed from the earliest that call has come
        (`plan`)."""
        with self.lock:
            kept, self.warm = self.warm[:self.floor], self.warm[self.floor:]  # the lower bound stays warm
            self._release()
            self.warm = kept
            self.step_began, self.first_pending = began, True
            self._launch(self.floor - len(self.warm))
            plan = self.plan()
            if plan is None or self.mailbox is None:
                return
            delay, n = plan
            self.timer = threading.Timer(delay, self._start, args=(began, n))
            self.timer.daemon = True
            self.timer.start()

    def plan(self) -> tuple[float, int] | None:
        """(seconds after a step's start, instances) to pre-warm for the group's first call, or None: from the
        history, by flowrl.elastic's `prewarm_plan` (the simulator's call). Under the lock (or alone)."""
        return prewarm_plan(self.offsets, self.ready_s, self.needed, self.margin_s, self.enabled)

    def _start(self, began: float, n: int) -> None:
        with self.lock:
            if self.step_began != began or not self.first_pending:  # too late: the call came first
                return
            self._launch(n - len(self.warm))

    def _launch(self, n: int) -> None:
        """Start up to `n` more instances (no more than the run has free slots for); under the lock."""
        n = self.slots.room(self.key[1], n) if self.slots is not None else n
        if n <= 0 or self.mailbox is None:
            return
        wanted = dict(self.wanted())
        for _ in range(n):
            box = f"{self.key[0]}/{self.key[1]}/{next(self.boxes)}"
            started: Any = remote_prewarm.options(**self.options, num_returns=4, name=box).remote(
                self.key, self.build, wanted, self.mailbox, box)
            self.warm.append(Warm(box, list(started)))
            if self.track is not None:
                self.track(box, started[0])
            if self.slots is not None:
                self.slots.taken(self.key[1], started[1])

    def keep_floor(self) -> None:
        """Start instances until `floor` wait for a call (the pool's lower bound kept warm), as slots allow."""
        with self.lock:
            if self.floor > len(self.warm) and self.step_began is not None:
                self._launch(self.floor - len(self.warm))

    def waiting(self) -> int:
        """Instances started and waiting for a call (slots this pool holds idle)."""
        with self.lock:
            return len(self.warm)

    def yield_idle(self) -> list[Any]:
        """Another pool needs the slots: tell the instances waiting here that they are not needed -> their stats
        refs (they return at once)."""
        with self.lock:
            let_go = [w.refs[1] for w in self.warm]
            self._release()
        return let_go

    def arrived(self, shards: int, method: str) -> tuple[bool, list[Warm]]:
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

    def learn(self, used: Sequence[Usage], first: bool) -> None:
        """From a finished call: how long a cold start takes, and whether the step's first call needed one
        (flowrl.elastic's `learn_start`, as the simulator learns)."""
        cold = [u.start_s + u.load_s for u in used if u.cold]
        with self.lock:
            self.ready_s, self.needed = learn_start(self.ready_s, self.needed, cold, len(used), first)

    def _release(self) -> None:
        for w in self.warm:
            self.mailbox.put.remote(w.box, None)
            self.unused.append((w, self.first_method))
        self.warm = []

    def returned(self) -> list[tuple[Mapping[str, Any], str, str]]:
        """The instances released unused that have returned since the last call: (stats, the method whose pool
        counts them, box)."""
        with self.lock:
            if not self.unused:
                return []
            done, _ = ray.wait([w.refs[1] for w, _ in self.unused], num_returns=len(self.unused), timeout=0)
            ready = set(done)
            back = [(w, method) for w, method in self.unused if w.refs[1] in ready]
            self.unused = [x for x in self.unused if x[0].refs[1] not in ready]
        return [(ray.get(w.refs[1]), method, w.box) for w, method in back]

    def wait_returned(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every instance released unused has returned."""
        with self.lock:
            refs = [w.refs[1] for w, _ in self.unused]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def forget(self) -> None:
        """After the run (closed, drained): drop the references to the instances' results."""
        with self.lock:
            self.warm, self.unused = [], []

    def close(self) -> None:
        """Stop pre-warming and release the instances still waiting."""
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
            self.step_began = None
            if self.mailbox is not None:
                self._release()
