"""An instance of a serverless pool: one Ray task that holds a device slot only while it runs.

Tasks run on Ray worker processes that are kept and reused (`max_calls=0`), and each process keeps the
`ModelWorker`s it built in `_CACHE` (a bounded set, cache.py), keyed by (run, worker group), with the version of
each model's weights it holds. A task names the versions it needs (`wanted`: model -> (version, [object ref] —
or [ref, model, ref] for an update's results, which hold every model it trained, its weights and its
optimizer's state apart — or [] for the weights every instance builds from the seed)); a process already
holding them starts at once (a warm start), one that holds older weights loads them from the object store
first, and a new process builds its models first (a cold
start). The state of a pool lives in the object store between tasks, so any process can serve any call, and a
pool with no work holds no slot (scale to zero). An instance lost mid-call is replaced by Ray's task retry: the
call runs again on another process (a cold start in the cost report) with the same versions and seeds, so it
returns what the lost one would have. An update returns its models' new weights and their optimizer state as
a third and a fourth result, which stay in the object store (`num_returns=4`): the driver keeps only their
references. Only a group that trains a model (`Build.trains`) loads its optimizer state: a generation pool
loads the weights alone (a third of the bytes with Adam). States travel as numpy arrays (flowrl.runtime.transport).

A pre-warmed instance (`prewarm`) is a task started before its stage, from the step history: it builds and
loads its models, then waits (holding its slot, idle) for the call in its `Mailbox` box, and serves it as
`serve` would. With `Build.keep_warm` false an instance drops its models when its task ends (nothing held in
host memory between tasks, every task a cold start unless pre-warmed).

Devices (backends/serverless/devices.py, cache.py): a task runs its models on the device it was given (the GPU
Ray assigned it, or the CPU on a cluster without GPUs) and, before giving it back, moves them to host memory;
the next task moves them onto its own device, timed as loading (`Build.keep_on_device`: they stay). A process
keeps at most `cache.KEPT` groups' models. Each task's stats say which device it chose, its GPU ids, whether
its models stayed on the device, and where CUDA exists the memory allocated on it before building and after
giving the device back.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from flowrl.backends.serverless import env_release, migrate, prefill, stream
from flowrl.backends.serverless.cache import Entry, ProcessModels, free, move_models, why_not_movable
from flowrl.backends.serverless.devices import SLOT as SLOT  # the resource instances took before devices.py
from flowrl.backends.serverless.devices import choose_device, task_device
from flowrl.ir.graph import ModelDecl
from flowrl.runtime.dispatch import UPDATES
from flowrl.runtime.transport import pack, unpack
from flowrl.runtime.worker import ModelWorker

CLOSED_KEPT = 4096  # closed box names the Mailbox remembers (a take comes within its call, long before)


@dataclass(frozen=True)
class Build:
    """What an instance needs to build its group's models."""

    models: tuple[ModelDecl, ...]
    all_models: tuple[ModelDecl, ...]
    seed: int
    device: str
    keep_warm: bool = True  # keep the built models in the process between tasks
    trains: tuple[str, ...] = ()  # the models this group updates (the others' optimizer state is not loaded)
    keep_on_device: bool = False  # the pool's `keep_warm = "device"`: models stay on the device between tasks


_CACHE = ProcessModels()
# what an instance runs for the methods that are not ModelWorker's own (they talk to the Mailbox actor)
TASKS: dict[str, Callable[..., Any]] = {migrate.METHOD: migrate.generate, stream.CONSUME: stream.consume,
                                        env_release.GENERATE: env_release.generate_parking,
                                        env_release.RESUME: env_release.resume_parked}


