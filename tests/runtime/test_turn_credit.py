"""End to end on the local backend: a flow whose policy plays a hidden-number game over turns, with the group
advantage per trajectory (declared score + env_return) or per turn (`turns = "turn"`): the advantage node holds
exactly what flowrl.algos computes from the rollout's turn tensors, observation tokens get nothing, and the
update that follows stays finite."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.algos import grpo_advantages, turn_advantages
from flowrl.backends import make
from flowrl.runtime.controller import Controller, StepResult
from flowrl.runtime.runner import loaders_of, scorers_of

GAME = '''
from typing import Any


class Guess:
    """Guess a digit; `<` / `>` answer a miss (-0.1), `=` ends the game (+1); anything but a digit is answered
    `?` and costs more (-0.5), so an untrained policy's games already return different totals."""

    def __init__(self, number: int = 3, **_: Any) -> None:
        self.number = int(number)

    def reset(self, row: Any) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        text = action.strip()
        if len(text) != 1 or not text.isdigit():
            return "?", -0.5, False
        guess = int(text)
        return ("=", 1.0, True) if guess == self.number else ("<" if self.number < guess else ">", -0.1, False)
'''

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789<>=?" }}
env game = "guess_game.Guess" {{ max_turns = 3, workers = 0, on_error = "raise", number = 3 }}
reward bonus = "flowrl.rewards.zero"
data prompts = jsonl("data.jsonl") {{ batch = 2 }}
step {{
    rollout = actor.generate(prompts, n = 4, max_tokens = 1, temperature = 1.0, env = game)
    scores  = bonus(rollout)
    adv     = group_advantage(scores, group = 4{turns})
    actor.update(rollout, advantages = adv)
}}
"""


def one_step(tmp: Path, turns: str) -> StepResult:
    (tmp / "guess_game.py").write_text(GAME)
    (tmp / "data.jsonl").write_text('{"prompt": "?"}\n{"prompt": "?"}\n')
    (tmp / "game.flow").write_text(FLOW.format(turns=f', turns = "{turns}"' if turns else ""))
    graph = flowrl.load(str(tmp / "game.flow"))
    backend = make("local")
    groups = backend.start(graph, seed=5, device="cpu")
    try:
        return Controller(graph, groups, loaders_of(graph, 5), scorers_of(graph), seed=5).step(1)
    finally:
        backend.shutdown()


def test_turn_level_advantages_in_a_run(tmp_path: Path) -> None:
    res = one_step(tmp_path, "turn")
    rollout, adv = res.values["rollout"], res.values["adv"].value()
    loss_mask, index = rollout["loss_mask"], rollout["turn_index"]
    assert int(index.max()) >= 1 and bool((rollout["response_mask"] > loss_mask).any())  # turns, observations
    want = turn_advantages(rollout["turn_rewards"], index, loss_mask, torch.zeros(rollout.size),
                           rollout["group_id"])
    assert adv.shape == loss_mask.shape and torch.equal(adv, want)
    assert bool((adv[loss_mask == 0] == 0).all())
    # credit differs between turns of one trajectory (it is not the broadcast one)
    assert any(len(set(adv[i][loss_mask[i] > 0].tolist())) > 1 for i in range(rollout.size))
    assert float(adv.abs().max()) < 10  # no group divided by a zero spread
    assert math.isfinite(res.metrics["actor/pg_loss"])


@pytest.mark.parametrize("turns", ["", "trajectory"])
def test_trajectory_advantages_in_a_run_add_the_env_return(tmp_path: Path, turns: str) -> None:
    res = one_step(tmp_path, turns)
    rollout, adv = res.values["rollout"], res.values["adv"].value()
    assert adv.shape == (rollout.size,)
    scores = res.values["scores"]["scores"]
    assert torch.equal(adv, grpo_advantages(scores + rollout["env_return"], rollout["group_id"]))
    assert bool((rollout["env_return"] != 0).any())
