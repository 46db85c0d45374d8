"""`math_equal`: the final answer against the row's answer, as math-verify compares them, graded in a helper
process with a hard time limit on any thread (`flowrl.rewards.bounded`)."""

from __future__ import annotations

import threading

import pytest

from flowrl.rewards import math as math_reward
from flowrl.rewards.bounded import HelperError, Helpers
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


def _in_a_thread(response: str, answer: object) -> list[float]:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(math_equal("", response, answer=answer)), daemon=True)
    t.start()
    t.join(timeout=300)  # a guard against hanging the suite, far above any limit: the test fails, it never waits on
    assert not t.is_alive(), "math_equal did not return"
    return out


def test_it_works_off_the_main_thread_too() -> None:
    assert _in_a_thread("\\boxed{7}", 7) == [1.0]


@pytest.mark.parametrize("response", ["9^{9^{9^{9}}}", "\\boxed{9^{9^{9^{9}}}}"])
def test_a_pathological_answer_off_the_main_thread_is_stopped_at_the_limit(monkeypatch: pytest.MonkeyPatch,
                                                                           response: str) -> None:
    """Inline math-verify on this thread would have no limit at all (signal.alarm is the main thread's) and
    spin on the tower of powers; here the hard limit (below math-verify's own) kills the helper."""
    math_equal("", "1", answer=1)  # a warm helper: its start-up is not the call's
    monkeypatch.setattr(math_reward, "TIMEOUT_S", 0.5)
    killed = math_reward.HELPERS.killed
    assert _in_a_thread(response, "1") == [0.0]
    assert math_reward.HELPERS.killed == killed + 1  # the limit ended it, not an answer
    assert _in_a_thread("\\boxed{7}", 7) == [1.0]  # a fresh helper takes the next call


SPIN = """
import json, sys
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    n = json.loads(line)
    print(json.dumps(sum(range(n))), flush=True)  # one C call: no signal handler runs until it returns
"""


def test_a_helper_stuck_in_c_code_is_killed_and_replaced() -> None:
    helpers = Helpers(SPIN)
    try:
        assert helpers.call(10, limit=60) == 45
        assert helpers.call(10**15, limit=0.5) is None
        assert helpers.killed == 1
        assert helpers.call(4, limit=60) == 6
    finally:
        helpers.close()


def test_a_helper_that_cannot_start_says_why() -> None:
    helpers = Helpers('import json; print(json.dumps({"error": "cannot import math_verify: ModuleNotFoundError"}))')
    with pytest.raises(HelperError, match="did not start: cannot import math_verify"):
        helpers.call(1, limit=1)
