"""The fused training schedule of `fuse-train` (flowrl.runtime): updates that take turns micro-batch by micro-batch.

`interleave(tasks)` runs each task in its own thread but lets only one run at a time: a task calls its `turn`
callback before each micro-batch, which (after its first one) hands the turn to the next unfinished task,
round robin. The result is the schedule actor mb 1, critic mb 1, actor mb 2, critic mb 2, ... with every
task running its own code unchanged (`TrainEngine.step`, data-parallel all-reduce included), so each model's
update computes exactly what it computes alone. Threads here are coroutines, not parallelism: the point is
the order, which on a pipelined device is what fills one model's bubbles with the other's work.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch

T = TypeVar("T")
Turn = Callable[[str], None]  # called with a label ("actor:0") before each unit of work


def torch_threads() -> Callable[[], None]:
    """A call that gives the current thread's torch intra-op thread count to a new thread. Without it a
    fresh thread's first ops run with the library default (every core) and, on a busy machine, many times
    slower; so every thread flowrl starts calls this first."""
    count = torch.get_num_threads()
    return lambda: torch.set_num_threads(count)


class _Threads:
    """Threads kept across calls: a fresh thread's tensor code runs ~8% slower for a while (new allocator
    arenas to fault in), which per-step threads would pay every step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[tuple[threading.Thread, queue.SimpleQueue[Callable[[], None] | None]]] = []

    def run(self, fns: Sequence[Callable[[], None]]) -> None:
        """Run every fn in a thread of its own, all at once; return when all returned (re-raising the first
        error)."""
        self.start(fns)()

    def start(self, fns: Sequence[Callable[[], None]]) -> Callable[[], None]:
        """Like `run`, but return at once; the returned call waits for them (and re-raises)."""
        done = threading.Semaphore(0)
        errors: list[BaseException] = []
        init = torch_threads()
        for fn in fns:
            with self.lock:
                worker = self.idle.pop() if self.idle else self._start()
            worker[1].put(partial(self._job, fn, init, worker, done, errors))

        def join() -> None:
            for _ in fns:
                done.acquire()
            if errors:
                raise errors[0]

        return join

    def _job(self, fn: Callable[[], None], init: Callable[[], None], worker: Any, done: threading.Semaphore,
             errors: list[BaseException]) -> None:
        try:
            init()
            fn()
        except BaseException as e:  # the thread lives on; the caller re-raises
            errors.append(e)
        finally:
            with self.lock:
                self.idle.append(worker)
            done.release()

    def _start(self) -> tuple[threading.Thread, queue.SimpleQueue[Callable[[], None] | None]]:
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()

        def loop() -> None:
            while (job := jobs.get()) is not None:
                job()

        thread = threading.Thread(target=loop, daemon=True, name="flowrl-worker-thread")
        thread.start()
        return thread, jobs


THREADS = _Threads()


def interleave(tasks: Sequence[Callable[[Turn], T]]) -> tuple[list[T], list[str]]:
    """Run `tasks` taking turns; returns their results and the labels in the order the units ran."""
    cond = threading.Condition()
    active = list(range(len(tasks)))
    state = {"current": 0}
    order: list[str] = []
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def pass_turn(i: int) -> None:  # with `cond` held
        later = [j for j in active if j > i] or active
        if later:
            state["current"] = later[0]
        cond.notify_all()

    def wait_turn(i: int) -> None:  # with `cond` held
        while state["current"] != i:
            cond.wait()

    def body(i: int) -> None:
        units = 0

        def turn(label: str) -> None:
            nonlocal units
            with cond:
                if units:
                    pass_turn(i)
                    wait_turn(i)
                order.append(label)
                units += 1

        with cond:
            wait_turn(i)
        try:
            results[i] = tasks[i](turn)
        except BaseException as e:  # re-raised in the caller; the other tasks still finish
            errors[i] = e
        finally:
            with cond:
                active.remove(i)
                pass_turn(i)

    THREADS.run([partial(body, i) for i in range(len(tasks))])
    for e in errors:
        if e is not None:
            raise e
    return results, order


def taking_turns(loss_fn: Callable[[Any], T], turn: Turn, name: str) -> Callable[[Any], T]:
    """`loss_fn` that first waits for its turn; labels count micro-batches as `name:0`, `name:1`, ..."""
    count = 0

    def wrapped(mb: Any) -> T:
        nonlocal count
        turn(f"{name}:{count}")
        count += 1
        return loss_fn(mb)

    return wrapped


def mean_step_metrics(engine: Any, steps: Iterable[tuple[Sequence[Any], Callable[[Any], Any]]], turn: Turn | None,
                      name: str) -> dict[str, float]:
    """Run an update's optimizer steps — each (its micro-batches, the loss of one) — on `engine`, taking turns
    (fuse-train) when `turn` is given, and return each metric's mean over the steps."""
    sums: dict[str, float] = {}
    count = 0
    for chunks, step_loss in steps:
        if turn is not None:  # fuse-train: wait for this model's turn before each micro-batch
            step_loss = taking_turns(step_loss, turn, name)
        for k, v in engine.step(chunks, step_loss).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += 1
    return {k: v / max(count, 1) for k, v in sums.items()}
