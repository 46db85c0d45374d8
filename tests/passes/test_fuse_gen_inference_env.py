"""fuse-gen-inference on a multi-turn generate (`env = NAME`, issue 26): it fuses the forwards over the
trajectories wherever they are placed (colocated ones too: they run while every live trajectory waits on its
environment), it is idempotent, and a run trains on the same ids and log-probs with and without it, on the local
backend (which runs other fused stages unfused) and on rank threads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.backends.threads import ThreadBackend
from flowrl.ir.graph import Graph
from flowrl.passes.fuse_gen_inference import fuse_gen_inference
from flowrl.runtime.controller import StepResult

from .conftest import passes, run_steps, write_data

HERE = Path(__file__).parent
FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3,
                        context = 64 }}
model ref : reference {{ source = actor }}
env game = "envs_mod.SlowEcho" {{ max_turns = 3, stop = "+", workers = 2, timeout = 10 }}
reward zero = "flowrl.rewards.zero"
data prompts = jsonl("data.jsonl") {{ batch = 4, shuffle = false }}
step {{
    rollout  = actor.generate(prompts, n = 2, max_tokens = 4, env = game)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    scores   = zero(rollout)
    adv      = group_advantage(scores, group = 2)
    actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv, kl_coef = 0.05)
}}
run {{ steps = 2, seed = 5 }}
{placement}
"""
SPLIT = """
placement {
    pool gen   { gpus = 1 }
    pool infer { gpus = 1 }
    actor -> gen
    ref -> infer
}
"""
FUSED = ["rollout", "old_logp", "ref_logp"]
# timings: the loop's idle and wall seconds per row, and each environment call's seconds
TIMED = ("gen_idle_s", "gen_wall_s")


@pytest.fixture
def env_flow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Graph]:
    (tmp_path / "envs_mod.py").write_text((HERE.parent / "runtime" / "envs_mod.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    write_data(tmp_path, "data.jsonl", [f"{a}+{b}" for a in range(3) for b in range(3)])

    def build(placement: str = "") -> Graph:
        path = tmp_path / "flow.flow"
        path.write_text(FLOW.format(placement=placement))
        return flowrl.load(str(path), passes=False)

    return build


def fused(g: Graph) -> list[str]:
    return [n.id for n in g.nodes if n.attrs.get("fusion") == "gen-infer:rollout"]


def test_fuses_colocated_forwards_of_an_env_generate(env_flow: Callable[..., Graph]) -> None:
    g, notes = fuse_gen_inference(env_flow())
    assert fused(g) == FUSED and g.node("rollout").attrs["fusion_kind"] == "inter-stage"
    assert notes == ["rollout: hands out finished trajectories whenever every live one waits on its environment "
                     "(game), and at the end; old_logp on worker group colocated, ref_logp on worker group "
                     "colocated run on them during those waits"]


def test_fuses_forwards_placed_elsewhere_too_and_is_idempotent(env_flow: Callable[..., Graph]) -> None:
    once = passes(env_flow(SPLIT), "fuse-gen-inference")
    assert fused(once) == FUSED
    twice = passes(once, "fuse-gen-inference")
    assert twice.nodes == once.nodes and [p.changed for p in twice.passes] == [True, False]


def _assert_same_training(on: list[StepResult], off: list[StepResult]) -> None:
    """The same trajectories, masks, log-probs, advantages and losses (timings aside)."""
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        tol = 1e-5 if step == 0 else 1e-3  # after an AdamW step, see conftest.assert_same_numbers
        assert a.values.keys() == b.values.keys()
        for node, batch in a.values.items():
            other = b.values[node]
            assert batch.tensors.keys() == other.tensors.keys(), node
            assert batch.meta.get("response") == other.meta.get("response"), node
            assert batch.meta.get("env_ended") == other.meta.get("env_ended"), node
            for key, t in batch.tensors.items():
                if key not in TIMED:
                    assert torch.allclose(t.float(), other.tensors[key].float(), atol=tol, rtol=0), (node, key)
        for k in ("loss", "kl_mean", "env/turns_mean", "env/return_mean", "env/prefill_tokens_mean"):
            assert abs(a.metrics[k] - b.metrics[k]) <= tol, k


@pytest.mark.parametrize("backend", [None, ThreadBackend(1)], ids=["local", "threads"])
def test_trains_on_the_same_ids_and_logprobs_with_and_without_it(env_flow: Callable[..., Graph],
                                                                  backend: ThreadBackend | None) -> None:
    g = env_flow()
    on = run_steps(passes(g, "fuse-gen-inference"), backend=backend)
    assert all(r.metrics["fusion/chunks"] >= 2 and "fusion/fallback" not in r.metrics for r in on)
    assert all(0 <= r.metrics["env/idle_frac"] <= 1 for r in on)
    _assert_same_training(on, run_steps(passes(g), backend=backend))
