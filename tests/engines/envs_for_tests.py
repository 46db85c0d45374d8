"""A small real `Envs` (flowrl.envs.protocol) for the multi-turn engine's tests: environment classes run in a
ThreadPoolExecutor, real instances and real futures, with `timeout` and `on_error` applied as the contract says.

The production pool (flowrl.envs.pool) runs environments in warm processes; the decode loop only sees futures,
so these tests exercise it against the same protocol without processes.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flowrl.envs.protocol import Outcome

__all__ = ["CountEnv", "GuessEnv", "HangEnv", "RaiseEnv", "SlowEnv", "ThreadEnvs"]


class ThreadEnvs:
    """Runs one `factory()` instance per key in `workers` threads. A call past `timeout` seconds, or one that
    raises, becomes an error `Outcome` (its text the observation; `done` when `on_error` is "end")."""

    def __init__(self, factory: Callable[[], Any], *, workers: int = 4, timeout: float | None = None,
                 on_error: str = "observe") -> None:
        self.factory, self.timeout, self.on_error = factory, timeout, on_error
        self.pool = ThreadPoolExecutor(workers)
        self.instances: dict[Hashable, Any] = {}
        self.released: list[Hashable] = []
        self.actions: dict[Hashable, list[str]] = {}
        self.outcomes: dict[Hashable, list[Outcome]] = {}  # per key, in order: the reset's, then each step's
        self._lock = threading.Lock()

    def reset(self, key: Hashable, row: Mapping[str, Any]) -> Future[Outcome]:
        if key in self.instances:
            raise KeyError(f"environment {key!r} already exists")
        self.instances[key] = inst = self.factory()
        self.actions[key], self.outcomes[key] = [], []
        return self._run(key, lambda: (_call(inst.reset, row), 0.0, False))

    def step(self, key: Hashable, action: str) -> Future[Outcome]:
        inst = self.instances[key]
        self.actions[key].append(action)
        return self._run(key, lambda: _call(inst.step, action))

    def release(self, key: Hashable) -> None:
        del self.instances[key]
        self.released.append(key)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: Hashable, call: Callable[[], tuple[str, float, bool]]) -> Future[Outcome]:
        result: Future[Outcome] = Future()

        def settle(outcome: Outcome) -> None:
            with self._lock:  # the first of the call and its timer wins
                if not result.done():
                    self.outcomes[key].append(outcome)
                    result.set_result(outcome)

        def job() -> None:
            began = time.perf_counter()
            try:
                obs, reward, done = call()
                settle(Outcome(str(obs), float(reward), bool(done), seconds=time.perf_counter() - began))
            except Exception as exc:  # an environment's failure is an outcome, never an exception of the loop
                text = f"raised {type(exc).__name__}: {exc}"
                settle(Outcome(text, 0.0, self.on_error == "end", error=text, seconds=time.perf_counter() - began))

        if self.timeout is not None:
            text = f"timeout after {self.timeout} s"
            timer = threading.Timer(self.timeout, settle, [Outcome(text, 0.0, self.on_error == "end", error=text,
                                                                    timed_out=True, seconds=self.timeout)])
            timer.daemon = True
            timer.start()
            result.add_done_callback(lambda _f: timer.cancel())
        self.pool.submit(job)
        return result


def _call(method: Callable[..., Any], arg: Any) -> Any:
    out = method(arg)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


class GuessEnv:
    """Guess a hidden digit: each action's last digit is the guess; '<', '>' or '=' comes back, reward 1 when
    right (then done)."""

    def __init__(self, hidden: int = 5) -> None:
        self.hidden = hidden

    def reset(self, row: Mapping[str, Any]) -> str:
        self.hidden = int(row.get("hidden", self.hidden))
        return str(row.get("intro", ""))

    def step(self, action: str) -> tuple[str, float, bool]:
        digits = [c for c in action if c.isdigit()]
        if not digits:
            return "?", 0.0, False
        guess = int(digits[-1])
        if guess == self.hidden:
            return "=", 1.0, True
        return ("<" if self.hidden < guess else ">"), 0.1, False


class SlowEnv(GuessEnv):
    """GuessEnv whose calls sleep a random time from its own seeded stream (long-tailed: lognormal)."""

    def __init__(self, seed: int, median: float = 0.002, sigma: float = 1.0) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.median, self.sigma = median, sigma

    def reset(self, row: Mapping[str, Any]) -> str:
        time.sleep(self.median * self.rng.lognormvariate(0.0, self.sigma))
        return super().reset(row)

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(self.median * self.rng.lognormvariate(0.0, self.sigma))
        return super().step(action)


class RaiseEnv(GuessEnv):
    """Raises on its `fail_at`-th step (1-based)."""

    def __init__(self, fail_at: int = 1) -> None:
        super().__init__()
        self.fail_at, self.steps = fail_at, 0

    def step(self, action: str) -> tuple[str, float, bool]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise ValueError("tool crashed")
        return super().step(action)


class HangEnv(GuessEnv):
    """Its first step blocks until `release` is set (a hanging tool; the test sets it when done)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def step(self, action: str) -> tuple[str, float, bool]:
        self.release.wait()
        return super().step(action)


class CountEnv:
    """Never done: answers each action with '<' + its length + '>' (multi-character observations), reward
    length / 10; reset hands back the row's `intro`."""

    def reset(self, row: Mapping[str, Any]) -> str:
        return str(row.get("intro", ""))

    def step(self, action: str) -> tuple[str, float, bool]:
        return f"<{len(action)}>", len(action) / 10, False
