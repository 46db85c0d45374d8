"""The environment pool (flowrl.envs): `EnvPool(spec)`, the `Envs` that multi-turn generation asks for each
trajectory's reset and steps; the environments run in warm worker processes (`flowrl.envs.host`).

- `workers` processes are started once (by `start()`, or at the first reset) and reused across calls and
  training steps. Each trajectory's instance lives in one worker, chosen at reset (the least loaded, in turn when
  tied) and kept for its steps. A worker runs its calls concurrently (a thread each; `async def` methods on its
  event loop). `workers = 0` runs the same calls in threads of this process.
- A future never raises. `timeout` holds for each call from the moment it reaches its worker (start-up is not
  counted): past it the future resolves as `Outcome(error="timeout after S s", timed_out=True)` and `on_error`
  applies; the call's late answer is dropped (`timeout = 0`: no limit). Calls on one instance run in turn: a step
  sent after a timed-out one waits for it, in its own time limit. A worker with a call still running at
  2 × timeout, or that died (a crash, `os._exit`, a signal), or that answered garbage, is killed and replaced;
  the trajectories whose instances it held cannot go on: their pending calls and any later step resolve with an
  error and done True.
- `on_error`: "observe" gives the error text back as the observation (done False; a failed reset ends its
  trajectory all the same: there is no instance to step); "end" ends the trajectory (reward 0); "raise" ends it
  too and records the first failure as `failed`, an `EnvError` naming the environment, the call and the
  trajectory: the caller checks `failed` (or calls `check()`, which raises it) between decode steps and turns it
  into a run error at its node. A class that cannot be loaded fails every call (error, done True), sets `failed`
  whatever `on_error` says, and `start()` raises its `EnvLoadError`.
- An observation past `host.OBSERVATION_CHARS` characters is cut there and counted in `truncated`.
- `close()` stops and reaps the workers (none is left behind) and resolves what is still pending.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from flowrl.envs.host import ERROR_CHARS, Answer, Runner, Worker, cut, read_answer
from flowrl.envs.load import EnvLoadError, load_env_class
from flowrl.envs.protocol import ON_ERROR, EnvSpec, Outcome
from flowrl.errors import Diagnostic, FlowError

__all__ = ["START_S", "EnvError", "EnvPool"]

START_S = 60.0  # a worker's start-up (imports, the class's module) before it counts as failed


class EnvError(FlowError):
    """An environment call that failed under `on_error = "raise"`, or an environment that could not start."""


@dataclass
class _Call:
    id: int
    key: Hashable
    op: str  # "reset" | "step"
    future: Future[Outcome]
    worker: int
    sent: float | None = None  # monotonic time it reached its worker; None while the worker starts
    timed_out: bool = False


class EnvPool:
    """`Envs` on warm worker processes (or threads): see the module docstring."""

    def __init__(self, spec: EnvSpec):
        if spec.on_error not in ON_ERROR:
            raise ValueError(f"on_error = {spec.on_error!r}: one of {', '.join(ON_ERROR)}")
        self.spec = spec
        self.failed: EnvError | None = None
        self.truncated = 0  # observations cut at host.OBSERVATION_CHARS
        self.replaced = 0  # workers killed or found dead, and started again
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.workers: list[Worker] = []
        self.runner: Runner | None = None
        self.broken: str | None = None  # why the class cannot run: every call fails with it
        self.home: dict[Hashable, int] = {}  # trajectory -> the worker holding its instance
        self.load: list[int] = []  # instances per worker
        self.lost: dict[Hashable, str] = {}  # trajectories whose worker died, with why
        self.calls: dict[int, _Call] = {}  # sent and not answered (timed-out ones until their worker is cleared)
        self.ids = itertools.count()
        self.turn = 0  # round-robin among equally loaded workers
        self.started = False
        self.closed = False
        self.monitor: threading.Thread | None = None

    # ---- the Envs protocol -------------------------------------------------------------------------------

    def reset(self, key: Hashable, row: Mapping[str, Any]) -> Future[Outcome]:
        self._start()
        with self.lock:
            if key in self.home:
                self._release(key)
            self.lost.pop(key, None)
            if self.broken is not None or self.closed:
                return self._now(key, "reset", self.broken or "the environment pool is closed")
            n = len(self.load)
            worker = min(range(n), key=lambda i: (self.load[i], (i - self.turn) % n))
            self.turn = (self.turn + 1) % n
            self.home[key] = worker
            self.load[worker] += 1
            return self._send(key, "reset", dict(row), worker)

    def step(self, key: Hashable, action: str) -> Future[Outcome]:
        with self.lock:
            if key in self.lost:
                return self._now(key, "step", self.lost[key])
            if self.broken is not None or self.closed:
                return self._now(key, "step", self.broken or "the environment pool is closed")
            if key not in self.home:
                raise KeyError(f"step before reset: no environment instance for trajectory {key!r}")
            return self._send(key, "step", action, self.home[key])

    def release(self, key: Hashable) -> None:
        with self.lock:
            self.lost.pop(key, None)
            if key in self.home:
                self._release(key)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            workers, self.workers = self.workers, []
            pending, self.calls = list(self.calls.values()), {}
            self.wake.notify_all()
        for w in workers:
            w.stop(kill=False)
        for w in workers:
            w.reader.join(timeout=5.0)
        for call in pending:
            if not call.timed_out:
                _resolve(call.future, Outcome("", done=True, error="the environment pool was closed"))

    # ---- beyond the protocol -----------------------------------------------------------------------------

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers now and wait until they are ready; raises `EnvLoadError` when the class cannot
        run (the worker's own words: "module 'x' has no class 'Y'")."""
        self._start()
        deadline = time.monotonic() + START_S
        for w in list(self.workers):
            w.started.wait(max(0.0, deadline - time.monotonic()))
        with self.lock:
            if self.broken is None and any(not w.started.is_set() for w in self.workers):
                self._break(f"a worker was not ready within {START_S:g} s")
            if self.broken is not None:
                raise EnvLoadError(self.broken)

    def check(self) -> None:
        """Raise the first failure recorded under `on_error = "raise"` (or a class that could not load)."""
        if self.failed is not None:
            raise self.failed

    def pids(self) -> list[int]:
        """The worker processes' ids (none for `workers = 0`)."""
        with self.lock:
            return [w.proc.pid for w in self.workers]

    # ---- inside ------------------------------------------------------------------------------------------

    def _start(self) -> None:
        with self.lock:
            if self.started or self.closed:
                return
            self.started = True
            if self.spec.workers <= 0:
                self.load = [0]
                try:
                    cls = load_env_class(self.spec)
                except EnvLoadError as e:
                    self._break(e.problem)
                else:
                    self.runner = Runner(cls, self.spec.options, self._answered_here)
            else:
                self.load = [0] * self.spec.workers
                self.workers = [self._spawn(i) for i in range(self.spec.workers)]
            self.monitor = threading.Thread(target=self._watch, daemon=True, name=f"flowrl-env-{self.spec.name}")
            self.monitor.start()

    def _spawn(self, index: int) -> Worker:
        return Worker(index, self.spec, self._ready, self._answered, self._exited)

    def _send(self, key: Hashable, op: str, payload: Any, worker: int) -> Future[Outcome]:
        call = _Call(next(self.ids), key, op, Future(), worker)
        self.calls[call.id] = call
        if self.runner is not None:
            call.sent = time.monotonic()
            self.runner.submit(call.id, op, key, payload)
        elif self.workers[worker].send((op, call.id, key, payload)):
            call.sent = time.monotonic()
        self.wake.notify_all()
        return call.future

    def _release(self, key: Hashable) -> None:
        worker = self.home.pop(key)
        self.load[worker] -= 1
        if self.runner is not None:
            self.runner.release(key)
        elif worker < len(self.workers):
            self.workers[worker].send(("release", key))

    def _now(self, key: Hashable, op: str, error: str) -> Future[Outcome]:
        """A call that cannot run: resolved at once, its trajectory over."""
        self._record(key, op, error)
        future: Future[Outcome] = Future()
        future.set_result(Outcome("", done=True, error=error))
        return future

    def _record(self, key: Hashable, op: str, error: str) -> None:
        if self.failed is None and (self.spec.on_error == "raise" or self.broken is not None):
            self.failed = EnvError(Diagnostic(
                f"{self.spec.kind} '{self.spec.name}' {op} of trajectory {key!r}: {error}",
                hint='on_error = "observe" shows the policy the error, "end" ends the trajectory; the run goes on'
                if self.broken is None else None))

    def _failure(self, call: _Call, error: str, timed_out: bool, seconds: float) -> Outcome:
        self._record(call.key, call.op, error)
        if self.spec.on_error == "observe":
            return Outcome(error, done=call.op == "reset", error=error, timed_out=timed_out, seconds=seconds)
        return Outcome("", done=True, error=error, timed_out=timed_out, seconds=seconds)

    def _ready(self, worker: Worker, problem: str | None) -> None:
        if problem is None:
            held = worker.flush()
            now = time.monotonic()
            with self.lock:
                for message in held:
                    if message[0] != "release" and message[1] in self.calls:
                        self.calls[message[1]].sent = now
                self.wake.notify_all()
            worker.started.set()
            return
        with self.lock:
            self._break(problem)
            pending = [c for c in self.calls.values() if not c.timed_out]
            self.calls = {}
            error = self.broken or problem
            worker.started.set()
        for call in pending:
            _resolve(call.future, Outcome("", done=True, error=error))

    def _break(self, problem: str) -> None:
        if self.broken is None:
            named = f"{self.spec.kind} '{self.spec.name}'"
            self.broken = f"{named} could not start: {problem.removeprefix(named + ': ')}"
            self.failed = EnvError(Diagnostic(self.broken))

    def _answered_here(self, call_id: int, answer: Answer) -> None:
        self._settle(call_id, answer)

    def _answered(self, worker: Worker, data: bytes) -> None:
        try:
            call_id, answer = read_answer(data)
        except ValueError:
            self._replace(worker, "answered something that is not an answer")
            return
        self._settle(call_id, answer)

    def _settle(self, call_id: int, answer: Answer) -> None:
        with self.lock:
            call = self.calls.pop(call_id, None)
            if call is None or call.timed_out:  # late: its future resolved at the timeout
                return
            if answer.truncated:
                self.truncated += 1
            if answer.error is not None:
                outcome = self._failure(call, answer.error, False, answer.seconds)
            else:
                outcome = Outcome(answer.observation, answer.reward, answer.done, seconds=answer.seconds)
        _resolve(call.future, outcome)

    def _exited(self, worker: Worker) -> None:
        self._replace(worker, worker.death(wait=5.0))

    def _replace(self, worker: Worker, why: str) -> None:
        """Kill `worker` (if it is still the current one at its index), start another in its place, and end
        the trajectories it held."""
        with self.lock:
            if self.closed or worker.index >= len(self.workers) or self.workers[worker.index] is not worker:
                return
            self.replaced += 1
            error = cut(f"the environment worker {why}: this trajectory's instance is gone", ERROR_CHARS)[0]
            for key in [k for k, i in self.home.items() if i == worker.index]:
                del self.home[key]
                self.lost[key] = error
            self.load[worker.index] = 0
            calls = [c for c in self.calls.values() if c.worker == worker.index]
            for c in calls:
                del self.calls[c.id]
            pending = [c for c in calls if not c.timed_out]
            for c in pending:
                self._record(c.key, c.op, error)
            try:
                self.workers[worker.index] = self._spawn(worker.index)
            except OSError as e:  # no process can be started (no memory, no descriptors): no call can run
                self._break(f"a worker could not be started again: {e}")
        worker.stop(kill=True)
        for c in pending:
            _resolve(c.future, Outcome("", done=True, error=error))

    def _watch(self) -> None:
        """Resolve calls past `timeout`; kill workers holding a call past 2 × timeout."""
        limit = self.spec.timeout if self.spec.timeout > 0 else math.inf  # 0: no limit
        while True:
            late: list[_Call] = []
            stuck: list[Worker] = []
            with self.lock:
                if self.closed:
                    return
                now, wait = time.monotonic(), 1.0
                for call in list(self.calls.values()):
                    if call.sent is None:
                        continue
                    age = now - call.sent
                    if not call.timed_out:
                        if age >= limit:
                            call.timed_out = True
                            late.append(call)
                        else:
                            wait = min(wait, limit - age)
                    if call.timed_out:
                        if age >= 2 * limit:
                            if self.runner is not None:  # a thread cannot be killed: it is abandoned
                                del self.calls[call.id]
                            elif self.workers[call.worker] not in stuck:
                                stuck.append(self.workers[call.worker])
                        else:
                            wait = min(wait, 2 * limit - age)
                outcomes = [self._failure(c, f"timeout after {limit:g} s", True, limit) for c in late]
                if not late and not stuck:
                    self.wake.wait(timeout=max(wait, 0.001))
            for call, outcome in zip(late, outcomes, strict=True):
                _resolve(call.future, outcome)
            for w in stuck:
                self._replace(w, f"had a call running past 2 × timeout ({2 * limit:g} s) and was killed")


def _resolve(future: Future[Outcome], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)
