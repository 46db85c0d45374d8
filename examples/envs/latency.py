"""The benchmark's environment (bench/multiturn.py): an environment whose every step waits a long-tailed,
lognormal time, as sandboxes, searches and judges do, and does nothing else.

The wait of trajectory `row["id"]`'s turn k is drawn from its own seeded stream (seed, id, k), so the overlapped
run and the barrier loop wait exactly the same times, whatever order the calls arrive in. `median` seconds and
`sigma` (log-space) set the distribution: p99/p50 = exp(2.326 * sigma), 6.4 at the default sigma = 0.8. The
observation is `obs` (a few characters the policy then reads); the game ends after `turns` steps.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["Latency", "draw", "p99_over_p50"]


def draw(seed: int, row_id: int, turn: int, median: float, sigma: float) -> float:
    """The seconds trajectory `row_id` waits at `turn`: lognormal with that median, from its own stream."""
    rng = random.Random(f"{seed}/{row_id}/{turn}")
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def p99_over_p50(sigma: float) -> float:
    return math.exp(2.3263478740408408 * sigma)


class Latency:
    def __init__(self, median: float = 0.05, sigma: float = 0.8, seed: int = 0, obs: str = "12+", turns: int = 4,
                 **_: Any) -> None:
        self.median, self.sigma, self.seed = float(median), float(sigma), int(seed)
        self.obs, self.turns = str(obs), int(turns)
        self.row_id, self.turn = 0, 0

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row_id, self.turn = int(row.get("id", 0)), 0
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(draw(self.seed, self.row_id, self.turn, self.median, self.sigma))
        self.turn += 1
        return self.obs, 0.0, self.turn >= self.turns
