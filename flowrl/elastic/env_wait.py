"""When a generation instance gives its device back while tools run (flowrl.elastic; issue 26 item 5).

A multi-turn generation instance (flowrl.engines.turns) is idle whenever every live trajectory waits on its
environment. Giving the device back then costs what getting one again costs (the instance's release and
re-acquire: its start overhead, as `plan.start_overhead` measures it, plus re-prefilling the parked rows'
histories), so it pays only when the wait ahead is longer than that. The wait ahead is predicted from the
environment's step latencies seen so far, as response lengths are predicted from past lengths (`predict`): a call
that has waited `e` seconds has `remaining(e)` left, the empirical mean residual life of the history, the mean of
(x - e) over the past latencies x longer than e. A call already longer than every one seen (a hung sandbox, the
far tail) is predicted to wait as long again as it has (heavy tails: the longer it ran, the longer it runs). The
instance releases when even the soonest answer is predicted further away than the cost (`should_release`).
Nothing here touches a clock: the caller passes seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

HISTORY = 512  # latencies kept (the most recent): enough for the tail, and it follows a drifting environment
MIN_HISTORY = 8  # fewer seen: no prediction, never release


class EnvWaitPredictor:
    """The recent environment step latencies (seconds) and the remaining wait they predict."""

    def __init__(self, history: int = HISTORY, min_history: int = MIN_HISTORY):
        if history < 1 or min_history < 1:
            raise ValueError(f"history and min_history must be >= 1, got {history} and {min_history}")
        self.seen: deque[float] = deque(maxlen=history)
        self.min_history = min_history

    def observe(self, seconds: Iterable[float]) -> None:
        self.seen.extend(float(s) for s in seconds if s >= 0)

    def remaining(self, elapsed: float) -> float | None:
        """Expected seconds left of a call that has waited `elapsed` (None: too little history to say)."""
        if len(self.seen) < self.min_history:
            return None
        longer = [x - elapsed for x in self.seen if x > elapsed]
        if not longer:
            return max(elapsed, 0.0)
        return sum(longer) / len(longer)


def should_release(elapsed: Sequence[float], predictor: EnvWaitPredictor, cost_s: float) -> bool:
    """Whether an instance whose live trajectories all wait on environments, for `elapsed` seconds each so far,
    gives its device back: the soonest predicted answer is more than `cost_s` (release + re-acquire) away. Never
    with nothing waiting or without a prediction."""
    if not elapsed:
        return False
    ahead = [predictor.remaining(e) for e in elapsed]
    if any(a is None for a in ahead):
        return False
    return min(a for a in ahead if a is not None) > cost_s
