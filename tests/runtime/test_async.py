"""Asynchronous runs (`run { max_staleness = K }`, pass async-rollout, flowrl.runtime.ahead) on the process backend:
the versions samples were generated with, exact synchronous numbers through the same machinery at K = 0, exact
resume, failures, and backends that cannot keep two versions of the weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl.backends import make
from flowrl.engines.generation import forward_logprobs
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph
from flowrl.runtime.ahead import VERSION, Ahead
from flowrl.runtime.controller import Controller
from flowrl.runtime.runner import loaders_of, scorers_of
from flowrl.runtime.worker import ModelWorker


def write(make: Callable[..., Graph], *, k: int = 1, reward: str = "digits.reward", extra: str = "") -> Graph:
    """The shared split GRPO flow (tests/conftest.py), 6 steps, checkpoints every 2."""
    return make(k=k, reward=reward, use=extra, steps=6, run=", checkpoint_every = 2")


def numbers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics without timings (and the queue's own waits)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/", "cost/")) and not k.endswith("_idle_s")
             and k not in ("step_time_s", "tokens_per_s")} for r in rows]


def drive(graph: Graph, steps: int, staleness: int | None = None) -> tuple[list[Any], list[dict[str, torch.Tensor]]]:
    """Run `steps` asynchronous steps on the process backend by hand: each step's result and the policy's weights
    after each update (index v: version v; 0 = before training)."""
    backend = make("process")
    groups = backend.start(graph, seed=5, device="cpu")
    ctl = Controller(graph, groups, loaders_of(graph, 5), scorers_of(graph), seed=5)
    versions = [backend.snapshot("actor", "train")]
    ahead = Ahead(ctl, backend, first=1, last=steps, staleness=staleness)
    try:
        results = []
        for t in range(1, steps + 1):
            results.append(ahead.step(t))
            versions.append(backend.snapshot("actor", "train"))
    finally:
        ahead.close()
        backend.shutdown()
    return results, versions


def test_each_batch_is_generated_by_the_version_k_updates_back(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    """Checked on the weights, not on the driver's word: every sample's recorded log-probs (from generation) are
    what version max(0, t - 2) gives them, and not what the newer version t - 1 would."""
    graph = write(split_grpo, k=1)
    results, versions = drive(graph, 5)
    worker = ModelWorker([graph.model("actor")], graph.models, seed=5, device="cpu")
    module = worker.models["actor"].module
    for t, res in enumerate(results, start=1):
        rollout = res.values["rollout"]
        assert rollout[VERSION].tolist() == [max(0, t - 2)] * rollout.size
        assert res.metrics["async/staleness_max"] <= 1.0
        assert res.metrics["async/staleness_mean"] == (0.0 if t == 1 else 1.0)
        mask = rollout["response_mask"].float()

        def gap(version: int, rollout: Any = rollout, mask: torch.Tensor = mask) -> float:
            module.load_state_dict(versions[version])
            logp = forward_logprobs(module, rollout["prompt_ids"], rollout["prompt_mask"], rollout["response_ids"],
                                    rollout["response_mask"])
            return float(((logp - rollout["gen_logp"]).abs() * mask).max())

        assert gap(max(0, t - 2)) < 1e-4
        if t >= 2:
            assert gap(t - 1) > 1e-3  # the versions differ enough for the check to mean something


def test_the_asynchronous_machinery_at_k_0_gives_the_synchronous_numbers(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    """The rollout thread, queue and snapshots, driven at K = 0, reproduce today's synchronous step exactly."""
    sync = flowrl.run(write(split_grpo, k=0, extra=', is_correction = "none"'), out_dir=tmp_path / "sync",
                      backend="process", steps=4).metrics
    results, _ = drive(write(split_grpo, k=1, extra=', is_correction = "none"'), 4, staleness=0)
    for want, res in zip(sync, results, strict=True):
        for key, value in numbers([want])[0].items():
            if key != "step":
                assert res.metrics[key] == pytest.approx(value, abs=1e-6), key


def test_k_0_compiles_to_the_synchronous_graph(tmp_path: Path) -> None:
    plain = flowrl.load(str(Path(__file__).parents[2] / "examples" / "longtail_grpo.flow"))
    zero = flowrl.load(str(Path(__file__).parents[2] / "examples" / "longtail_grpo.flow"),
                       overrides={"run.max_staleness": "0"})
    assert [n.attrs for n in zero.nodes] == [n.attrs for n in plain.nodes]


def test_a_resumed_asynchronous_run_gives_the_metrics_of_an_uninterrupted_one(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    graph = write(split_grpo, k=1)
    whole = flowrl.run(graph, out_dir=tmp_path / "whole", backend="process").metrics

    def crash(step: int, row: dict[str, Any]) -> None:
        if step == 3:
            raise KeyboardInterrupt  # after step 3: the last checkpoint is step 2's

    with pytest.raises(KeyboardInterrupt):
        flowrl.run(graph, out_dir=tmp_path / "cut", backend="process", on_step=crash)
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step_000002.pt", weights_only=False)
    # batches 3 (version 1) and 4 (version 2) were generated ahead of the checkpoint and are in it
    assert sorted(state["ahead"]["queue"]) == [3, 4] and state["ahead"]["gen_version"] == 2
    resumed = flowrl.run(graph, out_dir=tmp_path / "cut", backend="process", resume=True).metrics
    assert numbers(resumed) == numbers(whole)
    assert [r["async/staleness_mean"] for r in resumed] == [0.0] + [1.0] * 5


def test_a_run_continued_for_more_steps_has_the_versions_it_needs(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    graph = write(split_grpo, k=2)
    whole = flowrl.run(graph, out_dir=tmp_path / "whole", backend="process").metrics
    flowrl.run(graph, out_dir=tmp_path / "short", backend="process", steps=3)
    longer = flowrl.run(graph, out_dir=tmp_path / "short", backend="process", resume=True).metrics
    assert numbers(longer) == numbers(whole)
    assert [r["async/version"] for r in longer] == [0, 0, 0, 1, 2, 3]


def test_a_failure_ahead_of_training_is_reported_with_its_node(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    (tmp_path / "boom.py").write_text(
        "calls = 0\n"
        "def reward(prompt, response, **_):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 32:  # 16 samples a step: step 3's rollout fails, ahead of step 3's training\n"
        "        raise ValueError('bad sample')\n"
        "    return 0.0\n")
    graph = write(split_grpo, k=1, reward="boom.reward")
    with pytest.raises(FlowError) as failed:
        flowrl.run(graph, out_dir=tmp_path / "out", backend="process")
    assert "scores = reward(rollout)" in failed.value.render() and "bad sample" in failed.value.render()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the steps before it were kept


def test_a_backend_sharing_the_weights_runs_synchronously_and_says_why(tmp_path: Path, split_grpo: Callable[..., Graph]) -> None:
    graph = write(split_grpo, k=1)
    res = flowrl.run(graph, out_dir=tmp_path / "out", backend="local", steps=2)
    about = json.loads((tmp_path / "out" / "run.json").read_text())
    assert "shared object" in about["synchronous"]
    assert not any(k.startswith("async/") for k in res.metrics[0])
