"""Ranges mean what they say (`gpus = LO..HI` on an elastic pool): LO instances kept warm and counted, never more
than HI, and forwards sized by the generation's cost rule from their measured time per row, not by HI; and the
migration sink chosen by flowrl.elastic.migration_target, as the simulator does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.backends.serverless import ServerlessBackend
from flowrl.backends.serverless.scaling import Policy, Scaler
from flowrl.elastic import migration_sink
from flowrl.elastic.scale import DecodeCurve, choose_instances
from flowrl.runtime.protocol import Usage

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }}
model ref : reference {{ source = actor }}
reward scored = "digits.reward"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use grpo(reward = scored, group = 4, max_tokens = 3, kl_coef = 0.01)
placement {{
    pool gen   {{ gpus = {gen}, elastic = true }}
    pool train {{ gpus = {train}, elastic = true }}
    actor.generate -> gen
    actor.update, ref -> train
}}
run {{ steps = {steps}, seed = 5 }}
"""


def _flow(tmp_path: Path, gen: str, train: str, steps: int = 3) -> Any:
    (tmp_path / "digits.py").write_text("def reward(prompt, response, **_):\n"
                                        "    return float(sum(c.isdigit() for c in response))\n")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.flow").write_text(FLOW.format(gen=gen, train=train, steps=steps))
    # unfused, so the forwards are calls of the train pool (fused, they run in the generation's stream)
    return flowrl.load(str(tmp_path / "f.flow"), no_pass=("fuse-gen-inference",))


def test_the_sink_is_the_instance_migration_target_names() -> None:
    # the most predicted work is kept to the end; the others' rows fit in what it has free
    assert migration_sink([5.0, 9.0, 7.0], [4, 4, 4]) == 1
    assert migration_sink([3.0, 3.0], [4, 4]) == 1  # ties: the later shard (length-ranked: the longest prompts)
    assert migration_sink([8.0], [4]) is None  # one instance: nothing to migrate


def test_a_forward_takes_the_cost_rules_count_not_the_upper_size() -> None:
    s = Scaler("train", 16, Policy(cost_weight=0.5))
    assert s.forward("logprobs", 64) == (1, None)  # not measured yet: one instance, not 16
    used = [Usage("train", "train", 1, 0.0, 0.0, 0.0, 0.64, False, outside_s=0.5)]
    s.learn_forward("logprobs", [64], used)  # 0.01 s a row, 0.5 s a task beyond its method
    n, choice = s.forward("logprobs", 64)
    # T(N) = 0.5 + 0.01 * (the largest of N near-equal runs of 64), C(N) = 0.5 N + 0.64; the score
    # 0.5 T / min T + 0.5 C / min C: N=1 1.556, N=2 1.479, N=3 1.605 ... N=16 ~4.0
    assert n == 2 and choice is not None
    assert {c.instances: round(c.score, 3) for c in choice.candidates}[2] == pytest.approx(1.479, abs=1e-3)
    same = choose_instances([1.0] * 64, 1, range(1, 17), DecodeCurve({1: 0.01, 2: 0.02}), 0.5, 0.5)
    assert [c.score for c in choice.candidates] == pytest.approx([c.score for c in same.candidates])
    assert Scaler("train", 16, Policy(scale=False)).forward("logprobs", 64) == (16, None)  # ablation: the upper


@pytest.mark.ray
def test_the_lower_bound_is_kept_warm_and_the_upper_never_passed(tmp_path: Path, ray_session: Any) -> None:
    graph = _flow(tmp_path, gen="2..3", train="0..4")
    be = ServerlessBackend()
    warm: list[int] = []
    res = flowrl.run(graph, out_dir=tmp_path / "out", backend=be,
                     on_step=lambda step, row: warm.append(be.groups["gen"].prewarm.waiting()))
    assert warm == [2, 2, 2]  # between steps the generation pool holds its two
    assert all(r.get("scale/gen/instances", 1.0) <= 3 for r in res.metrics)  # never more than 3
    # the waiting instances are held and counted (in the step they served or were released in, or after)
    assert res.cost["held_s"] > sum(r["cost/busy_s"] for r in res.metrics)
    assert sum(r["cost/prewarm_ready"] for r in res.metrics) >= 2
    # the train pool (0..4) has no floor, and its forwards took the cost rule's count, starting at one
    assert be.groups == {}
    forwards = [r["scale/train/logprobs_instances"] for r in res.metrics if "scale/train/logprobs_instances" in r]
    assert forwards and forwards[0] == 1.0 and all(f <= 4 for f in forwards)
