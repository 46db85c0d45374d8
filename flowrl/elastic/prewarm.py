"""Pre-warming (flowrl.elastic): when to start the instances a stage will want, from the step history.

A stage whose instances must build their models (a cold start) should find them ready when it starts: start
them `ready_s` (how long one takes to build and load) plus a margin before the earliest the stage has started,
counted from the step's start, in any step so far.
"""

from __future__ import annotations

from collections.abc import Sequence

MARGIN_S = 0.05


def prewarm_delay(offsets: Sequence[float], ready_s: float, margin_s: float = MARGIN_S) -> float | None:
    """Seconds after a step starts to start a stage's instances: the earliest of `offsets` (step start to the
    stage, per step so far) minus `margin_s` and `ready_s`, at least 0 (at the step's start: the history leaves
    less time than a start takes, and the stage waits for the rest); None without history."""
    if not offsets:
        return None
    return max(0.0, min(offsets) - margin_s - ready_s)
