"""Builders for the pass tests: small flows compiled from text, with their data written next to them."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl.dsl
from flowrl.ir.graph import Graph
from flowrl.passes import run_passes, select
from flowrl.runtime.controller import Controller, StepResult
from flowrl.runtime.protocol import Backend
from flowrl.runtime.runner import loaders_of, scorers_of

SYSTEM = "12+34+56+78+90="  # a shared opening of >= 16 tokens (BOS + 15 characters)
MODEL = 'source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+="'

PPO = """
model actor : policy {{ {model}, lr = 1e-3 {actor_extra} }}
model ref : reference {{ source = actor }}
model critic : critic {{ source = actor, lr = 1e-3 {critic_extra} }}
model rm : reward_model {{ source = actor }}
data prompts = jsonl("{data}") {{ batch = {batch}, shuffle = false }}
step {{
    rollout  = actor.generate(prompts, n = {n}, max_tokens = {max_tokens}, temperature = 1.0)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    values   = critic.values(rollout)
    scores   = rm.score(rollout)
    adv      = gae(scores, values)
    {body}
}}
run {{ steps = 2, seed = 5 }}
{placement}
"""
# Generation and the actor's own forward on one pool, the other models on another (what fuse-gen-inference
# needs: forwards that run beside generation).
SPLIT = """
placement {
    pool gen   { gpus = 1 }
    pool infer { gpus = 1 }
    actor -> gen
    ref, critic, rm -> infer
}
"""
PPO_UPDATES = """actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv, kl_coef = 0.05)
    critic.update(rollout, values = values, returns = adv)"""


def write_data(folder: Path, name: str, prompts: Sequence[str]) -> str:
    (folder / name).write_text("".join(json.dumps({"prompt": p, "answer": 0}) + "\n" for p in prompts))
    return name


def long_prompts(count: int = 8) -> list[str]:
    return [f"{SYSTEM}{i}+{2 * i + 1}=" for i in range(count)]


@pytest.fixture
def ppo(tmp_path: Path) -> Callable[..., Graph]:
    """A PPO flow (no passes run): `ppo(n=4, max_tokens=16, prompts=[...], body=..., placement=SPLIT, ...)`."""

    def build(*, n: int = 4, max_tokens: int = 16, batch: int = 4, prompts: Sequence[str] | None = None,
              body: str = PPO_UPDATES, actor_extra: str = "", critic_extra: str = "", text: str | None = None,
              placement: str = "") -> Graph:
        data = write_data(tmp_path, "data.jsonl", long_prompts() if prompts is None else prompts)
        source = text or PPO.format(model=MODEL, data=data, batch=batch, n=n, max_tokens=max_tokens, body=body,
                                    actor_extra=actor_extra, critic_extra=critic_extra, placement=placement)
        path = tmp_path / "flow.flow"
        path.write_text(source)
        return flowrl.dsl.load(path)

    return build


def passes(graph: Graph, *names: str) -> Graph:
    """`graph` after exactly the passes `names` (pipeline order)."""
    return run_passes(graph, select(list(names)))


def run_steps(graph: Graph, steps: int = 2, backend: Backend | None = None) -> list[StepResult]:
    """`steps` controller steps on the local backend (or `backend`), seed 5."""
    from flowrl.backends.local import LocalBackend

    torch.manual_seed(5)
    be = backend or LocalBackend()
    groups = be.start(graph, seed=5, device="cpu")
    try:
        ctl = Controller(graph, groups, loaders_of(graph, 5), scorers_of(graph), seed=5,
                         after_update=be.after_update)
        return [ctl.step(s) for s in range(1, steps + 1)]
    finally:
        be.shutdown()


def assert_same_numbers(a: list[StepResult], b: list[StepResult], tol: float = 1e-5, later: float = 1e-3) -> None:
    """Every tensor of every node and every metric (but timings and fusion counters) agree: within `tol` in
    step 1, and within `later` afterwards. Step 1 is the pass's own difference (float rounding of a forward
    run in chunks or with a shared prefix, ~1e-7). Later steps start from weights after an AdamW step, whose
    first updates are about lr * sign(grad): a gradient of 1e-7 whose rounding differs moves its weight by
    a different lr, so the same rounding shows up as ~1e-5 one step on, in either direction."""
    for step, (ra, rb) in enumerate(zip(a, b, strict=True)):
        tol = tol if step == 0 else later
        assert ra.values.keys() == rb.values.keys()
        for node, batch in ra.values.items():
            other = rb.values[node]
            assert batch.tensors.keys() == other.tensors.keys(), node
            assert batch.meta == other.meta, node
            for key, t in batch.tensors.items():
                u = other.tensors[key]
                assert t.shape == u.shape, (node, key)
                assert torch.allclose(t.float(), u.float(), atol=tol, rtol=0), (node, key)
        keys = {k for k in ra.metrics if not k.startswith(("time/", "fusion/", "cost/"))}
        assert keys == {k for k in rb.metrics if not k.startswith(("time/", "fusion/", "cost/"))}
        for k in keys:
            assert abs(ra.metrics[k] - rb.metrics[k]) <= tol, k


class GroupProxy:
    """A worker group that forwards the whole `WorkerGroup` protocol to `inner`: tests subclass it to change one
    thing (slow forwards, a group that runs beside the controller, one that cannot be called rank by rank)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name, self.world, self.models = inner.name, inner.world, inner.models
        self.inline, self.per_rank, self.why_not_per_rank = inner.inline, inner.per_rank, inner.why_not_per_rank

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.inner.call(method, *args, **kwargs)

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.inner.on_rank(rank, method, *args, **kwargs)

    def colocated(self, models: Any) -> bool:
        return bool(self.inner.colocated(models))

    def recover(self) -> None:
        self.inner.recover()

    def stream_stage(self, *args: Any) -> Any:
        return self.inner.stream_stage(*args)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.inner.state_dict())

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(state)
