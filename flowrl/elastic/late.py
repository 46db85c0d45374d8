"""The late start of a fused stage's forward instances (flowrl.elastic): how long after the first chunk.

In a fused generation+forwards stage the forward instances take the generated chunks as they come; started with
the first chunk, they mostly hold their slots waiting for the next one while generation goes on. Each step
measures that wait (the slack: the least any forward instance waited for chunks), the pool keeps its moving mean,
and the next step starts the forward instances a share of it after the first chunk (`Policy.late` in the
serverless backend, `Options.late` in the simulator; 0 switches it off). The share stays below 1 so that a step
with less slack than the mean delays the stage's end little.
"""

from __future__ import annotations

from collections.abc import Sequence

LATE_SHARE = 0.8  # the share of the learned slack the forward instances start late by
SLACK_MEAN = 0.5  # the weight of the past in the learned slack (the rest: the last step's)


def late_start(slack_s: float | None, share: float = LATE_SHARE) -> float:
    """Seconds after the first chunk to start the forward instances: `share` of the learned slack (0 before any
    was measured, and with `share` 0)."""
    return max(0.0, share * (slack_s or 0.0))


def update_slack(prev: float | None, waited: Sequence[float], late: float, mean: float = SLACK_MEAN
                 ) -> float | None:
    """The learned slack after a step: `waited` holds what each forward instance waited for chunks with its slot
    held (after starting `late` seconds after the first chunk); the slack the step had after the first chunk is
    the least of them plus `late`, averaged into `prev` with weight `mean` on the past. No forward instance ran
    (`waited` empty): `prev` unchanged."""
    if not waited:
        return prev
    seen = min(waited) + late
    return seen if prev is None else mean * prev + (1 - mean) * seen
