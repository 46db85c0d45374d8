"""The local backend: worker groups are in-process `ModelWorker`s; calls run synchronously in order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowrl.ir.graph import Graph
from flowrl.runtime.protocol import Done, Future, WorkerGroup
from flowrl.runtime.worker import ModelWorker, group_state, load_group_state


class LocalWorkerGroup:
    """One rank, in this process, so every dispatch mode is a single call. A model placed in several groups
    (split placement) is built once and shared: the in-process equivalent of weight sync."""

    in_process = True  # runs in the controller's process: no worker beside another (see runtime.fusion)

    def __init__(self, name: str, workers: Mapping[str, ModelWorker]):
        self.name, self.world = name, 1
        self.workers = dict(workers)  # model name -> the worker holding it

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        model = args[0] if args else None
        worker = self.workers[model] if isinstance(model, str) else next(iter(self.workers.values()))
        try:
            return Done(getattr(worker, method)(*args, **kwargs))
        except Exception as e:  # surfaced at result(), like a remote call's error
            return Done(error=e)

    def state_dict(self) -> dict[str, Any]:
        return group_state(self.workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_group_state(self.workers, state)


class LocalBackend:
    name = "local"

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        groups: dict[str, WorkerGroup] = {}
        built: dict[str, ModelWorker] = {}
        for wg in graph.worker_groups:
            fresh = [graph.model(m) for m in wg.models if m not in built]
            if fresh:
                worker = ModelWorker(fresh, graph.models, seed=seed, device=device)
                built.update({m.name: worker for m in fresh})
            groups[wg.name] = LocalWorkerGroup(wg.name, {m: built[m] for m in wg.models})
        return groups

    def shutdown(self) -> None:
        pass
