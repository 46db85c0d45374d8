"""The serverless backend on a Ray cluster whose autoscaler adds and removes nodes (issue 15, item 9).

Ray's fake multi-node provider (what `ray.cluster_utils.AutoscalingCluster` drives; its example config is not in
the wheel, so the config is written here) starts "nodes" as local raylets on demand. The head has no device slot;
a node type with two slots scales 0..2. A run with `--address` of that cluster asks for slots, so the autoscaler
must add a node before any instance can run; once the run's pools are idle, the idle nodes go.

`ray start` / `ray stop --force` act on every Ray on this machine, so this runs in a pytest process of its own
(`make test` runs it after the rest; tests/conftest.py also orders it last).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.autoscaling

CONFIG = {
    "cluster_name": "flowrl-autoscaling-test", "max_workers": 2,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "slots": {"resources": {"CPU": 2, "device_slot": 2, "object_store_memory": 300_000_000},
                  "node_config": {}, "min_workers": 0, "max_workers": 2},
    },
    "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.05,
    "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
    "rsync_filter": [],
}

# Runs in a child process. Nodes added: the node table after the run (Ray keeps removed nodes in it, dead), so
# no watcher has to catch them alive. Nodes removed: the autoscaler removes an idle node by killing its raylet,
# so the child waits for those processes to exit (the event itself; Ray offers none to a driver). The 300 s bound
# only turns "never removed" into a failure instead of a hang: it does not race the removal on a slow machine,
# and a fast one returns as soon as the processes are gone.
CHILD = r"""
import json, sys
import psutil
import ray
import flowrl
address, flow, out = sys.argv[1:4]
ray.init(address=address, log_to_driver=False)

def slot_nodes():
    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("device_slot", 0) > 0]

def raylets(nodes):  # a node's raylet process, found by its socket (unique per node)
    sockets = {f"--raylet_socket_name={n['RayletSocketName']}" for n in nodes}
    return [p for p in psutil.process_iter(["cmdline"]) if sockets & set(p.info["cmdline"] or [])]

before = {n["NodeID"] for n in ray.nodes()}
slots_before = len(slot_nodes())
res = flowrl.run(flowrl.load(flow), out_dir=out, backend="serverless", backend_options={"address": address})
new = [n for n in ray.nodes() if n["NodeID"] not in before]
found = len(raylets([n for n in ray.nodes() if n["NodeID"] in before and n["Alive"]]))  # the head's: 1
watched = raylets(new)  # the added nodes' raylets still running (none if the autoscaler was quicker)
_, alive = psutil.wait_procs(watched, timeout=300)  # until they exit
print(json.dumps({"before": slots_before, "added": len(new), "found": found, "watched": len(watched),
                  "after": len(alive),
                  "steps": len(res.metrics), "held_s": res.cost.get("held_s", 0.0)}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demand_adds_nodes_and_idle_nodes_go(split_grpo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import ray

    if ray.is_initialized():  # this process's own Ray (another test's) is about to be stopped
        ray.shutdown()
    split_grpo(steps=2)
    port = _free_port()
    config = tmp_path / "cluster.json"  # the fake provider starts nodes against this GCS (its default: port 6379)
    config.write_text(json.dumps({**CONFIG, "provider": {**CONFIG["provider"], "gcs_address": f"127.0.0.1:{port}"}}))
    env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "disabled"}
    ray_cli = str(Path(sys.executable).parent / "ray")  # the environment's own `ray` command
    subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, check=False)
    subprocess.run([ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1", f"--autoscaling-config={config}",
                    "--include-dashboard=false"], env=env, capture_output=True, check=True)
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, f"127.0.0.1:{port}", str(tmp_path / "f.flow"),
                                str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]
        seen = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, check=False)
    assert seen["before"] == 0  # scaled to zero when the run began: nothing could run without the autoscaler
    assert seen["steps"] == 2 and seen["held_s"] > 0
    assert 1 <= seen["added"] <= 2  # demand added nodes (at most the type's max)
    assert seen["found"] == 1  # a running raylet is found by its socket (so "none running" below means something)
    assert seen["after"] == 0  # and once the pools were idle, the idle nodes went (their raylets exited)
