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
