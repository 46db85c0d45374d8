"""Environments for the language tests (tests/dsl/test_envs.py): a class env and a tool function, real ones."""

from __future__ import annotations


class Countdown:
    """Says how many turns are left; done after `turns` actions, reward 1 on the last."""

    def __init__(self, turns: int = 2) -> None:
        self.left = turns

    def reset(self, row: dict[str, object]) -> str:
        return f" {self.left}"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.left -= 1
        return f" {self.left}", float(self.left == 0), self.left <= 0


class NoStep:
    """Not an environment: it cannot take actions."""

    def reset(self, row: dict[str, object]) -> str:
        return ""


def add(args: str, **row: object) -> str:
    """`2+3` -> `5`."""
    left, _, right = args.partition("+")
    return str(int(left) + int(right))
