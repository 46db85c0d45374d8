"""The Ray backend's held device-time as the cluster counts it (flowrl.runtime.cost, `RayBackend.reservations`):
a whole `flowrl run --backend ray` joined to a private head, its cost.json's `held_s` against a second driver on
the same cluster that integrates the CPUs its placement groups hold from `ray.available_resources()` over the
same run (tests/ray/slot_sampler.py counting CPU: on a cluster without GPUs each rank's bundle is one CPU)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


@pytest.mark.ray
def test_the_ray_backends_cost_report_holds_what_the_cluster_counted(tmp_path: Path, cluster: ModuleType) -> None:
    """Two integrals over the same run: the CPUs Ray had reserved for the placement groups, sampled every ~10 ms
    by another driver, and cost.json's `held_s` (from each placement group's grant, start-up to the first step
    included, to its removal after the last: `stopping_s`)."""
    flow = cluster.longtail_flow(tmp_path, "1", "1")
    flow.write_text(flow.read_text().replace(", elastic = true", ""))  # fixed pools: one rank each
    # a private head with 2 CPUs and no device slot; the sampler counts the CPUs the Ray backend's bundles ask for
    sampled, cost = cluster.sampled_run(flow, tmp_path, "ray", slots=0, cpus=2, steps=8, resource="CPU")
    assert sampled["samples"] > 100 and sampled["most_busy"] == pytest.approx(2.0)  # both ranks' bundles
    cluster.check_held(cost, sampled)
    assert cost["starting_s"] > 0.0 and cost["stopping_s"] > 0.0
    assert sum(p["held_s"] for p in cost["pools"]) == pytest.approx(cost["held_s"])