def _ready(key: tuple[str, str], build: Build, wanted: Mapping[str, tuple[int, Sequence[Any]]],
           device: str | None = None) -> tuple[Entry, bool, float, float]:
    """The process's models for `key` on `device` (None: the run's device without a GPU) at the versions `wanted`
    names -> (entry, cold, build s, load s: moving them back from host memory and loading newer weights)."""
    device = device or choose_device(build.device, [], None)
    began = time.perf_counter()
    entry = _CACHE.get(key)
    if entry is not None and why_not_movable(entry.worker) and str(entry.worker.device) != device:
        _CACHE.drop(key)  # an engine that places its own memory cannot move: built again where this task runs
        entry = None
    cold = entry is None
    if entry is None:
        entry = Entry(ModelWorker(build.models, build.all_models, seed=build.seed, device=device),
                      {m.name: 0 for m in build.models})
        _CACHE.put(key, entry)
    built = time.perf_counter()
    if not cold and not why_not_movable(entry.worker):  # back from host memory (CPU to CPU: the same path, no copy)
        move_models(entry.worker, device)
    for model, (version, holder) in wanted.items():
        if entry.versions.get(model) != version:
            if not holder:
                raise RuntimeError(f"{model}: version {version} wanted, none to load")
            state = ray.get(holder[0])  # a model's state, or an update's {model: weights} and the model's name
            state = unpack(state[holder[1]] if len(holder) > 1 else state)
            if len(holder) > 2 and model in build.trains:  # and the update's {model: optimizer state}
                state = {**state, "optim": unpack(ray.get(holder[2])[model])}
            entry.worker.load_state_dict({model: state})
            entry.versions[model] = version
    return entry, cold, built - began, time.perf_counter() - built


