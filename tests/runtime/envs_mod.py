"""Environments for tests/runtime/test_env_rollout.py: real classes and a tool, imported by the flows' pools."""

from __future__ import annotations

import asyncio
import random
import threading


class Echo:
    """Answers each action with `=` and its length in digits; reward 1 for an action ending in `+`; done after
    `turns` actions (the flow's max_turns may end it first)."""

    def __init__(self, turns: int = 3) -> None:
        self.left = turns

    def reset(self, row: dict[str, object]) -> str:
        return "="

    def step(self, action: str) -> tuple[str, float, bool]:
        self.left -= 1
        return f"={len(action) % 10}", float(action.endswith("+")), self.left <= 0


class SlowEcho(Echo):
    """Echo whose steps take a random time (0-20 ms, from the wall clock's randomness, not the run's seed): the
    samples must not depend on when environments answer."""

    async def step(self, action: str) -> tuple[str, float, bool]:  # type: ignore[override]
        await asyncio.sleep(random.SystemRandom().uniform(0.0, 0.02))
        return Echo.step(self, action)


class Broken:
    """Raises on its first step."""

    def reset(self, row: dict[str, object]) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        raise ValueError("no such move")


def add(args: str, **row: object) -> str:
    """`2+3` -> `5` (a tool); anything else raises."""
    left, _, right = args.partition("+")
    return str(int(left) + int(right))


class Hang:
    """Its step never returns: it waits on an event nobody sets (only the pool's timeout ends the call)."""

    def reset(self, row: dict[str, object]) -> str:
        return "="

    def step(self, action: str) -> tuple[str, float, bool]:
        threading.Event().wait()
        return "", 0.0, True
