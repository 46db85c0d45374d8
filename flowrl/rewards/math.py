"""`math_equal` (flowrl.rewards): 1.0 when a response's final answer equals the row's `answer`, mathematically.

Answer extraction and equivalence are the `math-verify` package's (what open-r1 and TRL's math rewards use):
`\\boxed{...}` first, else the last number or expression in the response; `\\frac{1}{2}`, `1/2` and `0.5` are
equal, `1,000` is `1000`, LaTeX and plain text compare alike. A response with no answer, or that cannot be
parsed, scores 0.0; it never raises. math-verify's own time limits use `signal.alarm`, which works in a
process's main thread only (where inline scoring and reward workers call it); elsewhere they are off, and a
`timeout` on the reward (`{ workers = N, timeout = S }`) is what bounds a hostile answer.
"""

from __future__ import annotations

import threading
from typing import Any

from flowrl.registry import reward

PARSE_TIMEOUT_S = 5


def _limits() -> dict[str, Any]:
    main = threading.current_thread() is threading.main_thread()
    return {"timeout": PARSE_TIMEOUT_S if main else None}


@reward("math_equal")
def math_equal(prompt: str, response: str, answer: object = None, **_: object) -> float:
    """1.0 when the response's final answer equals `answer` (see the module docstring), else 0.0."""
    if answer is None or not str(response).strip():
        return 0.0
    from math_verify import parse, verify

    limit = _limits()["timeout"]
    try:
        text = str(answer)
        gold = parse(text, parsing_timeout=limit)
        if not gold and "$" not in text:  # bare LaTeX (`\sqrt{8}`): math-verify finds it between delimiters
            gold = parse(f"${text}$", parsing_timeout=limit)
        got = parse(str(response), parsing_timeout=limit)
        if not gold or not got:
            return 0.0
        return 1.0 if verify(gold, got, timeout_seconds=limit) else 0.0
    except Exception:  # a parse or comparison that fails on odd input: no answer found
        return 0.0
