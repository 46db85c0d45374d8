"""The serverless backend on a Ray cluster whose autoscaler adds and removes nodes (issue 15 item 9, issue 34
item 6).

Ray's fake multi-node provider (what `ray.cluster_utils.AutoscalingCluster` drives; its example config is not in
the wheel, so the config is written here) starts "nodes" as local raylets on demand. The head has no device: a
node type with two device slots scales 0..2, and a node type that declares two GPUs this machine does not have
(Ray counts and assigns them like real ones: enough to test which instances get a GPU) scales 0..1. A run with
`--address` of that cluster asks for devices, so the autoscaler must add a node before any instance can run:
slots for a flow that asks for none of the GPUs, GPUs for a flow whose pools ask for them (`gpu_fraction`, a
model's `gpus`), though the cluster had none when the run started; once the run's pools are idle, the idle nodes
go.

The head is a private one (tests/ray/cluster_head.py: free ports, its own session, killed with everything it
started, the autoscaler's nodes included), never `ray stop`, which would stop every Ray on this machine. The
tests still run in a pytest process of their own (`make test` runs them after the rest; tests/conftest.py also
orders them last): each starts nodes as processes of this machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from flowrl.ir.graph import Graph

pytestmark = pytest.mark.autoscaling
HEAD = Path(__file__).resolve().parents[1] / "ray" / "cluster_head.py"

CONFIG = {
    "cluster_name": "flowrl-autoscaling-test", "max_workers": 3,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "slots": {"resources": {"CPU": 2, "device_slot": 2, "object_store_memory": 300_000_000},
                  "node_config": {}, "min_workers": 0, "max_workers": 2},
        "gpus": {"resources": {"CPU": 2, "GPU": 2, "object_store_memory": 300_000_000},
                 "node_config": {}, "min_workers": 0, "max_workers": 1},
    },
    "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.05,
    "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
    "rsync_filter": [],
}

# Runs in a child process. Nodes added: the node table after the run (Ray keeps removed nodes in it, dead, with
# their resources emptied), so no watcher has to catch them alive; what kind they were, the run's instances say. Nodes removed: the autoscaler removes an idle node by killing its raylet,
# so the child waits for those processes to exit (the event itself; Ray offers none to a driver). The 300 s bound
# only turns "never removed" into a failure instead of a hang: it does not race the removal on a slow machine,
# and a fast one returns as soon as the processes are gone.
CHILD = r"""
import json, sys
import psutil
import ray
import flowrl
address, flow, out, device = sys.argv[1:5]
ray.init(address=address, log_to_driver=False)

def raylets(nodes):  # a node's raylet process, found by its socket (unique per node)
    sockets = {f"--raylet_socket_name={n['RayletSocketName']}" for n in nodes}
    return [p for p in psutil.process_iter(["cmdline"]) if sockets & set(p.info["cmdline"] or [])]

before = {n["NodeID"] for n in ray.nodes()}
had = ray.cluster_resources()
res = flowrl.run(flowrl.load(flow), out_dir=out, backend="serverless", backend_options={"address": address},
                 device=device)
new = [n for n in ray.nodes() if n["NodeID"] not in before]
found = len(raylets([n for n in ray.nodes() if n["NodeID"] in before and n["Alive"]]))  # the head's: 1
watched = raylets(new)  # the added nodes' raylets still running (none if the autoscaler was quicker)
_, alive = psutil.wait_procs(watched, timeout=300)  # until they exit
print(json.dumps({"had": had, "added": len(new), "found": found, "watched": len(watched),
                  "after": len(alive), "steps": len(res.metrics), "cost": res.cost}))