def _allocated(device: str) -> float | None:
    """Bytes allocated on `device` by this process (None off CUDA)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return float(torch.cuda.memory_allocated(device))


def _device(build: Build) -> dict[str, Any]:
    """The device this task's models use (devices.task_device) -> the stats saying so; on CUDA it becomes the
    process's current device, and its allocated memory now is the instance's floor."""
    gpus = [str(g) for g in ray.get_gpu_ids()]
    device = task_device(build.device, gpus)
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(device)
    floor = _allocated(device)
    return {"device": device, "gpu_ids": gpus, **({"mem_floor": floor} if floor is not None else {})}


def _release(key: tuple[str, str], build: Build, stats: dict[str, Any]) -> None:
    """Before the task gives its device back: its models to host memory (timed as loading), or kept on the
    device (`keep_on_device`, or an engine that places its own memory), or dropped (`keep_warm` false)."""
    entry = _CACHE.get(key)
    offload_s, kept = 0.0, False
    if entry is not None:
        stats["models_on"] = str(entry.worker.device)  # where its models ran: the choice, as the worker made it
    if not build.keep_warm:
        _CACHE.drop(key)
    elif entry is not None and (build.keep_on_device or why_not_movable(entry.worker)):
        kept = True
    elif entry is not None:
        offload_s = move_models(entry.worker, "cpu")
        if stats["device"] != "cpu":
            free()
    after = _allocated(stats["device"])
    stats.update(load_s=stats["load_s"] + offload_s, offload_s=offload_s, kept_on_device=kept,
                 **({"mem_after": after} if after is not None else {}))


def _attempt(ledger: tuple[Any, str] | None, wall: float) -> Any:
    """Tell the ledger (the Mailbox actor, the task's token) that an attempt of the task began here, so the
    driver can count the device time of an attempt whose process was lost (it returns no stats) -> the call's
    reference (None without a ledger)."""
    return ledger[0].began.remote(ledger[1], os.getpid(), wall) if ledger is not None else None


def _run(key: tuple[str, str], build: Build, entry: Entry, method: str, args: tuple[Any, ...],
         kwargs: dict[str, Any], new_version: int, crash: str | None, noted: Any = None,
         extra: dict[str, Any] | None = None) -> tuple[Any, tuple[Any, Any], float]:
    """`ModelWorker.<method>` -> (result, an update's new ({model: weights}, {model: optimizer state}) or (None,
    None), seconds); what a generation's deduplicated prefill measured goes to `extra` (the task's stats)."""
    extra = {} if extra is None else extra
    kwargs = dict(kwargs)
    if crash is not None and not os.path.exists(crash):
        with open(crash, "w") as marker:
            marker.write(str(os.getpid()))
        if noted is not None:  # the attempt's record is in the ledger before the process goes
            ray.get(noted)
        os._exit(1)
    began = time.perf_counter()
    share = kwargs.pop("share", None)
    if share is not None:  # a generation's deduplicated prefill: its prefixes, computed here or taken
        kwargs["prefixes"], extra["prefill"] = prefill.resolve(entry.worker, args[0], share)
    task = TASKS.get(method)
    if task is not None:
        result: Any = task(entry.worker, *args, **kwargs)
    else:
        result = getattr(entry.worker, method)(*args, **kwargs)
    took = time.perf_counter() - began
    state: tuple[Any, Any] = (None, None)
    if method in UPDATES:
        trained = [args[0]] if isinstance(args[0], str) else list(args[0])
        full = entry.worker.state_dict()
        state = ({m: {"module": pack(full[m]["module"]), "optim": None} for m in trained},
                 {m: pack(full[m]["optim"]) for m in trained})
        for m in trained:
            entry.versions[m] = new_version
    return result, state, took


def _ready_and_run(key: tuple[str, str], build: Build, wanted: Mapping[str, tuple[int, Sequence[Any]]],
                   placed: Mapping[str, Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   new_version: int, crash: str | None, noted: Any) -> tuple[Any, tuple[Any, Any], dict[str, Any]]:
    """The models at the versions `wanted` names on the task's device (`placed`), then `ModelWorker.<method>`
    -> (result, an update's new state, stats: cold, start_s, load_s, run_s and what the method measured). If
    either fails the device goes back all the same: the models leave it first."""
    try:
        entry, cold, start_s, load_s = _ready(key, build, wanted, placed["device"])
        extra: dict[str, Any] = {}
        result, state, run_s = _run(key, build, entry, method, args, kwargs, new_version, crash, noted, extra)
    except BaseException:
        _release(key, build, {**placed, "load_s": 0.0})
        raise
    return result, state, {"cold": cold, "start_s": start_s, "load_s": load_s, "run_s": run_s, **extra}


def serve(key: tuple[str, str], build: Build, wanted: Mapping[str, tuple[int, Sequence[Any]]], method: str,
          args: tuple[Any, ...], kwargs: dict[str, Any], new_version: int,
          crash: str | None = None, ledger: tuple[Any, str] | None = None) -> tuple[Any, dict[str, Any], Any, Any]:
    """Run `ModelWorker.<method>` with the weights `wanted` names -> (result, stats, an update's new weights and
    optimizer state, or None and None).

    `crash` (tests only): a file path; the first attempt that finds no file there creates it and kills this
    process before running the method, as a machine lost mid-call would (Ray re-runs the task elsewhere).
    `ledger`: (Mailbox, this task's token), told when each attempt begins."""
    wall = time.time()
    noted = _attempt(ledger, wall)
    placed = _device(build)
    result, state, ran = _ready_and_run(key, build, wanted, placed, method, args, kwargs, new_version, crash, noted)
    stats = {"pid": os.getpid(), "began": wall, "wait_s": 0.0, "prewarmed": False, "ready_first": False,
             "served": True, **ran, **placed}
    _release(key, build, stats)
    return result, stats, state[0], state[1]


def prewarm(key: tuple[str, str], build: Build, wanted: Mapping[str, tuple[int, Sequence[Any]]],
            mailbox: Any, box: str) -> tuple[Any, dict[str, Any], Any, Any]:
    """A pre-warmed instance: build and load now, then wait for the call put in `box` ([ref to (wanted, method,
    args, kwargs, new_version, crash)], or None: not needed after all) and serve it -> what `serve` returns
    (None, stats, None, None when not needed). Taking from the box does not empty it, so a retried attempt of a lost
    instance finds the same call."""
    wall = time.time()
    noted = _attempt((mailbox, box), wall)
    placed = _device(build)
    try:
        entry, cold, start_s, load_s = _ready(key, build, wanted, placed["device"])
        waiting = time.perf_counter()
        sent, early = ray.get(mailbox.take.remote(box))
    except BaseException:  # the device goes back all the same: the models leave it first
        _release(key, build, {**placed, "load_s": 0.0})
        raise
    wait_s = time.perf_counter() - waiting
    stats = {"pid": os.getpid(), "cold": cold, "start_s": start_s, "load_s": load_s, "run_s": 0.0, "began": wall,
             "wait_s": wait_s, "prewarmed": True, "ready_first": early, "served": sent is not None, **placed}
    if sent is None:
        _release(key, build, stats)
        return None, stats, None, None
    wanted_now, method, args, kwargs, new_version, crash = ray.get(sent[0])
    # a version newer than the one loaded ahead, then the call
    result, state, ran = _ready_and_run(key, build, wanted_now, placed, method, args, kwargs, new_version, crash,
                                        noted)
    stats.update({k: v for k, v in ran.items() if k not in ("cold", "start_s")}, load_s=load_s + ran["load_s"])
    _release(key, build, stats)
    return result, stats, state[0], state[1]


class Mailbox:
    """Where the driver hands a pre-warmed instance its call (a Ray actor that takes no CPU): `take(box)` waits
    until `put(box, value)`; `close(box)` forgets a box once its instance returned; `ready(prefix)` returns once
    an instance waits at an empty box whose name starts with `prefix` (a pool's instance is ready)."""

    def __init__(self) -> None:
        self.boxes: dict[str, asyncio.Future[Any]] = {}
        self.takers: set[str] = set()  # boxes an instance waits at
        self.watchers: list[tuple[str, asyncio.Future[None]]] = []
        self.words: dict[str, list[Any]] = {}
        self.attempts: dict[str, list[tuple[int, float]]] = {}
        self.word_waiters: dict[str, asyncio.Future[None]] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()  # the last CLOSED_KEPT boxes closed

    async def ready(self, prefix: str) -> None:
        if not any(b.startswith(prefix) and not self.boxes[b].done() for b in self.takers):
            watcher = asyncio.get_running_loop().create_future()
            self.watchers.append((prefix, watcher))
            await watcher

    def _box(self, box: str) -> asyncio.Future[Any]:
        if box not in self.boxes:
            self.boxes[box] = asyncio.get_running_loop().create_future()
        return self.boxes[box]

    async def take(self, box: str) -> tuple[Any, bool]:
        """-> (the value, whether the taker was there before it: the instance was ready ahead of its call)."""
        early = not self._box(box).done()
        if early:
            self.takers.add(box)
            for prefix, watcher in [w for w in self.watchers if box.startswith(w[0])]:
                watcher.set_result(None)
                self.watchers.remove((prefix, watcher))
        return await asyncio.shield(self._box(box)), early

    async def put(self, box: str, value: Any) -> None:
        if not self._box(box).done():
            self._box(box).set_result(value)

    async def close(self, box: str) -> None:
        self.boxes.pop(box, None)
        self.takers.discard(box)
        self.words.pop(box, None)
        self.closed[box] = None  # a take still waiting (a taker gave up on its owner) or coming late gets []
        while len(self.closed) > CLOSED_KEPT:
            self.closed.popitem(last=False)
        waiting = self.word_waiters.pop(box, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    # the ledger of attempts: each instance task's attempts tell when they began (a lost one returns nothing)
    async def began(self, token: str, pid: int, wall: float) -> None:
        self.attempts.setdefault(token, []).append((pid, wall))

    async def take_attempts(self, tokens: list[str]) -> dict[str, list[tuple[int, float]]]:
        """The attempts recorded for `tokens` (forgotten here)."""
        return {t: self.attempts.pop(t) for t in tokens if t in self.attempts}

    # a migrating generation's box (backends/serverless/migrate.py): sources offer words, the sink takes them
    async def offer(self, box: str, word: Any) -> None:
        self.words.setdefault(box, []).append(word)
        waiting = self.word_waiters.pop(box, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def take_all(self, box: str, since: int = 0) -> list[Any]:
        """The words offered in `box` after the first `since` (waiting for at least one). Words stay until the
        box is closed, so a sink's retried attempt (its process lost) reads them all again."""
        while len(self.words.get(box, [])) <= since:
            if box in self.closed:  # nothing will come
                return []
            waiting = self.word_waiters.setdefault(box, asyncio.get_running_loop().create_future())
            await waiting
        return self.words[box][since:]


# max_calls=0: the process stays for the next task (warm); max_retries: a task whose process died (a lost
# instance) runs again on another one, from the same versions and seeds, so the step ends as it would have.
MAX_RETRIES = 3
remote_serve = ray.remote(max_calls=0, max_retries=MAX_RETRIES, retry_exceptions=False)(serve)
remote_prewarm = ray.remote(max_calls=0, max_retries=MAX_RETRIES, retry_exceptions=False)(prewarm)
remote_mailbox = ray.remote(num_cpus=0)(Mailbox)
