"""A reward as slow as a real verifier (bench/rewards.py): 20 ms per sample, then `length_target`'s score."""

from __future__ import annotations

import time

from flowrl.rewards import length_target

SECONDS = 0.020


def slow_length(prompt: str, response: str, length: object = 8, **_: object) -> float:
    time.sleep(SECONDS)  # a test run, a proof check, a judge call: time spent waiting, not computing here
    return length_target(prompt, response, length)
