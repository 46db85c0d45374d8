"""LoRA on the serverless backend (backends/serverless with flowrl.runtime.lora_state): generation and training are
pools of instances that hand each version of the policy over through the object store, and a LoRA policy's version
is its adapters alone (the base every instance rebuilds from the seed): the run gives the process backend's numbers,
so every generation instance sampled with the adapters the schedule names, and what an update hands over is the
adapters' bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.ir.graph import Graph
from flowrl.runtime.transport import pack
from flowrl.runtime.worker import ModelWorker

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]
TIMES = ("time/", "cost/", "async/", "scale/", "migrate/", "fusion/", "prefill/")


def numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMES) and k not in ("step_time_s", "tokens_per_s")}
            for r in rows]


def test_a_lora_policy_on_serverless_pools_gives_the_process_backends_numbers(
        tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    split_grpo(steps=3)  # writes the flow, its data and reward into tmp_path
    graph = flowrl.load(str(tmp_path / "f.flow"), overrides={"actor.lora_rank": 4, "actor.lr": 2e-2})
    served = numbers(flowrl.run(graph, out_dir=tmp_path / "serverless", backend="serverless").metrics)
    fixed = numbers(flowrl.run(graph, out_dir=tmp_path / "process", backend="process").metrics)
    assert [r["step"] for r in served] == [1, 2, 3] and served[-1]["kl_mean"] != 0  # the adapters moved the policy off its base
    for a, b in zip(served, fixed, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-4), key
    # what an update hands to the other pool: the adapters (4 layers' A and B) and their optimizer state
    worker = ModelWorker([graph.model("actor")], graph.models, seed=5)
    state = worker.state_dict()["actor"]
    moved = sum(a.data.nbytes for a in pack(state["module"]).values())
    whole = sum(p.numel() * p.element_size() for p in worker.models["actor"].module.parameters())
    assert moved == sum(p.numel() * 4 for p in worker.models["actor"].module.parameters() if p.requires_grad)
    assert moved < 0.2 * whole
