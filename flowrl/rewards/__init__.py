"""Verifiable rewards that ship with flowrl, addressable as `flowrl.rewards.NAME` or by registered name.

Each is `fn(prompt, response, **row) -> float` in [0, 1]; `row` holds the JSONL columns (e.g. `answer`).
"""

from __future__ import annotations

import re

from flowrl.registry import reward

_INT = re.compile(r"-?\d+")


def _first_int(text: str) -> int | None:
    m = _INT.search(text)
    return int(m.group()) if m else None


@reward("arith_exact")
def arith_exact(prompt: str, response: str, answer: object = None, **_: object) -> float:
    """1.0 when the first integer in the response equals `answer`, else 0.0."""
    got = _first_int(response)
    return 1.0 if got is not None and answer is not None and got == int(str(answer)) else 0.0


@reward("arith_partial")
def arith_partial(prompt: str, response: str, answer: object = None, **_: object) -> float:
    """Exact-match reward with partial credit by digit agreement (denser signal for tiny models)."""
    target = str(int(str(answer))) if answer is not None else ""
    got = _first_int(response)
    if got is None or not target:
        return 0.0
    if str(got) == target:
        return 1.0
    text = str(got)
    same = sum(a == b for a, b in zip(text[::-1], target[::-1], strict=False))
    return 0.5 * same / max(len(text), len(target))


@reward("match_string")
def match_string(prompt: str, response: str, answer: object = None, **_: object) -> float:
    """1.0 when the response, stripped, starts with `answer`."""
    return 1.0 if answer is not None and response.strip().startswith(str(answer)) else 0.0


@reward("char_fraction")
def char_fraction(prompt: str, response: str, target: str = "a", **_: object) -> float:
    """Fraction of response characters equal to `target` (a dense toy reward for smoke tests)."""
    if not response:
        return 0.0
    return sum(ch == target for ch in response) / len(response)


@reward("length_target")
def length_target(prompt: str, response: str, length: object = 8, **_: object) -> float:
    """1 − |len(response) − length| / length, clipped at 0: learns to stop at a length."""
    want = int(str(length))
    return max(0.0, 1.0 - abs(len(response) - want) / max(want, 1))


# Registered on import: `reward r = "math_equal"` / `"code_tests"` (their heavy imports happen at first use).
from flowrl.rewards.code import code_tests  # noqa: E402
from flowrl.rewards.math import math_equal  # noqa: E402

__all__ = ["arith_exact", "arith_partial", "char_fraction", "code_tests", "length_target", "match_string",
           "math_equal"]


@reward("zero")
def zero(prompt: str, response: str, **_: object) -> float:
    """0.0 for every response: the `reward` of a flow whose rewards are its environment's alone (`env`)."""
    return 0.0
