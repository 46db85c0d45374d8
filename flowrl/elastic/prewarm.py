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


def prewarm_plan(offsets: Sequence[float], ready_s: float, needed: int, margin_s: float = MARGIN_S,
                 enabled: bool = True) -> tuple[float, int] | None:
    """(seconds after the step's start, instances) to pre-warm for a stage's first call, or None: pre-warming
    off, no history, or the last first call found every instance it used warm (`needed` 0)."""
    delay = prewarm_delay(offsets, ready_s, margin_s)
    if not enabled or delay is None or needed < 1:
        return None
    return delay, needed


def learn_start(ready_s: float, needed: int, cold_ready_s: Sequence[float], instances: int,
                first: bool) -> tuple[float, int]:
    """(ready_s, needed) after a call finished: `cold_ready_s` holds, per instance that had to build its models,
    its build and load seconds (the longest is the new `ready_s`); the step's first call sets `needed` to the
    instances it used when any of them was cold, else 0."""
    if cold_ready_s:
        ready_s = max(cold_ready_s)
    if first:
        needed = instances if cold_ready_s else 0
    return ready_s, needed
