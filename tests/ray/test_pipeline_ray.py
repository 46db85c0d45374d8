"""A staged flow on the ray backend: a backend per stage on the session's Ray, weights carried into the actors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl import backends
from flowrl.compiler import compile_any
from flowrl.dsl import Pipeline
from flowrl.runtime.pipeline import run_pipeline

FLOW = """flow two
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
run { steps = 2, seed = 3 }
stage warm {
    step {
        rollout = actor.generate(prompts, n = 4, max_tokens = 3)
        scores  = correct(rollout)
        adv     = group_advantage(scores, group = 4)
        actor.update(rollout, advantages = adv)
    }
}
stage rl { use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.01) }
"""


@pytest.mark.ray
def test_a_pipeline_on_ray_carries_weights_like_local(ray_session: Any, tmp_path: Path) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "two.flow").write_text(FLOW)
    pipe = compile_any(str(tmp_path / "two.flow"))
    assert isinstance(pipe, Pipeline)
    local = run_pipeline(pipe, out_dir=tmp_path / "local", backend=lambda stage: backends.make("local"))
    out = tmp_path / "ray"
    result = run_pipeline(pipe, out_dir=out, backend=lambda stage: backends.make("ray"))
    warm = torch.load(out / "stages/warm/models.pt")["actor"]
    rl = torch.load(out / "stages/rl/models.pt")
    assert all(torch.equal(rl["ref"][k], warm[k]) for k in warm)  # loaded into the Ray actors as carried
    assert result.metrics[2]["stage"] == "rl" and result.metrics[2]["actor/kl_mean"] == 0.0
    assert [r["actor/loss"] for r in result.metrics] == pytest.approx([r["actor/loss"] for r in local.metrics],
                                                                      rel=1e-4, abs=1e-6)
