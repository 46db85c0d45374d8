"""`math_equal`: the final answer against the row's answer, as math-verify compares them."""

from __future__ import annotations

import threading

import pytest

from flowrl.rewards.math import math_equal

CASES = [
    ("Natalia sold 48 clips in April and half as many in May, so 48 + 24 = 72. The answer is 72.", "72", 1.0),
    ("#### 72", "72", 1.0),
    ("So the probability is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("The answer is 1/2", "\\frac{1}{2}", 1.0),
    ("Total: 1,000 apples", "1000", 1.0),
    ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}", 1.0),
    ("I think it is 71.", "72", 0.0),
    ("\\boxed{3}", "4", 0.0),
    ("", "7", 0.0),
    ("no number here at all", "7", 0.0),
    ("\\boxed{\\frac{1}{", "1/2", 0.0),  # broken LaTeX: no answer, not an error
    ("7", None, 0.0),
]


@pytest.mark.parametrize("response,answer,score", CASES)
def test_math_equal(response: str, answer: object, score: float) -> None:
    assert math_equal("a word problem", response, answer=answer) == score


def test_it_works_off_the_main_thread_too() -> None:
    """math-verify's own time limits use signal.alarm (main thread only): off there, the answer still compared."""
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(math_equal("", "\\boxed{7}", answer=7)))
    t.start()
    t.join()
    assert out == [1.0]
