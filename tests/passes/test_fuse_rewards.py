"""A reward scored by workers of its own joins the fused generation stage: chunks of finished samples are scored
while the rest still decodes, on any backend (the local one too: the workers run beside generation), with the
numbers of the unfused step."""

from __future__ import annotations

from pathlib import Path

import torch

import flowrl
from flowrl.backends.local import LocalBackend
from flowrl.ir.graph import Graph
from flowrl.passes.fuse_gen_inference import fuse_gen_inference
from flowrl.runtime.controller import Controller, StepResult
from flowrl.runtime.runner import close_scorers, loaders_of, scorers_of

from .conftest import assert_same_numbers

FLOW = Path(__file__).resolve().parents[2] / "examples" / "longtail_grpo.flow"
SMALL = {"prompts.batch": "4", "actor.dim": "32", "actor.layers": "1"}


def _steps(graph: Graph, steps: int = 2) -> list[StepResult]:
    torch.manual_seed(5)
    be = LocalBackend()
    scorers = scorers_of(graph)
    try:
        ctl = Controller(graph, be.start(graph, seed=5, device="cpu"), loaders_of(graph, 5), scorers, seed=5,
                         after_update=be.after_update)
        return [ctl.step(s) for s in range(1, steps + 1)]
    finally:
        close_scorers(scorers)
        be.shutdown()


def test_a_reward_with_workers_fuses_and_is_scored_while_generation_goes_on() -> None:
    pooled = flowrl.load(str(FLOW), {**SMALL, "length.workers": "2"}, passes=False)
    g, notes = fuse_gen_inference(pooled)
    scores = next(n for n in g.nodes if n.op == "reward")
    assert scores.attrs["fusion"] == "gen-infer:rollout"
    assert "scores (reward flowrl.rewards.length_target) on its own workers" in notes[0]
    inline, _ = fuse_gen_inference(flowrl.load(str(FLOW), SMALL, passes=False))
    assert "fusion" not in next(n for n in inline.nodes if n.op == "reward").attrs  # inline: on the controller


def test_the_fused_reward_gives_the_numbers_of_the_unfused_step() -> None:
    fused = flowrl.load(str(FLOW), {**SMALL, "length.workers": "2"})
    plain = flowrl.load(str(FLOW), {**SMALL, "length.workers": "2"}, no_pass=["fuse-gen-inference"])
    on, off = _steps(fused), _steps(plain)
    assert all(r.metrics["fusion/chunks"] >= 2 and "fusion/fallback" not in r.metrics for r in on)
    assert_same_numbers(on, off)
    assert all(r.metrics["reward/length/errors"] == r.metrics["reward/length/timeouts"] == 0 for r in on)
    for r in off:  # scored by workers (with their failure counters) = scored inline
        r.metrics = {k: v for k, v in r.metrics.items() if not k.startswith("reward/length/")}
    assert_same_numbers(off, _steps(flowrl.load(str(FLOW), SMALL, no_pass=["fuse-gen-inference"])))
