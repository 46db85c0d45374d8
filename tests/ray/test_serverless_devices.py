"""Serverless instances on the devices the cluster has (backends/serverless/devices.py) and their models moved
off the device before it is given back (backends/serverless/cache.py, instance.py): on a Ray instance that
declares GPUs this machine does not have (tests/ray/fake_gpus.py, a process of its own), and on this machine's
logical device slots, where the same moves run CPU to CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.backends.serverless.devices import NOSET
from flowrl.ir.graph import Graph

pytestmark = pytest.mark.ray
HERE = Path(__file__).resolve().parent


def test_each_instance_runs_on_the_gpu_ray_assigned_it() -> None:
    """With GPUs in the cluster an instance asks for a GPU (not a device slot) and builds its models on the one
    Ray assigned it: Ray's ids are the node's GPUs 5 and 7, which the process sees as cuda:0 and cuda:1. Two
    instances alive at once hold one each; with `gpu_fraction = 0.5` four share the two, two on each. An instance
    of a slot-asking pool there (device "auto") refuses to run on the CPU beside the GPUs it was not given."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, str(HERE / "fake_gpus.py")], capture_output=True, text=True, env=env,
                          timeout=540, cwd=HERE.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    place = {"5": "cuda:0", "7": "cuda:1"}
    for phase, share, each in (("whole", 1.0, 1), ("half", 0.5, 2)):
        options, stats = got[phase]["options"], got[phase]["stats"]
        assert options["num_gpus"] == share and "resources" not in options  # no device_slot on a GPU cluster
        assert options["runtime_env"]["env_vars"] == {NOSET: "1"} and options["num_cpus"] == 1.0
        ids = [s["gpu_ids"] for s in stats]
        assert all(len(i) == 1 for i in ids) and Counter(i[0] for i in ids) == {"5": each, "7": each}
        for s in stats:
            assert s["device"] == s["models_on"] == place[s["gpu_ids"][0]]  # chosen, and where its worker built
            assert s["served"] and not s["kept_on_device"]
    # a slot taken on a node with GPUs: never a silent CPU run beside them
    assert got["slot"].startswith('device "auto": this instance took a `device_slot`, not a GPU, on a node with 2 '
                                  "GPU(s)")


def _instance_stats(ray_session: Any, graph: Graph, *, keep_warm: bool = True, on_device: bool = False
                    ) -> list[dict[str, Any]]:
    """Two calls of a pool's instance tasks on this machine's device slots, the second warm where the first's
    process is reused -> their stats."""
    from flowrl.backends.serverless.devices import devices_for
    from flowrl.backends.serverless.instance import Build, remote_serve

    ray = ray_session
    build = Build((graph.model("actor"),), graph.models, 0, "auto", keep_warm, ("actor",), keep_on_device=on_device)
    options = devices_for(ray.cluster_resources()).options()
    assert options == {"num_cpus": 1.0, "resources": {"device_slot": 1}}  # no GPU here: a logical slot
    key = (f"devices-{keep_warm}-{on_device}", "gen")
    out = []
    for _ in range(2):
        ref = remote_serve.options(**options, num_returns=4).remote(key, build, {}, "pad_id", ("actor",), {}, 0)
        out.append(ray.get(ref[1]))
    return out


def test_an_instance_moves_its_models_to_host_memory_before_it_gives_the_device_back(
        ray_session: Any, tiny: Any) -> None:
    """Without GPUs the same path runs: the models are moved off the device (CPU to CPU, no copy) when the task
    ends, and moved back when next called; `keep_warm = "device"` keeps them there (said in the stats);
    `keep_warm = false` drops them."""
    graph = tiny()
    for s in _instance_stats(ray_session, graph):
        assert s["device"] == s["models_on"] == "cpu" and s["gpu_ids"] == []
        assert not s["kept_on_device"] and s["offload_s"] > 0.0  # moved, and timed (as loading)
        assert s["load_s"] >= s["offload_s"] and "mem_floor" not in s  # no CUDA: no device memory to read
    for s in _instance_stats(ray_session, graph, on_device=True):
        assert s["kept_on_device"] and s["offload_s"] == 0.0
    for s in _instance_stats(ray_session, graph, keep_warm=False):
        assert s["cold"] and not s["kept_on_device"] and s["offload_s"] == 0.0  # dropped: each task builds


def test_a_pool_key_declares_the_gpu_share_and_where_models_wait(flow_text: Any) -> None:
    placement = ('placement {\n    pool gen { gpus = 2, gpu_fraction = 0.5, keep_warm = "device" }\n'
                 '    pool train { gpus = 1 }\n    actor.generate -> gen\n    actor.update, ref -> train\n}')
    graph = flowrl.compile_flow(flow_text(placement=placement), "/flows/p.flow")
    assert {p.name: dict(p.options) for p in graph.pools} == {
        "gen": {"gpu_fraction": 0.5, "keep_warm": "device"}, "train": {}}
    bad = placement.replace("0.5", "1.5").replace('"device"', '"devce"')
    with pytest.raises(flowrl.FlowError) as e:
        flowrl.compile_flow(flow_text(placement=bad), "/flows/p.flow")
    assert str(e.value) == (
        '/flows/p.flow:8:41: error: `gpu_fraction` must be a number in (0, 1], got the number 1.5\n'
        '        pool gen { gpus = 2, gpu_fraction = 1.5, keep_warm = "devce" }\n'
        '                                            ^^^\n'
        'hint: the share of one GPU each instance asks for, e.g. `gpu_fraction = 0.5`\n'
        '/flows/p.flow:8:58: error: `keep_warm` must be "host" or "device", got the string "devce"\n'
        '        pool gen { gpus = 2, gpu_fraction = 1.5, keep_warm = "devce" }\n'
        '                                                             ^^^^^^^\n'
        'hint: did you mean `device`?')


def test_a_pool_that_keeps_its_models_on_the_device_says_so_in_the_cost_report(
        tmp_path: Path, split_grpo: Any) -> None:
    """`pool gen { keep_warm = "device" }`: the generation pool's tasks leave their models on the device (the
    cost report counts them, and charges the devices their processes hold between tasks, to the run's end, as
    `cost/gen/kept_s` within the pool's held); the train pool's move theirs to host memory. Every instance's span
    names the device it chose: this machine's CPU."""
    res = flowrl.run(split_grpo(steps=2, gen='1, keep_warm = "device"'), out_dir=tmp_path / "out",
                     backend="serverless")
    events = [e for e in json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") == "held"]
    tracks = {e["tid"]: e["args"]["name"] for e in json.loads((tmp_path / "out" / "trace.json").read_text())[
        "traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert events and all(e["name"].endswith(" on cpu") for e in events)
    for row in res.metrics:
        gen = [e for e in events if tracks[e["tid"]] == "gen instances" and e["args"]["step"] == row["step"]]
        assert gen and row["cost/kept_on_device"] == len(gen)  # the train pool's tasks are not counted
        assert row["cost/device_left_bytes"] == 0.0  # no CUDA: nothing measured as left
        # the generation pool's processes hold their device between tasks too: in its held, and apart
        assert row["cost/gen/kept_s"] > 0.0 and "cost/train/kept_s" not in row
        assert row["cost/gen/held_s"] == pytest.approx(sum(e["dur"] for e in gen) / 1e6 + row["cost/gen/kept_s"],
                                                       abs=1e-4)
        assert row["cost/kept_s"] == row["cost/gen/kept_s"]
    # held to the run's end: cost.json has what was kept after the last step's row as well
    assert res.cost["kept_s"] > sum(r["cost/kept_s"] for r in res.metrics)
