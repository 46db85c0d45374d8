"""Response-length prediction logged per step (`NODE/length_spearman`), on hand-made rollouts."""

from __future__ import annotations

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
    assert tracker.record(_step([7, 3, 9], [[2, 4], [10, 10], [6, 6]])) == {}  # nothing seen: no ranking
    # the same prompts again, in another order, lengths ranked as before: mean 3, 10, 6
    out = tracker.record(_step([9, 7, 3], [[5, 7], [3, 3], [9, 11]]))
    assert out == {"rollout/length_spearman": pytest.approx(1.0)}
    # EWMA (window 4: alpha 0.4): 7 -> 0.4 * 3 + 0.6 * 3 = 3, 3 -> 10, 9 -> 6; lengths now ranked the other way
    out = tracker.record(_step([7, 3, 9], [[12, 12], [1, 1], [5, 5]]))
    assert out["rollout/length_spearman"] == pytest.approx(-1.0)
    assert tracker.predictors["rollout"].ewma[7] == pytest.approx(0.4 * 12 + 0.6 * 3)


def test_state_round_trips() -> None:
    graph = flowrl.load(str(EXAMPLES / "math_word.flow"))
    a, b = LengthTracker(graph), LengthTracker(graph)
    a.record(_step([1, 2], [[3], [8]]))
    b.load_state_dict(a.state_dict())
    later = _step([2, 1], [[9], [2]])
    assert a.record(later) == b.record(later)
    assert math.isclose(a.predictors["rollout"].total, b.predictors["rollout"].total)
