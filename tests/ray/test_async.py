"""An asynchronous run (run { max_staleness = 1 }) on the Ray backend: the same numbers as on the process
backend, so the snapshots go through the object store to the generation actors at the versions the schedule
names (Ray's own pull-before-use sync is off for that model: it would hand generation the newest weights)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import flowrl
from flowrl.ir.graph import Graph

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

def test_ray_runs_an_asynchronous_flow_with_the_process_backends_numbers(
        tmp_path: Path, same_metrics: Callable[..., None], split_grpo: Callable[..., Graph]) -> None:
    graph = split_grpo(k=1, steps=5)
    runs = {}
    for backend in ("process", "ray"):
        metrics = flowrl.run(graph, out_dir=tmp_path / backend, backend=backend).metrics
        runs[backend] = [{k: v for k, v in r.items() if not k.startswith(("async/", "time/", "cost/"))} for r in metrics]
        assert [r["async/version"] for r in metrics] == [0, 0, 1, 2, 3]
    assert len({r["reward_mean"] for r in runs["ray"]}) > 1  # the policy moved: versions differ
    same_metrics(runs["process"], runs["ray"], tol=1e-4)
