"""The threads backend: every worker group as `replicas` in-process ranks on threads (one copy of each model).

`flowrl run FLOW --backend threads`. A group of several ranks looks to the controller as a multi-rank group
does (split dispatch, per-rank calls for the fused stage's scheduler), built without Ray or processes, so
`fuse-gen-inference` with several generation workers can be run and measured anywhere. The ranks share one
`ModelWorker`: generation and forwards run shard by shard on parallel threads (torch releases the GIL inside
ops), and an update runs once on the whole batch (see `flowrl.backends.local.group`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from flowrl.backends.local.backend import SharedWeights, in_process_groups
from flowrl.backends.local.group import InProcessGroup
from flowrl.ir.graph import Graph
from flowrl.runtime.protocol import WorkerGroup
from flowrl.runtime.schedule import torch_threads


class ThreadBackend(SharedWeights):
    """`world`: ranks of every group, in place of each group's `replicas` (for measurements and tests)."""

    name = "threads"
    why_not_async = ("the threads backend's groups share each model's one copy, so generation cannot keep older "
                     "weights while training changes them (run it on the process or ray backend)")

    def __init__(self, world: int | None = None):
        self.world = world
        self.groups: list[InProcessGroup] = []

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        def pool(name: str, world: int) -> ThreadPoolExecutor:
            return ThreadPoolExecutor(max_workers=world, thread_name_prefix=f"flowrl-{name}",
                                      initializer=torch_threads())

        self.groups = in_process_groups(graph, seed=seed, device=device, pool_of=pool,
                                        world_of=lambda ranks: self.world or ranks)
        return {g.name: g for g in self.groups}

    def shutdown(self) -> None:
        for g in self.groups:
            g.close()
