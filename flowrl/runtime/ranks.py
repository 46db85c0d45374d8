"""In-process data-parallel ranks (flowrl.runtime): a worker group of `world` ranks on threads, one process.

`ThreadRanks` is what a multi-rank group looks like to the controller (split dispatch, per-rank calls for the
streaming scheduler), built without Ray so that `fuse-gen-inference` with several generation workers can be
run and measured anywhere. The ranks share one `ModelWorker`, i.e. one copy of the weights: generation and
forwards run shard-by-shard on parallel threads (torch releases the GIL inside ops), and an update runs once on
the whole batch, which is exactly what data-parallel ranks compute after their gradient all-reduce.
`ThreadedLocalBackend(world)` is the local backend with every worker group made of such ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from flowrl.ir.graph import Graph
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import assemble, rank_seed
from flowrl.runtime.protocol import Done, Future, WorkerGroup
from flowrl.runtime.schedule import torch_threads
from flowrl.runtime.worker import ModelWorker, group_state, load_group_state

SPLIT = ("generate", "logprobs", "values", "score")


class ThreadRanks:
    """`world` ranks over the models in `workers` (model name -> the worker holding it)."""

    def __init__(self, name: str, workers: Mapping[str, ModelWorker], world: int):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.name, self.world = name, world
        self.workers = dict(workers)
        self.pool = ThreadPoolExecutor(max_workers=world, thread_name_prefix=f"flowrl-{name}",
                                       initializer=torch_threads())

    def _worker(self, model: Any) -> ModelWorker:
        return self.workers[model] if isinstance(model, str) else next(iter(self.workers.values()))

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` as rank `rank` (called from the streaming scheduler's rank threads)."""
        return getattr(self._worker(args[0] if args else None), method)(*args, **kwargs)

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        try:
            if method in SPLIT and dispatch == "split" and self.world > 1:
                return Done(self._split(method, *args, **kwargs))
            return Done(self.on_rank(0, method, *args, **kwargs))
        except Exception as e:  # surfaced at result(), like a remote call's error
            return Done(error=e)

    def _split(self, method: str, model: str, batch: Batch, attrs: Mapping[str, Any], **kwargs: Any) -> Batch:
        pad = self._worker(model).models[model].tokenizer.pad_id
        return split_call(self.pool, self.on_rank, self.world, pad, method, model, batch, attrs, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return group_state(self.workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_group_state(self.workers, state)


def split_call(pool: ThreadPoolExecutor, on_rank: Callable[..., Any], world: int, pad: int, method: str,
               model: str, batch: Batch, attrs: Mapping[str, Any], **kwargs: Any) -> Batch:
    """Split dispatch over `world` ranks: a contiguous shard each, run in parallel, results in order. For
    `generate`, rank r samples with `rank_seed(step_seed, r)` and group ids stay global prompt indices."""
    shards = batch.split(world)
    firsts = [sum(s.size for s in shards[:i]) for i in range(len(shards))]
    if method != "generate":
        outs = list(pool.map(lambda r: on_rank(r, method, model, shards[r], attrs, **kwargs), range(len(shards))))
        return Batch.concat(outs)
    seed = int(kwargs["step_seed"])

    def rank(r: int) -> Batch:
        out: Batch = on_rank(r, "generate", model, shards[r], attrs, step_seed=rank_seed(seed, r))
        out.tensors["group_id"] = out["group_id"] + firsts[r]
        out.tensors["pad"] = torch.full((out.size,), pad)
        return out

    outs = list(pool.map(rank, range(len(shards))))
    n = int(attrs.get("n", 1))
    return assemble(outs, [first * n + torch.arange(out.size) for out, first in zip(outs, firsts, strict=True)])


class ThreadedLocalBackend:
    """The local backend with `world` thread ranks per worker group (one copy of each model)."""

    name = "local-threads"

    def __init__(self, world: int = 2):
        self.world = world
        self.groups: list[ThreadRanks] = []

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        built: dict[str, ModelWorker] = {}
        groups: dict[str, WorkerGroup] = {}
        for wg in graph.worker_groups:
            fresh = [graph.model(m) for m in wg.models if m not in built]
            if fresh:
                worker = ModelWorker(fresh, graph.models, seed=seed, device=device)
                built.update({m.name: worker for m in fresh})
            group = ThreadRanks(wg.name, {m: built[m] for m in wg.models}, self.world)
            self.groups.append(group)
            groups[wg.name] = group
        return groups

    def shutdown(self) -> None:
        for g in self.groups:
            g.pool.shutdown(wait=True)
