"""The process backend: every worker group as `replicas` spawned, data-parallel rank processes.

`flowrl run FLOW --backend process`: real parallelism on one machine without Ray (for measurements; the Ray
backend is the distributed one). With a split placement (a model held by several groups, e.g. `actor.generate`
on one pool and `actor.update` on another) `after_update` sends the trained weights to the other holders, as
the Ray backend does.
"""

from __future__ import annotations

import time
from typing import Any

from flowrl.backends.process.group import ProcessRanks
from flowrl.ir.graph import Graph
from flowrl.runtime.protocol import WorkerGroup


class ProcessBackend:
    """`world`: ranks of every group, in place of each group's `replicas`; `threads`: torch threads per rank."""

    name = "process"

    def __init__(self, world: int | None = None, threads: int = 1):
        self.world, self.threads = world, threads
        self.groups: list[ProcessRanks] = []

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        for wg in graph.worker_groups:
            self.groups.append(ProcessRanks(wg.name, [graph.model(m) for m in wg.models], graph.models,
                                            self.world or wg.ranks, seed=seed, device=device, threads=self.threads))
        return {g.name: g for g in self.groups}

    def begin_step(self, step: int) -> None:
        pass  # fixed pools: nothing to start ahead

    def after_update(self, model: str, group: str) -> float:
        """Seconds spent loading the new weights of `model`, trained in `group`, into every rank of the other
        groups that hold it (0.0 when none does)."""
        source = next(g for g in self.groups if g.name == group)
        behind = [g for g in self.groups if g is not source and model in g.models]
        if not behind:
            return 0.0
        began = time.perf_counter()
        weights = source.on_rank(0, "weights", model)
        for g in behind:
            g.load_weights(model, weights)
        return time.perf_counter() - began

    why_not_async = ""  # every group holds its own copy of its models

    def snapshot(self, model: str, group: str) -> Any:
        """Rank 0's weights of `model` in `group`, now: a copy in the controller's memory."""
        return next(g for g in self.groups if g.name == group).on_rank(0, "weights", model)

    def load_snapshot(self, model: str, group: str, weights: Any) -> float:
        began = time.perf_counter()
        for g in self.groups:
            if g.name != group and model in g.models:
                g.load_weights(model, weights)
        return time.perf_counter() - began

    def metrics(self) -> dict[str, float]:
        return {}

    def usage(self) -> None:
        return None  # fixed pools: every device held from start to shutdown

    def shutdown(self) -> None:
        for g in self.groups:
            g.close()
        self.groups = []
