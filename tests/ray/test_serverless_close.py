"""After a serverless run, nothing it started holds anything on the cluster (backends/serverless/backend.py,
`shutdown`): on a cluster the driver stays connected to (a notebook, a script that goes on, the autoscaling test's
child), no actor of the run is alive, every node's resources are all available again and Ray reports every node
IDLE (what Ray's autoscaler reads to remove a node it added: no actor, no leased worker, no object pinned in its
store). Without this, the run's Mailbox actor and the last weight versions pinned by the pools kept a node busy
for good (issue 24: an added node was never removed).

Each run is a child process that joins a private Ray head (tests/ray/cluster_head.py), runs the flow with
`flowrl.run` and stays connected while it looks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.ray


# The child: run, then wait until the cluster is left as it was or LEFT_S passed, and say what it saw last. The
# bound only turns "never released" into a failure instead of a hang: the leases of the last tasks go back to
# the raylet, and the raylet reports its node's state to the GCS, a moment after `flowrl.run` returns, so the
# child watches for the state itself rather than sleeping a fixed time.
CHILD = r"""
import json, sys, time
import ray
import ray._private.state
import flowrl
from ray.autoscaler.v2 import sdk
from ray.core.generated.autoscaler_pb2 import NodeStatus
address, flow, out = sys.argv[1:4]
LEFT_S = 120.0
ray.init(address=address, log_to_driver=False)
res = flowrl.run(flowrl.load(flow), out_dir=out, backend="serverless", backend_options={"address": address})

def looked():
    actors = sorted(a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] == "ALIVE")
    nodes = sdk.get_cluster_resource_state(ray._private.worker.global_worker.gcs_client).node_states
    return {"actors": actors, "available": ray.available_resources(), "total": ray.cluster_resources(),
            "nodes": [NodeStatus.Name(n.status) for n in nodes if n.status != NodeStatus.DEAD]}

deadline = time.monotonic() + LEFT_S
seen = looked()
while not (not seen["actors"] and seen["available"] == seen["total"] and set(seen["nodes"]) == {"IDLE"}):
    if time.monotonic() > deadline:
        break
    time.sleep(0.2)
    seen = looked()
print(json.dumps({**seen, "steps": len(res.metrics)}))
"""


def _left_on(cluster: ModuleType, flow: Path, out: Path, slots: int) -> dict[str, Any]:
    """Run `flow` (serverless, joined to a private head of `slots` device slots) -> what the cluster held after."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with cluster.head(slots) as address:
        child = subprocess.run([sys.executable, "-c", CHILD, address, str(flow), str(out)], env=env,
                               cwd=cluster.ROOT, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    return dict(json.loads(child.stdout.strip().splitlines()[-1]))


def _assert_nothing_left(seen: dict[str, Any], steps: int) -> None:
    assert seen["steps"] == steps
    assert seen["actors"] == []  # the run's Mailbox ended with it
    assert seen["available"] == seen["total"]  # no slot, CPU or object-store byte still taken
    assert seen["nodes"] == ["IDLE"]  # the head (its only node): no leased worker, no actor, no pinned object


@pytest.mark.parametrize("gen, k", [("1", 0), ("0..2", 1)], ids=["lower-bounds-warm", "async-prewarmed"])
def test_nothing_of_the_run_stays_on_the_cluster(split_grpo: Any, tmp_path: Path, cluster: ModuleType, gen: str,
                                                 k: int) -> None:
    """Both pools keep their lower bound warm (`gpus = 1` reads 1..1), or generation scales 0..2 and rolls out
    one step ahead (max_staleness 1, the rollout thread), each pool's instances pre-warmed and released."""
    split_grpo(gen=gen, k=k, steps=3)
    _assert_nothing_left(_left_on(cluster, tmp_path / "f.flow", tmp_path / "out", 2), 3)


def test_nothing_stays_after_a_streamed_migrating_run(tmp_path: Path, cluster: ModuleType) -> None:
    """A long-tail flow with pre-warm, migration, the deduplicated prefill and a fused stage streamed between
    the pools (its chunks and words handed over in the Mailbox): nothing of those stays either."""
    flow = cluster.longtail_flow(tmp_path, "1..2", "1..1", batch=4, group=4, max_tokens=16,
                                 run=', prewarm = true, migrate_at = 0.5, dedup_prefill = "auto", '
                                     "prewarm_margin = 0.5, cost_weight = 1.0, steps = 3")
    _assert_nothing_left(_left_on(cluster, flow, tmp_path / "run", 3), 3)
