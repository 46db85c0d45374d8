"""No deadlock, no silent hang (backends/serverless/slots.py): a long-tail GRPO flow with pre-warm, migration and
the deduplicated prefill on, joined to clusters of exactly 2 and 1 device slots, runs its steps to the end; a
pool whose lower bound the cluster cannot give fails with an error naming it. Each run is a `flowrl run
--address` process bounded by a timeout, so a hang fails the test instead of stopping the suite."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.ray


STEPS = 30


@pytest.mark.parametrize("slots, fused, tokens", [(2, False, 64), (2, True, 16), (1, True, 16)],
                         ids=["2-unfused", "2-fused", "1-fused"])
def test_the_long_tail_flow_runs_to_the_end_on_a_small_cluster(tmp_path: Path, cluster: ModuleType, slots: int,
                                                                fused: bool, tokens: int) -> None:
    """Each pool keeps its lower bound warm (1 each: as many as the 2 slots, more than 1), pre-warms from the
    step history, migrates (unfused, long enough that two instances are the fastest at cost_weight 1) and dedups
    the prefill; fused, a generation instance streams to a train instance, which waits for its chunks."""
    flow = cluster.longtail_flow(tmp_path, "1..3", "1..1", batch=8 if tokens > 16 else 4, group=4, max_tokens=tokens,
                                 run=', prewarm = true, migrate_at = 0.5, dedup_prefill = "auto", '
                                     "prewarm_margin = 0.5, cost_weight = 1.0")
    with cluster.head(slots) as address:
        done = cluster.run_flow(flow, address, tmp_path / "run", steps=STEPS, timeout_s=1200,
                                extra=() if fused else ("--no-pass", "fuse-gen-inference"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # never more instances waiting on one another than can run at once: a streamed stage's train instance too
    # (on one slot a stage cannot stream, generation and forwards both waiting: it runs unfused)
    assert all(r.get("scale/rollout/instances", 1.0) <= slots - (1 if "fusion/workers" in r else 0) for r in rows)
    assert any("fusion/workers" in r for r in rows) == (fused and slots > 1)
    assert sum(r["cost/prewarm_ready"] + r.get("cost/prewarm_late", 0.0) for r in rows) > 0
    assert all("prefill/rollout/prefixes" in r for r in rows)  # the shared opening found every step
    if slots == 2 and not fused:
        assert any(r.get("migrate/rollout/moved", 0.0) > 0 for r in rows)  # tails handed over


def test_a_pool_the_cluster_cannot_hold_fails_naming_it(tmp_path: Path, cluster: ModuleType) -> None:
    flow = cluster.longtail_flow(tmp_path, "3..3", "1..1", run=", acquire_timeout = 1")
    with cluster.head(2) as address:
        done = cluster.run_flow(flow, address, tmp_path / "run", steps=2, timeout_s=600)
    assert done.returncode != 0
    line = next(x for x in flow.read_text().splitlines() if "pool rollout" in x)
    col = line.index("pool") + 1
    assert (f"{flow}:{8}:{col}: error: pool `rollout` could not get 3 device slot(s) within 1s (each instance asks "
            "for {CPU: 1, device_slot: 1}); the Ray cluster has 2 `device_slot` (2 free) and 2 CPU") in done.stderr
    assert "hint: lower the pool's lower bound (`gpus = LO..HI`)" in done.stderr
