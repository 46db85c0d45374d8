"""An instance of a serverless pool: one Ray task that holds a device slot only while it runs.

Tasks run on Ray worker processes that are kept and reused (`max_calls=0`), and each process keeps the
`ModelWorker`s it built in `_CACHE`, keyed by (run, worker group), with the version of each model's weights it
holds. A task names the versions it needs (`wanted`: model -> (version, [object ref] — or [ref, model] for an
update's result, which holds every model it trained — or [] for the weights every instance builds from the
seed)); a process already holding them starts at once (a warm start), one that
holds older weights loads them from the object store first, and a new process builds its models first (a cold
start). The state of a pool lives in the object store between tasks, so any process can serve any call, and a
pool with no work holds no slot (scale to zero). An instance lost mid-call is replaced by Ray's task retry: the
call runs again on another process (a cold start in the cost report) with the same versions and seeds, so it
returns what the lost one would have. An update returns its models' new state as a third result,
which stays in the object store (`num_returns=3`): the driver keeps only its reference.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from flowrl.ir.graph import ModelDecl
from flowrl.runtime.dispatch import UPDATES
from flowrl.runtime.worker import ModelWorker

SLOT = "device_slot"  # the Ray custom resource that stands for a device (a GPU on a GPU cluster)


@dataclass(frozen=True)
class Build:
    """What an instance needs to build its group's models."""

    models: tuple[ModelDecl, ...]
    all_models: tuple[ModelDecl, ...]
    seed: int
    device: str


@dataclass
class _Entry:
    worker: ModelWorker
    versions: dict[str, int] = field(default_factory=dict)


_CACHE: dict[tuple[str, str], _Entry] = {}


def serve(key: tuple[str, str], build: Build, wanted: Mapping[str, tuple[int, Sequence[Any]]], method: str,
          args: tuple[Any, ...], kwargs: dict[str, Any], new_version: int,
          crash: str | None = None) -> tuple[Any, dict[str, Any], Any]:
    """Run `ModelWorker.<method>` with the weights `wanted` names -> (result, stats, new state or None).

    `crash` (tests only): a file path; the first attempt that finds no file there creates it and kills this
    process before running the method, as a machine lost mid-call would (Ray re-runs the task elsewhere)."""
    began = time.perf_counter()
    entry = _CACHE.get(key)
    cold = entry is None
    if entry is None:
        for old in [k for k in _CACHE if k[0] != key[0]]:  # an earlier run's models: this process serves a new one
            del _CACHE[old]
        entry = _CACHE[key] = _Entry(ModelWorker(build.models, build.all_models, seed=build.seed,
                                                 device=build.device), {m.name: 0 for m in build.models})
    built = time.perf_counter()
    for model, (version, holder) in wanted.items():
        if entry.versions.get(model) != version:
            if not holder:
                raise RuntimeError(f"{model}: version {version} wanted, none to load")
            state = ray.get(holder[0])  # a model's state, or an update's {model: state} and the model's name
            entry.worker.load_state_dict({model: state[holder[1]] if len(holder) > 1 else state})
            entry.versions[model] = version
    ready = time.perf_counter()
    if crash is not None and not os.path.exists(crash):
        with open(crash, "w") as marker:
            marker.write(str(os.getpid()))
        os._exit(1)
    result = getattr(entry.worker, method)(*args, **kwargs)
    done = time.perf_counter()
    state = None
    if method in UPDATES:
        trained = [args[0]] if isinstance(args[0], str) else list(args[0])
        full = entry.worker.state_dict()
        state = {m: full[m] for m in trained}
        for m in trained:
            entry.versions[m] = new_version
    stats = {"pid": os.getpid(), "cold": cold, "start_s": built - began, "load_s": ready - built,
             "run_s": done - ready, "began": time.time() - (time.perf_counter() - began)}
    return result, stats, state


# max_calls=0: the process stays for the next task (warm); max_retries: a task whose process died (a lost
# instance) runs again on another one, from the same versions and seeds, so the step ends as it would have.
MAX_RETRIES = 3
remote_serve = ray.remote(max_calls=0, max_retries=MAX_RETRIES, retry_exceptions=False)(serve)
