"""One dispatch: the same flow with 2 ranks per group on the threads, process and ray backends gives the same
numbers (each plans its calls with `flowrl.runtime.dispatch`, runs them on its ranks and merges the results).

Thread ranks share one copy of the weights and run an update once on the whole batch; process and Ray ranks
each train on their shard with the global denominators and all-reduced gradients: the same update, to float
rounding. Generation: rank r samples with the rank seed of the step seed, on every backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.ir.graph import Graph

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

SPLIT = """placement {
    pool gen   { gpus = 1 }
    pool infer { gpus = 1 }
    actor -> gen
    ref, critic -> infer
}"""


@pytest.mark.parametrize("algo,placement", [("grpo", ""), ("ppo", SPLIT)], ids=["grpo-colocated", "ppo-split"])
def test_threads_process_and_ray_with_two_ranks_give_the_same_numbers(
        tiny: Callable[..., Graph], same_metrics: Callable[..., None], tmp_path: Path, algo: str,
        placement: str) -> None:
    graph = tiny(algo=algo, replicas=2, steps=2, batch=4, max_tokens=3, placement=placement)
    assert {w.ranks for w in graph.worker_groups} == {2}
    runs: dict[str, list[dict[str, Any]]] = {}
    for backend in ("threads", "process", "ray"):
        runs[backend] = [{k: v for k, v in r.items() if not k.startswith(("fusion/", "time/sync"))}
                         for r in flowrl.run(graph, out_dir=tmp_path / backend, backend=backend).metrics]
    assert runs["threads"][0]["reward_mean"] == runs["ray"][0]["reward_mean"]  # same samples at step 1
    same_metrics(runs["threads"], runs["process"], tol=1e-4)
    same_metrics(runs["process"], runs["ray"], tol=1e-4)
