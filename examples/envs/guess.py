"""The hidden-number game of examples/guess_number.flow: an environment with a reward on every turn.

The row hides a `number` (0-9); the policy guesses one digit a turn; the game answers `<` (the number is smaller
than the guess), `>` (larger) or `=` (found: the trajectory ends). A trajectory that plays well reads
`?5<2>3=`: prompt `?`, guesses 5, 2, 3 and the answers after them. Rewards: +1 on the turn that finds the number,
`miss` (default -0.05) on every other guess, so a trajectory's return says both whether and how fast it found it;
an action that is not one digit is answered with `?` and costs `invalid` (default -0.5): a wasted turn, and the
price of quitting (an action cut by the end of sequence is empty). With a miss as costly as quitting, the policy
learnt to quit: at -0.1 a miss and no `invalid`, turns fell from 3.7 to 2.1 in 20 steps, the return flat. `max_turns` (the flow's) bounds a
game; binary search needs at most 4 guesses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Guess", "feedback"]


def feedback(guess: str, number: int) -> str:
    """`=`, `<` (the number is smaller than the guess) or `>`; `?` for anything but one digit."""
    text = guess.strip()
    if len(text) != 1 or text not in "0123456789":  # not isdigit(): "٣" and "²" are digits to it
        return "?"
    g = int(text)
    return "=" if g == number else "<" if number < g else ">"


class Guess:
    """One game. `hit`, `miss` and `invalid` are the turn rewards (the flow's `env` block keys reach here)."""

    def __init__(self, hit: float = 1.0, miss: float = -0.05, invalid: float = -0.5, **_: Any) -> None:
        self.hit, self.miss, self.invalid = float(hit), float(miss), float(invalid)
        self.number = -1

    def reset(self, row: Mapping[str, Any]) -> str:
        self.number = int(row["number"])
        if not 0 <= self.number <= 9:
            raise ValueError(f"the hidden number must be 0-9, got {self.number}")
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        answer = feedback(action, self.number)
        if answer == "=":
            return answer, self.hit, True
        return answer, self.invalid if answer == "?" else self.miss, False
