"""The local backend (the embedded default): every worker group is one in-process rank; calls run in order."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowrl.backends.local.group import InProcessGroup
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.runtime.protocol import WorkerGroup
from flowrl.runtime.worker import ModelWorker


def in_process_groups(graph: Graph, *, seed: int, device: str,
                      pool_of: Callable[[str, int], ThreadPoolExecutor | None],
                      world_of: Callable[[int], int]) -> list[InProcessGroup]:
    """One group per worker group of `graph`; a model in several groups is built once and shared."""
    built: dict[str, ModelWorker] = {}
    groups = []
    for wg in graph.worker_groups:
        fresh = [graph.model(m) for m in wg.models if m not in built]
        if fresh:
            # the group's models built already: a reference here may share a LoRA policy's base with one of them
            peers = {m: built[m].models[m] for m in wg.models if m in built}
            worker = ModelWorker(fresh, graph.models, seed=seed, device=device, peers=peers)
            built.update({m.name: worker for m in fresh})
        world = world_of(wg.ranks)
        groups.append(InProcessGroup(wg.name, {m: built[m] for m in wg.models}, world, pool_of(wg.name, world)))
    return groups


class SharedWeights:
    """What the in-process backends (local, threads) share: every group reads a model's one copy, so there is
    nothing to sync after an update and no older version to generate with (asynchronous runs go synchronous,
    saying `why_not_async`); fixed pools for the cost report."""

    name: str
    why_not_async: str

    def begin_step(self, step: int) -> None:
        pass  # fixed pools: nothing to start ahead

    def after_update(self, model: str, group: str) -> float:
        return 0.0  # a model in several groups is one shared object: nothing to send

    def snapshot(self, model: str, group: str) -> Any:
        raise FlowError(Diagnostic(f"the {self.name} backend cannot keep two versions of {model}",
                                   hint=self.why_not_async))

    def load_snapshot(self, model: str, group: str, weights: Any) -> float:
        raise FlowError(Diagnostic(f"the {self.name} backend cannot keep two versions of {model}",
                                   hint=self.why_not_async))

    def metrics(self) -> dict[str, float]:
        return {}

    def usage(self) -> None:
        return None  # fixed pools: every device held from start to shutdown


class LocalBackend(SharedWeights):
    name = "local"
    why_not_async = ("a model placed in several groups is one shared object on the local backend, so generation "
                     "cannot keep older weights while training changes them (run it on the process or ray backend)")

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        groups = in_process_groups(graph, seed=seed, device=device, pool_of=lambda name, world: None,
                                   world_of=lambda ranks: 1)
        self.groups = list(groups)
        return {g.name: g for g in groups}

    def shutdown(self) -> None:
        for g in getattr(self, "groups", []):  # environment pools' processes end with the run, not at GC
            g.close()
        self.groups = []
