"""The Ray backend's held device-time as the cluster counts it (flowrl.runtime.cost, `RayBackend.reservations`):
a whole `flowrl run --backend ray` joined to a private head, its cost.json's `held_s` against a second driver on
the same cluster that integrates the CPUs its placement groups hold from `ray.available_resources()` over the
same run (tests/ray/slot_sampler.py counting CPU: on a cluster without GPUs each rank's bundle is one CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def _helper(name: str) -> Any:
    """A helper module beside this file (tests are not a package: pytest imports them by path)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster = _helper("cluster_head")
ROOT, head, longtail_flow = cluster.ROOT, cluster.head, cluster.longtail_flow
# the sampler, counting the CPUs in use instead of device slots: the Ray backend's bundles ask for CPUs here
SAMPLE_CPUS = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import slot_sampler as s; "
               "s.SLOT = 'CPU'; s.main(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))")


def _run_sampled(tmp_path: Path, steps: int) -> tuple[dict[str, float], dict[str, Any]]:
    """A Ray-backend run (two fixed pools of one rank) joined to a private head with 2 CPUs, sampled from
    outside -> (the sampler's figures, the run's cost.json)."""
    flow = longtail_flow(tmp_path, "1", "1")
    flow.write_text(flow.read_text().replace(", elastic = true", ""))  # fixed pools: one rank each
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with head(slots=0, cpus=2) as address:
        ready, counted = tmp_path / "sampling", tmp_path / "sampled.json"
        sampler = subprocess.Popen([sys.executable, "-c", SAMPLE_CPUS, str(HERE), address, str(counted), str(ready)],
                                   stdin=subprocess.PIPE, env=env, cwd=ROOT)
        try:
            while not ready.exists():  # the sampler counts from before the run reserves anything
                assert sampler.poll() is None, "the sampler ended before it began counting"
                try:
                    sampler.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass
            run = subprocess.run([sys.executable, "-m", "flowrl", "run", str(flow), "--backend", "ray",
                                  "--address", address, "--steps", str(steps), "--out", str(tmp_path / "run")],
                                 env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        finally:
            assert sampler.stdin is not None
            sampler.stdin.close()  # the run's driver has exited: its placement groups are gone
            sampler.wait(timeout=120)
    return json.loads(counted.read_text()), json.loads((tmp_path / "run" / "cost.json").read_text())


@pytest.mark.ray
def test_the_ray_backends_cost_report_holds_what_the_cluster_counted(tmp_path: Path) -> None:
    """Two integrals over the same run: the CPUs Ray had reserved for the placement groups, sampled every ~10 ms
    by another driver, and cost.json's `held_s` (from each placement group's grant, start-up to the first step
    included, to its removal after the last: `stopping_s`)."""
    sampled, cost = _run_sampled(tmp_path, steps=8)
    assert sampled["samples"] > 100 and sampled["most_busy"] == pytest.approx(2.0)  # both ranks' bundles
    assert cost["held_s"] == pytest.approx(sampled["busy_slot_s"], rel=0.05), (cost["held_s"], sampled)
    assert cost["starting_s"] > 0.0 and cost["stopping_s"] > 0.0
    assert sum(p["held_s"] for p in cost["pools"]) == pytest.approx(cost["held_s"])
