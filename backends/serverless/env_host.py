"""The environments of a serverless run's multi-turn generations, hosted outside the instances (issue 26 item 5).

An instance whose live trajectories all wait on their environments gives its device back (env_release.py): its
task ends, and the waiting rows resume later on whichever instance gets a device. So the environments cannot live
in the instance's process (flowrl.runtime.env_rollout's per-worker pools): their state (a game's, a sandbox's)
and the calls in flight must outlive the task. `EnvHost` is a CPU-only Ray actor, one per (run, env), that holds
the warm `EnvPool` (its worker processes, flowrl.envs: timeouts, crashed workers replaced) keyed by trajectory,
and every call's outcome by (trajectory, call number) until the trajectory is released, so any instance, or the
driver deciding when to resume, can wait for the pending call of a parked row. Alternatives not taken: the pool in
the driver (every observation would cross to the driver and back, and the driver would run the env processes of
every pool), or one host per instance task (it dies with the task that gave its device back).

`RemoteEnvs` is the `Envs` a generating instance hands the decode loop: each call a Ray call on the host, its
outcome a future; keys are tagged with the call's step seed, so a pool shared by overlapping steps (async
rollouts) never mixes two trajectories.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import ray

from flowrl.envs.pool import EnvPool
from flowrl.envs.protocol import EnvSpec, Outcome

WAIT_S = 600.0  # bounds a wait for a call that was never sent (a bug), so it fails rather than hangs


class EnvHost:
    """A run's pool of one env, keyed by trajectory (a Ray actor: `remote_env_host`)."""

    def __init__(self, spec: EnvSpec):
        self.pool = EnvPool(spec)
        self.calls: dict[Hashable, list[Future[Outcome]]] = {}
        self.cond = threading.Condition()

    def call(self, key: Hashable, op: str, payload: Any) -> Outcome:
        """Reset (`payload` the row) or step (`payload` the action) trajectory `key`, and its outcome."""
        future = self.pool.reset(key, payload) if op == "reset" else self.pool.step(key, payload)
        with self.cond:
            self.calls.setdefault(key, []).append(future)
            self.cond.notify_all()
        return future.result()

    def outcome(self, key: Hashable, index: int) -> Outcome:
        """The outcome of trajectory `key`'s call number `index` (0: its reset), once it is back."""
        return self._future(key, index).result()

    def ready(self, pending: Sequence[tuple[Hashable, int]]) -> list[bool]:
        """Waits until at least one of the `pending` calls is back -> which are."""
        futures = [self._future(k, i) for k, i in pending]
        wait(futures, return_when=FIRST_COMPLETED)
        return [f.done() for f in futures]

    def release(self, key: Hashable) -> None:
        self.pool.release(key)
        with self.cond:
            self.calls.pop(key, None)

    def failed(self) -> str | None:
        """Why a call failed under on_error = "raise" (or the class could not start); None if none did."""
        return None if self.pool.failed is None else self.pool.failed.diagnostics[0].message

    def close(self) -> None:
        self.pool.close()

    def _future(self, key: Hashable, index: int) -> Future[Outcome]:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.calls.get(key, ())) > index, timeout=WAIT_S):
                raise TimeoutError(f"environment call {index} of {key!r} was never sent")
            return self.calls[key][index]


# CPU-only; a thread per call in flight
remote_env_host = ray.remote(num_cpus=0, max_concurrency=1024)(EnvHost)  # type: ignore[call-overload]


class RemoteEnvs:
    """The `Envs` of one generation call on an instance: the host's pool, keys tagged with `tag`."""

    def __init__(self, host: Any, tag: int, seen: list[float] | None = None):
        self.host, self.tag = host, tag
        self.seen = seen if seen is not None else []  # each outcome's seconds, as it comes (latency history)

    def reset(self, key: Hashable, row: Mapping[str, Any]) -> Future[Outcome]:
        return self._watch(self.host.call.remote((self.tag, key), "reset", dict(row)).future())

    def step(self, key: Hashable, action: str) -> Future[Outcome]:
        return self._watch(self.host.call.remote((self.tag, key), "step", action).future())

    def pending(self, key: Hashable, index: int) -> Future[Outcome]:
        """The outcome of call `index` of `key`, sent by an instance before (a parked row's pending call)."""
        return self._watch(self.host.outcome.remote((self.tag, key), index).future())

    def release(self, key: Hashable) -> None:
        self.host.release.remote((self.tag, key))

    def close(self) -> None:  # the host outlives the call
        pass

    def _watch(self, future: Future[Outcome]) -> Future[Outcome]:
        future.add_done_callback(lambda f: self.seen.append(f.result().seconds) if f.exception() is None else None)
        return future
