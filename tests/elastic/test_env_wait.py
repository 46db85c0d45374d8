"""flowrl.elastic.env_wait on worked values: the remaining wait predicted from latency history, and when an
instance whose trajectories all wait on environments gives its device back."""

from __future__ import annotations

import pytest

from flowrl.elastic.env_wait import EnvWaitPredictor, should_release


def _predictor(seen: list[float], min_history: int = 4) -> EnvWaitPredictor:
    p = EnvWaitPredictor(history=8, min_history=min_history)
    p.observe(seen)
    return p


def test_remaining_is_the_mean_residual_of_the_longer_calls() -> None:
    p = _predictor([0.1, 0.2, 0.4, 1.0, 3.0])
    assert p.remaining(0.0) == pytest.approx((0.1 + 0.2 + 0.4 + 1.0 + 3.0) / 5)  # 0.94: the mean
    assert p.remaining(0.3) == pytest.approx(((0.4 - 0.3) + (1.0 - 0.3) + (3.0 - 0.3)) / 3)  # 1.1667
    assert p.remaining(2.0) == pytest.approx(1.0)  # only the 3.0 call was longer
    assert p.remaining(5.0) == pytest.approx(5.0)  # longer than any seen: as long again


def test_no_prediction_before_enough_history_and_only_the_recent_kept() -> None:
    p = _predictor([1.0, 1.0, 1.0])
    assert p.remaining(0.0) is None
    p.observe([1.0, -1.0])  # a negative duration is no observation
    assert p.remaining(0.0) == pytest.approx(1.0)
    p.observe([9.0] * 8)  # the history keeps the last 8
    assert p.remaining(0.0) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="must be >= 1"):
        EnvWaitPredictor(history=0)


def test_release_when_even_the_soonest_answer_is_further_away_than_the_cost() -> None:
    p = _predictor([0.1, 0.2, 0.4, 1.0, 3.0])
    # remaining: 0.94 at 0 s; 1.1667 at 0.3 s; 1.0 at 2 s
    assert should_release([0.0, 0.3], p, cost_s=0.9) is True  # min(0.94, 1.1667) > 0.9
    assert should_release([0.0, 0.3], p, cost_s=0.95) is False  # 0.94 is not
    assert should_release([2.0], p, cost_s=0.99) is True and should_release([2.0], p, cost_s=1.0) is False
    assert should_release([], p, cost_s=0.0) is False
    assert should_release([0.0], _predictor([1.0]), cost_s=0.0) is False  # no prediction yet
