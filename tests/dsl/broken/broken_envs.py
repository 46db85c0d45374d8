"""Environments the broken flows name (tests/dsl/test_broken.py): a real env, a class that is not one, a tool."""

from __future__ import annotations


class Countdown:
    """Answers each action with the turns left; done when none are."""

    def __init__(self, turns: int = 2) -> None:
        self.left = turns

    def reset(self, row: dict[str, object]) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        self.left -= 1
        return str(self.left), 0.0, self.left <= 0


class NoStep:
    """Not an environment: it has no step."""

    def reset(self, row: dict[str, object]) -> str:
        return ""


def add(args: str, **row: object) -> str:
    left, _, right = args.partition("+")
    return str(int(left) + int(right))
