"""Serverless instances give their devices back while tools run (issue 26 item 5): with environments slower than
releasing costs, a multi-turn generation on the serverless backend parks its waiting trajectories, ends its
instance task, and resumes them on another task once their outcomes are back on the run's env host; the
trajectories are the local backend's, and each resumed row prefilled its history once more."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl import backends
from flowrl.errors import ExecutionError
from flowrl.runtime.batch import Batch

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]
# a step takes a second: far longer than a decode step on any machine, so every turn end finds all rows waiting
ENV = '''
import time


class Sleepy:
    def __init__(self):
        self.left = 2

    def reset(self, row):
        return "="

    def step(self, action):
        time.sleep(1.0)
        self.left -= 1
        return "=" + str(len(action) % 10), float(action.endswith("+")), self.left <= 0


class Broken(Sleepy):
    def step(self, action):
        raise ValueError("no such move")
'''
FLOW = """\
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3,
                       context = 64 }
model ref : reference { source = actor }
data prompts = jsonl("data.jsonl") { batch = 4 }
env game = "envs_sleepy.Sleepy" { max_turns = 3, stop = "+", workers = 4, timeout = 30 }
use grpo(group = 2, max_tokens = 4, env = game)
"""


def _generate(tmp: Path, backend: str, flow: str = FLOW, hosts: list[Any] | None = None
              ) -> tuple[Batch, dict[str, float]]:
    """One multi-turn generate of `flow` on `backend`; `hosts` gets the serverless pool's env host actors."""
    tmp.mkdir()
    (tmp / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}", "answer": a + b}) + "\n"
                                            for a in range(3) for b in range(2)))
    (tmp / "envs_sleepy.py").write_text(ENV)
    (tmp / "game.flow").write_text(flow)
    graph = flowrl.load(str(tmp / "game.flow"))
    be = backends.make(backend)
    groups = be.start(graph, seed=0, device="cpu")
    try:
        gen = graph.node("rollout")
        group: Any = groups[gen.worker_group]
        if backend == "serverless":  # release at the first chance: no cost, a prediction from one latency
            group.policy = replace(group.policy, env_release_s=0.0, env_min_history=1)
        texts = ["0+1", "2+2", "1+0", "2+1"]
        prompts = Batch(4, {}, {"prompt": texts, "answer": [0] * 4, "prompt_slot": list(range(4))})
        out = group.call("generate", "actor", prompts, dict(gen.attrs), step_seed=11).result()
        metrics = group.take_metrics() if backend == "serverless" else {}
        if hosts is not None:
            hosts.extend(host for _, host in group.released.hosts.values())
    finally:
        be.shutdown()
    return out, metrics


def test_parked_trajectories_resume_on_another_instance_with_the_local_samples(tmp_path: Path) -> None:
    """...and once the backend shut down, its env host is gone: closed (its environments' processes with it),
    then killed, so no actor of the run stays on the cluster (a call to it fails; the GCS has it dead)."""
    import ray

    local, _ = _generate(tmp_path / "local", "local")
    hosts: list[Any] = []
    served, metrics = _generate(tmp_path / "serverless", "serverless", hosts=hosts)
    assert len(hosts) == 1
    for host in hosts:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(host.failed.remote(), timeout=60)
        assert ray._private.state.actors(host._actor_id.hex())["State"] == "DEAD"
    assert metrics["env/parks"] >= 1 and metrics["env/rounds"] == metrics["env/parks"] + 1
    assert metrics["env/resumed_rows"] >= 1
    # the loops' seconds after their last chunk count too: idle and wall sum to what the rounds reported
    assert 0.0 <= float(served["gen_idle_s"].sum()) <= float(served["gen_wall_s"].sum())
    real = local["response_mask"].bool()
    assert served.size == local.size == 8
    for r in range(local.size):
        assert served["response_ids"][r][served["response_mask"][r].bool()].tolist() == \
            local["response_ids"][r][real[r]].tolist()
        assert served["loss_mask"][r][served["response_mask"][r].bool()].tolist() == local["loss_mask"][r][real[r]].tolist()
    assert served["env_return"].tolist() == local["env_return"].tolist()
    assert served["group_id"].tolist() == local["group_id"].tolist()
    # every resumed row prefilled its history once more: more prefill in all than the local run's
    assert int(served["prefill_tokens"].sum()) > int(local["prefill_tokens"].sum())


def test_an_environment_that_fails_under_on_error_raise_is_a_run_error_naming_it(tmp_path: Path) -> None:
    flow = FLOW.replace("envs_sleepy.Sleepy", "envs_sleepy.Broken").replace("timeout = 30", 'timeout = 30, on_error = "raise"')
    with pytest.raises(ExecutionError, match=r"env `game` \(declared at .*game.flow:5:1\): .*raised ValueError: no such move"):
        _generate(tmp_path / "serverless", "serverless", flow)
