"""In-process worker groups (local and threads backends): ranks that are calls in the controller's process.

One `ModelWorker` per model set, shared by the group's ranks: a model placed in several groups (split placement)
is built once and shared, the in-process equivalent of weight sync. With one rank (the local backend) every
dispatch mode is a single plain call; with several (the threads backend) the ranks run on threads of one pool,
each on its shard (torch releases the GIL inside ops), and state-changing calls run once on the whole batch
(`dispatch.plan(shared_weights=True)`): exactly what data-parallel ranks compute after their all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowrl.ir.graph import Node
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.protocol import Future, StreamedStage, WorkerGroup, done
from flowrl.runtime.worker import ModelWorker, group_state, load_group_state


class InProcessGroup:
    """`world` ranks in this process over the models in `workers` (model name -> the worker holding it)."""

    per_rank = True
    why_not_per_rank = ""

    def __init__(self, name: str, workers: Mapping[str, ModelWorker], world: int = 1,
                 pool: ThreadPoolExecutor | None = None):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if world > 1 and pool is None:
            raise ValueError("several in-process ranks need a thread pool to run on")
        self.name, self.world, self.pool = name, world, pool
        self.inline = pool is None  # no pool: the local backend's one rank, called on the caller's thread
        self.workers = dict(workers)
        self.models = tuple(self.workers)

    def _worker(self, model: Any) -> ModelWorker:
        return self.workers[model] if isinstance(model, str) else next(iter(self.workers.values()))

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._worker(args[0] if args else None), method)(*args, **kwargs)

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        return done(self._call, method, args, kwargs, dispatch)

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str) -> Any:
        p = dispatch.plan(method, args, kwargs, mode, self.world, shared_weights=True)
        results = dispatch.run_plan(p, lambda c: self.on_rank(c.rank, method, *c.args, **c.kwargs), self.pool)
        model = args[0] if args else None
        pad = self._worker(model).pad_id(model) if method == "generate" and isinstance(model, str) else 0
        return dispatch.merge(p, results, pad)

    def colocated(self, models: Sequence[str]) -> bool:
        return all(m in self.workers for m in models) and len({id(self.workers[m]) for m in models}) == 1

    def stream_stage(self, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                     others: Mapping[str, WorkerGroup]) -> StreamedStage | None:
        return None  # its ranks are driven one by one (per_rank)

    def recover(self) -> None:
        """Nothing to bring back: an in-process rank cannot die apart from the controller."""

    def state_dict(self) -> dict[str, Any]:
        return group_state(self.workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_group_state(self.workers, state)

    def close(self) -> None:
        """Close what the workers hold beyond their models (environment pools' processes), each worker once (a
        model placed in several groups is one shared worker on the local backend; closing twice is harmless)."""
        for worker in {id(w): w for w in self.workers.values()}.values():
            worker.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
