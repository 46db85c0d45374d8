"""An asynchronous run (run { max_staleness = 1 }) on the Ray backend: the same numbers as on the process
backend, so the snapshots go through the object store to the generation actors at the versions the schedule
names (Ray's own pull-before-use sync is off for that model: it would hand generation the newest weights)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import flowrl

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3 }
model ref : reference { source = actor }
reward digits = "digits.reward"
data prompts = jsonl("data.jsonl") { batch = 4 }
use grpo(reward = digits, group = 4, max_tokens = 3, kl_coef = 0.01)
placement {
    pool gen   { gpus = 1 }
    pool train { gpus = 1 }
    actor.generate -> gen
    actor.update, ref -> train
}
run { steps = 5, seed = 5, max_staleness = 1 }
"""


def test_ray_runs_an_asynchronous_flow_with_the_process_backends_numbers(
        tmp_path: Path, same_metrics: Callable[..., None]) -> None:
    (tmp_path / "digits.py").write_text("def reward(prompt, response, **_):\n"
                                        "    return float(sum(c.isdigit() for c in response))\n")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.flow").write_text(FLOW)
    graph = flowrl.load(str(tmp_path / "f.flow"))
    runs = {}
    for backend in ("process", "ray"):
        metrics = flowrl.run(graph, out_dir=tmp_path / backend, backend=backend).metrics
        runs[backend] = [{k: v for k, v in r.items() if not k.startswith(("async/", "time/", "cost/"))} for r in metrics]
        assert [r["async/version"] for r in metrics] == [0, 0, 1, 2, 3]
    assert len({r["reward_mean"] for r in runs["ray"]}) > 1  # the policy moved: versions differ
    same_metrics(runs["process"], runs["ray"], tol=1e-4)
