"""Response-length prediction logged per step (`NODE/length_spearman`), on hand-made rollouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.runtime.batch import Batch
from flowrl.runtime.lengths import LengthTracker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _step(ids: list[int], lengths: list[list[int]]) -> dict[str, Batch]:
    """A prompts batch with data-set ids and a rollout whose samples (grouped by prompt) have these lengths."""
    rows = [(g, n) for g, ns in enumerate(lengths) for n in ns]
    width = max(n for _, n in rows)
    mask = torch.tensor([[1] * n + [0] * (width - n) for _, n in rows])
    prompts = Batch(len(ids), {}, {"prompt": [f"p{i}" for i in ids], "row": [{}] * len(ids), "prompt_id": ids})
    rollout = Batch(len(rows), {"response_mask": mask, "group_id": torch.tensor([g for g, _ in rows])})
    return {"problems": prompts, "rollout": rollout}  # math_word.flow names its data `problems`


def test_spearman_of_last_steps_guesses_then_learning() -> None:
    tracker = LengthTracker(flowrl.load(str(EXAMPLES / "math_word.flow")))
    assert tracker.nodes == [("rollout", "problems")]
    metrics, rows = tracker.record(_step([7, 3, 9], [[2, 4], [10, 10], [6, 6]]), 1)
    assert metrics == {}  # nothing seen: no ranking
    assert rows == [{"step": 1, "node": "rollout", "prompt_id": [7, 3, 9], "prompt_len": [None, None, None],
                     "response_len": [[2, 4], [10, 10], [6, 6]]}]
    # the same prompts again, in another order, lengths ranked as before: mean 3, 10, 6
    out, _ = tracker.record(_step([9, 7, 3], [[5, 7], [3, 3], [9, 11]]), 2)
    assert out == {"rollout/length_spearman": pytest.approx(1.0)}
    # EWMA (window 4: alpha 0.4): 7 -> 0.4 * 3 + 0.6 * 3 = 3, 3 -> 10, 9 -> 6; lengths now ranked the other way
    out, _ = tracker.record(_step([7, 3, 9], [[12, 12], [1, 1], [5, 5]]), 3)
    assert out["rollout/length_spearman"] == pytest.approx(-1.0)
    assert tracker.predictors["rollout"].ewma[7] == pytest.approx(0.4 * 12 + 0.6 * 3)


def test_state_round_trips() -> None:
    graph = flowrl.load(str(EXAMPLES / "math_word.flow"))
    a, b = LengthTracker(graph), LengthTracker(graph)
    a.record(_step([1, 2], [[3], [8]]), 1)
    b.load_state_dict(a.state_dict())
    later = _step([2, 1], [[9], [2]])
    assert a.record(later, 2) == b.record(later, 2)
    assert math.isclose(a.predictors["rollout"].total, b.predictors["rollout"].total)


FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
use grpo(reward = correct, group = 3, max_tokens = 4)
run { steps = 4, seed = 2, checkpoint_every = 2 }
"""


def test_a_run_writes_its_lengths_trace_and_a_resume_keeps_it_whole(tmp_path: Path) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.flow").write_text(FLOW)
    graph = flowrl.load(str(tmp_path / "f.flow"))
    whole = flowrl.run(graph, out_dir=tmp_path / "whole")
    trace = [json.loads(line) for line in (tmp_path / "whole" / "lengths.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trace] == [1, 2, 3, 4] and {r["node"] for r in trace} == {"rollout"}
    for r, m in zip(trace, whole.metrics, strict=True):
        assert len(r["prompt_id"]) == len(r["prompt_len"]) == len(r["response_len"]) == 4
        assert all(len(s) == 3 for s in r["response_len"]) and r["prompt_len"] == [5] * 4  # <bos> a+b=
        assert sum(map(sum, r["response_len"])) == m["gen_tokens"]
    flowrl.run(graph, out_dir=tmp_path / "cut", steps=3)  # checkpoints at 2 and 3 (the last step)
    (tmp_path / "cut" / "checkpoints" / "step_000003.pt").unlink()  # step 3 is lost; resume from 2
    flowrl.run(graph, out_dir=tmp_path / "cut", resume=True)
    assert (tmp_path / "cut" / "lengths.jsonl").read_text() == (tmp_path / "whole" / "lengths.jsonl").read_text()
