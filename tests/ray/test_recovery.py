"""A dead worker is not a lost run: a rank's process exits mid-step, the group rebuilds its ranks from the last
weights they held, the call is re-sent, and the run ends with the metrics of an undisturbed run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.backends.ray import RayBackend
from flowrl.ir.graph import Graph

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

# Model calls per GRPO step: generate, ref.logprobs, actor.update (the on-policy-logp pass dropped the
# actor.logprobs forward). A rank counts its model calls from 1.
CALLS_PER_STEP = 3


def _run(graph: Graph, out: Path, use_backend: Callable[[Any], None],
         **options: Any) -> tuple[list[Any], list[int]]:
    backend = RayBackend(**options)
    use_backend(backend)
    restarts: list[int] = []
    result = flowrl.run(graph, out_dir=out, backend="ray",
                        on_step=lambda step, row: restarts.append(backend.groups["colocated"].restarts))
    return result.metrics, restarts


def test_one_rank_killed_mid_step(tiny: Callable[..., Graph], tmp_path: Path, local_metrics: Callable[..., Any],
                                  same_metrics: Callable[..., None], use_backend: Callable[[Any], None]) -> None:
    # The only rank dies at step 4's ref.logprobs: rebuilt from the snapshot taken after step 2's update
    # (one every 2 updates here), then step 3's update is replayed.
    metrics, restarts = _run(tiny(steps=4), tmp_path, use_backend, snapshot_every=2,
                             crash_on_call={"colocated": {0: 3 * CALLS_PER_STEP + 2}})
    assert restarts == [0, 0, 0, 1]
    same_metrics(local_metrics(steps=4), metrics)


def test_two_ranks_one_killed_in_the_gradient_all_reduce(tiny: Callable[..., Graph], tmp_path: Path,
                                                         local_metrics: Callable[..., Any],
                                                         same_metrics: Callable[..., None],
                                                         use_backend: Callable[[Any], None]) -> None:
    # Generation is broadcast (rank 0 samples the whole batch with the step seed, as one rank does), so this
    # 2-rank data-parallel run must give the one-rank metrics: logprobs split, the update all-reduced.
    graph = tiny(replicas=2)
    graph = graph.with_nodes([replace(n, dispatch="broadcast") if n.op == "generate" else n for n in graph.nodes])
    # Rank 1 dies at step 2's update, while rank 0 waits for it in the all-reduce; both are rebuilt from the
    # initial weights and replay step 1's update (no snapshot yet: one is taken every 10 updates by default).
    metrics, restarts = _run(graph, tmp_path, use_backend, crash_on_call={"colocated": {1: 2 * CALLS_PER_STEP}})
    assert restarts == [0, 1, 1]
    same_metrics(local_metrics(), metrics)