"""


@pytest.fixture(scope="module")
def autoscaling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private head with the fake autoscaler (the CONFIG's node types) -> its address."""
    import ray

    if ray.is_initialized():  # this process's own Ray (another test's): the children join the head instead
        ray.shutdown()
    spec = importlib.util.spec_from_file_location("cluster_head", HEAD)
    assert spec is not None and spec.loader is not None
    head: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(head)
    port = head.free_port()
    config = tmp_path_factory.mktemp("autoscaling") / "cluster.json"  # the fake provider starts nodes against
    config.write_text(json.dumps({**CONFIG, "provider": {**CONFIG["provider"],  # this GCS (default: port 6379)
                                                         "gcs_address": f"127.0.0.1:{port}"}}))
    env = {"AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"}
    with head.head(0, cpus=1, extra=(f"--autoscaling-config={config}", "--node-ip-address=127.0.0.1"), env=env,
                   port=port) as address:
        yield address


def _spans(out: Path) -> list[str]:
    """The run's instance tasks as its trace names them (`instance PID on DEVICE[, GPU ID]`)."""
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    return [e["name"] for e in trace if e.get("ph") == "X" and e.get("cat") == "held"]


def _run(address: str, flow: Path, out: Path, device: str) -> dict[str, object]:
    env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "disabled"}
    child = subprocess.run([sys.executable, "-c", CHILD, address, str(flow), str(out), device], env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return dict(json.loads(child.stdout.strip().splitlines()[-1]))


def test_demand_adds_nodes_and_idle_nodes_go(split_grpo: Callable[..., Graph], autoscaling: str,
                                              tmp_path: Path) -> None:
    """A flow that asks for no GPU, on the CPU (`device = "cpu"`): its instances take device slots, which the
    cluster has none of until its autoscaler adds a slot node."""
    split_grpo(steps=2)
    seen = _run(autoscaling, tmp_path / "f.flow", tmp_path / "out", "cpu")
    assert "device_slot" not in seen["had"] and "GPU" not in seen["had"]  # scaled to zero when the run began
    cost = seen["cost"]
    assert isinstance(cost, dict) and seen["steps"] == 2 and cost["held_s"] > 0
    assert isinstance(seen["added"], int) and 1 <= seen["added"] <= 2  # demand added nodes (at most the type's max)
    spans = _spans(tmp_path / "out")
    assert spans and not any(", GPU " in s for s in spans), spans  # on device slots: no GPU given to any
    assert seen["found"] == 1  # a running raylet is found by its socket (so "none running" below means something)
    assert seen["after"] == 0  # and once the pools were idle, the idle nodes went (their raylets exited)


def test_a_pool_asking_for_gpus_gets_them_from_the_autoscaler(split_grpo: Callable[..., Graph], autoscaling: str,
                                                              tmp_path: Path) -> None:
    """Both pools ask for GPUs though the cluster has none: generation a half GPU an instance (`gpu_fraction`)
    with a lower bound of one (the run asks the autoscaler for it before it starts), training a whole one (the
    model's `gpus`). The autoscaler adds the GPU node, and every instance task ran with a GPU Ray assigned it
    (the models on the CPU, `device = "cpu"`: these GPUs are declared, not real), its device-seconds counted
    from Ray's records."""
    graph = split_grpo(steps=2, gen="1..2, gpu_fraction = 0.5")
    text = (tmp_path / "f.flow").read_text().replace('charset = "0123456789+="',
                                                      'charset = "0123456789+=", gpus = 1')
    (tmp_path / "f.flow").write_text(text)
    assert graph.pools[0].options["gpu_fraction"] == 0.5
    seen = _run(autoscaling, tmp_path / "f.flow", tmp_path / "out", "cpu")
    assert "GPU" not in seen["had"] and "device_slot" not in seen["had"]  # no device of either kind at the start
    cost = seen["cost"]
    assert isinstance(cost, dict) and seen["steps"] == 2 and cost["held_s"] > 0 and cost["measured_frac"] == 1.0
    assert seen["added"] == 1  # one node: the GPU node (the head has none; the type allows one), no slot node
    spans = _spans(tmp_path / "out")
    assert spans and all(" on cpu, GPU " in s for s in spans), spans  # each instance was given a GPU
    assert seen["after"] == 0  # the GPU node went once idle
