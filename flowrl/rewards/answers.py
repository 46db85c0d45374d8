"""The final answer a response gives, as the shipped rewards read it (flowrl.rewards): what an evaluation's majority
vote (`maj@K`, flowrl.runtime.evaluation) counts.

- `arith_exact`, `arith_partial`: the first integer of the response, the number they grade.
- `math_equal`: the content of the last `\\boxed{...}`, else the last number of the response: math-verify's own
  order of looking (flowrl.rewards.math). Votes are counted by the answer's text, with spaces, `$`, a trailing
  `.` and thousands separators taken out: `1,000` and `1000` are one vote, but `1/2` and `0.5` are two (telling them
  apart would need math-verify per pair; the vote's winner is still graded by the reward itself).

A user's reward takes part by carrying a function `extract_answer(response) -> str | None` as an attribute.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from flowrl.rewards import arith_exact, arith_partial, math_equal

Extractor = Callable[[str], "str | None"]

_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = "\\boxed{"


def first_integer(response: str) -> str | None:
    """The first integer of the response, as an int's text (`007` -> `7`)."""
    m = _INT.search(response)
    return str(int(m.group())) if m else None


def _last_boxed(response: str) -> str | None:
    start = response.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(response)):
        if response[j] == "{":
            depth += 1
        elif response[j] == "}":
            depth -= 1
            if depth == 0:
                return response[i:j]
    return None  # an unclosed box holds no answer


def _normal(text: str) -> str:
    text = re.sub(r"\s+", "", text).replace("$", "").rstrip(".")
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


def final_answer(response: str) -> str | None:
    """The last `\\boxed{...}`'s content, else the last number; normalised for voting (see the module docstring)."""
    boxed = _last_boxed(response)
    if boxed is not None and boxed.strip():
        return _normal(boxed)
    numbers = _NUMBER.findall(response)
    return _normal(numbers[-1]) if numbers else None


_SHIPPED: dict[Callable[..., object], Extractor] = {
    arith_exact: first_integer, arith_partial: first_integer, math_equal: final_answer,
}


def extractor_of(fn: Callable[..., object]) -> Extractor | None:
    """How to read the answer of a response graded by reward function `fn`, or None where it is not known."""
    own = getattr(fn, "extract_answer", None)
    if callable(own):
        return own
    return _SHIPPED.get(fn)
