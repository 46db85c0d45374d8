"""Step functions and reward scoring on the controller: advantages from batches, errors naming samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flowrl
from flowrl import registry
from flowrl.errors import ExecutionError, RewardError
from flowrl.registry import RewardFn
from flowrl.runtime.batch import Batch
from flowrl.runtime.functions import GroupSizeError, call_function, score_rollout


def scores_batch(scores: list[float], group: int, width: int = 4) -> Batch:
    n = len(scores)
    mask = torch.ones(n, width)
    mask[0, 2:] = 0
    return Batch(n, {"scores": torch.tensor(scores), "response_mask": mask,
                     "group_id": torch.arange(n) // group}, {}, primary="scores")


def test_group_advantage_matches_reference_values() -> None:
    b = scores_batch([1, 0, 0, 1, 0.5, 1, 0, 0], group=4)
    out = call_function("group_advantage", {"scores": b}, {"fn": "group_advantage", "group": 4})
    expect = [0.866024, -0.866024, -0.866024, 0.866024, 0.261116, 1.30558, -0.783348, -0.783348]
    assert torch.allclose(out.value(), torch.tensor(expect), atol=1e-5)


def test_group_size_mismatch_is_explained() -> None:
    b = scores_batch([1, 0, 0, 1], group=2)
    with pytest.raises(GroupSizeError, match="group = 4 but the rollout has groups of \\[2\\]"):
        call_function("group_advantage", {"scores": b}, {"group": 4})


def test_gae_puts_outcome_on_last_token_and_returns_both() -> None:
    scores = scores_batch([1.0, 0.0], group=1)
    values = scores.derive("values", values=torch.zeros(2, 4))
    out = call_function("gae", {"scores": scores, "values": values},
                        {"gamma": 1.0, "lam": 1.0, "whiten": False})
    # With V = 0, gamma = lam = 1, every valid token's advantage is the final reward.
    assert out["advantages"][0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out["returns"][1].tolist() == [0.0, 0.0, 0.0, 0.0]


# --- rollouts generated with an environment (issue 26): loss_mask, turn_index, turn_rewards, env_return -----


def env_batch(scores: list[float], group: int) -> Batch:
    """Two layouts, T = 6 (a = action, o = observation, . = pad), each repeated to fill the batch:
      row 0: a o a a . .   turn 0 = positions 0-1 (reward 1 at 0), turn 1 = 2-3 (reward 0 at 3)
      row 1: o a a . . .   turn 0 (a reset observation first; reward 0 at 2)"""
    n = len(scores)
    response = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]).repeat(n // 2, 1)
    loss = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]]).repeat(n // 2, 1)
    index = torch.tensor([[0, 0, 1, 1, -1, -1], [0, 0, 0, -1, -1, -1]]).repeat(n // 2, 1)
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0.0, 0, 0, 0, 0, 0]]).repeat(n // 2, 1)
    rollout = Batch(n, {"response_mask": response, "loss_mask": loss, "turn_index": index, "turn_rewards": rewards,
                        "env_return": rewards.sum(1), "group_id": torch.arange(n) // group}, {}, primary=None)
    return rollout.derive("scores", scores=torch.tensor(scores))


def test_a_trajectory_return_is_its_score_plus_its_env_return() -> None:
    # scores [0.5, 0, 0, 1] + env_return [1, 0, 1, 0] = [1.5, 0, 1, 1]: mean 0.875, centred
    # [0.625, -0.875, 0.125, 0.125], unbiased var 1.1875 / 3 = 0.395833, std 0.629153.
    b = env_batch([0.5, 0.0, 0.0, 1.0], group=4)
    assert {"loss_mask", "turn_index", "turn_rewards", "env_return"} <= set(b.tensors)  # carried by derive
    out = call_function("group_advantage", {"scores": b}, {"group": 4})
    assert out.value().shape == (4,)
    assert torch.allclose(out.value(), torch.tensor([0.993398, -1.390757, 0.198680, 0.198680]), atol=1e-5, rtol=0)
    # RLOO: baselines (3.5 - G) / 3 = [0.666667, 1.166667, 0.833333, 0.833333]
    rloo = call_function("rloo_advantage", {"scores": b}, {"group": 4})
    assert torch.allclose(rloo.value(), torch.tensor([0.833333, -1.166667, 0.166667, 0.166667]), atol=1e-5, rtol=0)


def test_turn_level_credit_is_an_option_of_the_group_ops() -> None:
    # Scores 0: row 0 has G = [1, 0] (turns 0, 1), row 1 has G = [0]. Total returns [1, 0]: mean 0.5,
    # std 0.707107: row 0's turn 0 gets 0.707107, its turn 1 -0.707107; row 1 -0.707107. Observations get 0.
    b = env_batch([0.0, 0.0], group=2)
    out = call_function("group_advantage", {"scores": b}, {"group": 2, "turns": "turn"})
    p = 0.707106
    assert torch.allclose(out.value(), torch.tensor([[p, 0, -p, -p, 0, 0], [0, -p, -p, 0, 0, 0]]), atol=1e-5)
    # RLOO: row 0's baseline is row 1's total (0), row 1's is row 0's (1).
    rloo = call_function("rloo_advantage", {"scores": b}, {"group": 2, "turns": "turn"})
    assert rloo.value().tolist() == [[1.0, 0, 0, 0, 0, 0], [0, -1.0, -1.0, 0, 0, 0]]
    # The default broadcasts one advantage per trajectory: G = [1, 0] -> [0.707107, -0.707107].
    plain = call_function("group_advantage", {"scores": b}, {"group": 2})
    assert torch.allclose(plain.value(), torch.tensor([p, -p]), atol=1e-5)


def test_turn_level_credit_on_a_rollout_without_turns_is_the_broadcast_one() -> None:
    b = scores_batch([1, 0, 0, 1, 0.5, 1, 0, 0], group=4)
    for fn in ("group_advantage", "rloo_advantage"):
        by_turn = call_function(fn, {"scores": b}, {"group": 4, "turns": "turn"})
        assert torch.equal(by_turn.value(), call_function(fn, {"scores": b}, {"group": 4}).value())
    with pytest.raises(ValueError, match="turns = 'turns': expected one of 'trajectory', 'turn'"):
        call_function("group_advantage", {"scores": b}, {"group": 4, "turns": "turns"})


def test_gae_and_reinforce_pp_reward_turns_at_their_tokens_and_skip_observations() -> None:
    # Row 0: turn 0's reward 1 at position 0, the score 0.5 at the last ACTION token (3, not 1 + 2 - 1).
    # V = 0, gamma = lam = 1: each action token's advantage is the reward still to come: [1.5, 0, 0.5, 0.5].
    b = env_batch([0.5, 2.0], group=1)
    values = b.derive("values", values=torch.full((2, 6), 9.0))  # ignored at observation tokens and pads
    values.tensors["values"] = torch.where(b["loss_mask"] > 0, torch.zeros(2, 6), values["values"])
    out = call_function("gae", {"scores": b, "values": values}, {"gamma": 1.0, "lam": 1.0, "whiten": False})
    assert out["advantages"].tolist() == [[1.5, 0, 0.5, 0.5, 0, 0], [0, 2.0, 2.0, 0, 0, 0]]
    assert out["returns"].tolist() == [[1.5, 0, 0.5, 0.5, 0, 0], [0, 2.0, 2.0, 0, 0, 0]]
    pp = call_function("reinforce_pp_advantage", {"scores": b}, {"gamma": 1.0})
    assert pp["returns"].tolist() == [[1.5, 0, 0.5, 0.5, 0, 0], [0, 2.0, 2.0, 0, 0, 0]]
    # whitened over the 5 action tokens only: mean 1.3, the observation and pad positions stay 0
    adv = pp["advantages"]
    assert bool((adv[b["loss_mask"] == 0] == 0).all())
    assert abs(float(adv[b["loss_mask"] > 0].mean())) < 1e-6


def test_reward_errors_name_the_sample() -> None:
    rollout = Batch(2, {"response_mask": torch.ones(2, 1)},
                    {"prompt": ["1+1=", "2+2="], "response": ["2", "x"], "row": [{"answer": 2}, {"answer": 4}]})

    def picky(prompt: str, response: str, answer: int) -> float:
        return float(int(response) == answer)

    with pytest.raises(RewardError) as err:
        score_rollout("picky", RewardFn("picky", picky), rollout)
    text = err.value.render()
    assert "reward 'picky' raised ValueError" in text and "sample 1" in text and "'2+2='" in text

    def nan(prompt: str, response: str) -> float:
        return float("nan")

    with pytest.raises(RewardError, match="returned nan on sample 0"):
        score_rollout("nan", RewardFn("nan", nan), rollout)


def test_reward_gets_only_columns_it_accepts() -> None:
    rollout = Batch(1, {"response_mask": torch.ones(1, 1)},
                    {"prompt": ["p"], "response": ["r"], "row": [{"answer": 1, "other": 2}]})
    out = score_rollout("f", RewardFn("f", lambda prompt, response, answer: answer), rollout)
    assert out.value().tolist() == [1.0]
    batched = RewardFn("b", lambda ps, rs, answer, other: [a + o for a, o in zip(answer, other, strict=True)], batched=True)
    assert score_rollout("b", batched, rollout).value().tolist() == [3.0]


def test_a_step_function_returning_a_tensor_is_told_how_to_make_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    b = scores_batch([1.0, 0.0, 0.0, 1.0], group=2)
    monkeypatch.setitem(registry.FUNCTIONS, "centred", lambda scores: scores["scores"] - scores["scores"].mean())
    with pytest.raises(ExecutionError) as err:
        call_function("centred", {"scores": b}, {"fn": "centred"})
    assert err.value.render() == (
        "error: step function 'centred' returned Tensor, expected a flowrl.Batch\n"
        "hint: wrap the tensor in a Batch of the same samples: `return scores.derive(\"advantages\", "
        "advantages=tensor)` (keeps their masks, groups and meta; the first argument names the field the next node "
        "reads), or `flowrl.Batch(scores.size, {\"advantages\": tensor}, primary=\"advantages\")`; see "
        "docs/language.md, User functions")
    # what the hint says to write works, both ways
    monkeypatch.setitem(registry.FUNCTIONS, "centred", lambda scores: scores.derive(
        "advantages", advantages=scores["scores"] - scores["scores"].mean()))
    out = call_function("centred", {"scores": b}, {})
    assert out.value().tolist() == [0.5, -0.5, -0.5, 0.5] and out["group_id"].tolist() == [0, 0, 1, 1]
    monkeypatch.setitem(registry.FUNCTIONS, "centred", lambda scores: flowrl.Batch(
        scores.size, {"advantages": scores["scores"] - 0.5}, primary="advantages"))
    assert call_function("centred", {"scores": b}, {}).value().tolist() == [0.5, -0.5, -0.5, 0.5]


def test_a_step_function_must_keep_its_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    b = scores_batch([1.0, 0.0, 0.0, 1.0], group=2)
    monkeypatch.setitem(registry.FUNCTIONS, "firsts", lambda scores: scores.select([0, 2]))
    with pytest.raises(ExecutionError) as err:
        call_function("firsts", {"scores": b}, {})
    assert err.value.render() == ("error: step function 'firsts' returned a Batch of 2 samples for inputs of 4\n"
                                  "hint: one row per sample of its inputs, in their order")


def test_a_wrong_return_stops_the_run_at_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: the error names the statement and its line, with the hint; the step never reaches the update."""
    monkeypatch.setitem(registry.FUNCTIONS, "raw", lambda scores: scores["scores"])
    (tmp_path / "arith.jsonl").write_text('{"prompt": "1+2=", "answer": 3}\n{"prompt": "2+2=", "answer": 4}\n')
    flow = tmp_path / "raw.flow"
    flow.write_text(
        'model actor : policy { source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=" }\n'
        'reward correct = "flowrl.rewards.arith_exact"\n'
        'data prompts = jsonl("arith.jsonl") { batch = 2 }\n'
        "step {\n"
        "    rollout = actor.generate(prompts, n = 2, max_tokens = 1)\n"
        "    scores  = correct(rollout)\n"
        "    adv     = raw(scores)\n"
        "    actor.update(rollout, advantages = adv)\n"
        "}\n")
    with pytest.raises(ExecutionError) as err:
        flowrl.run(flowrl.load(str(flow)), out_dir=tmp_path / "run", steps=1)
    text = err.value.render()
    assert text.startswith(f"error: while executing adv = raw(scores)  # {flow}:7\n"
                           "error: step function 'raw' returned Tensor, expected a flowrl.Batch\n"
                           "hint: wrap the tensor in a Batch of the same samples: `return scores.derive(")
