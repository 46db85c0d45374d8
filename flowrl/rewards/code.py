"""`code_tests` (flowrl.rewards): runs a response's Python code against the row's tests in a sandbox; partial
credit by tests passed. Every verdict is made outside the solution's process.

The code is the response's last ```python fenced block, or the whole response. The row's `tests` is a list;
each test is one of:
- Python code of any shape (`"assert add(2, 3) == 5"`, HumanEval's `def check(candidate): ...` then
  `check(add)`, loops, helpers, computed expected values). It runs in the tests' process
  (`flowrl.rewards.checker`), which never loads the solution: each name the solution defines is a proxy there, and
  a call runs in the solution's process and returns plain data by value (`flowrl.rewards.wire`), so comparisons,
  `all(...)` and `math.isclose` run on the tests' side on real values. The solution is loaded once as module
  `solution` (importable by the tests: `from solution import add`); its `if __name__ == "__main__":` part does not
  run. The rule for a verdict (passes when it ran to its end with at least one check made there: an `assert`
  that held or a call answered), what a test may use of the solution's names and what crosses by value are in
  flowrl/rewards/checker.py, proxies.py and wire.py.
- `{"input": "...", "output": "..."}` (the competitive-programming form): the solution runs as a program with
  `input` on its stdin; it passes when it exits with status 0 and its stdout equals `output` token by token
  (whitespace-normalised: `" 1 2\\n"` equals `"1  2"`). The output is read (at most `OUTPUT_BYTES`, then it is
  killed and the test fails) and compared here.
Score = passed / len(tests); 0.0 when the code does not load. The returned float is a `Graded`: its `notes` count
the failed tests by reason (`failed/assert`, `failed/no_plain_form`, `failed/timeout`, ...), which the scorers
add to the step's metrics as `reward/NAME/failed/REASON`.

Why the solution cannot forge a verdict: it runs in a jail of its own (`flowrl.rewards.sandbox`), and the tests in
another one, under another user, that it cannot see, signal or trace; it holds only the two pipes of its calls.
Whatever it writes there is read as plain data, bounded (`REPLY_BYTES` a reply, hash-flooding and oversized
values refused, all within the row's `timeout`): a custom `__eq__`, a patched `compile` or serializer, a forged
reply, a frame it reads, an early exit or a kill reach no verdict. Expected values exist only on the tests' side.

Limits, each tested with hostile code in tests/rewards/test_code*.py: the row's wall clock (`TIMEOUT_S`), CPU time,
address space (`MEMORY_BYTES`), processes (`MAX_PROCESSES`, a fork bomb stops at its first forks), file size and
scratch space, no network. Where strict isolation is not available the sandbox says so once (`SandboxWarning`),
and the reward key `sandbox = "strict"` refuses to run (`flowrl.rewards.sandbox`).
"""

from __future__ import annotations

import collections
import os
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowrl.registry import reward
from flowrl.rewards.graded import Graded
from flowrl.rewards.sandbox import Jailed
from flowrl.rewards.sessions import RUNNER, Broken, Channel, Session, TestsSide

TIMEOUT_S = 5.0
MEMORY_BYTES = 1 << 30
MAX_PROCESSES = 8  # RLIMIT_NPROC for the session's own user: the runner, a program, what it starts
TESTS_PROCESSES = 256  # the tests' process: a child per row being graded at once
OUTPUT_BYTES = 1 << 20  # a program's stdout, per test
REPLY_BYTES = 8 << 20  # one answer from the solution's process (a value, a program's output as JSON)
VERDICT_BYTES = 1 << 16  # one verdict line from the tests' process
SCRATCH_BYTES = 64 << 20  # the sandbox's /tmp (and /dev/shm)
FILE_BYTES = 1 << 20  # RLIMIT_FSIZE
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last ```python fenced block of a response, or the whole response."""
    blocks = FENCE.findall(response)
    return str(blocks[-1]) if blocks else response


@dataclass(frozen=True)
class IoTest:
    stdin: str
    expected: tuple[str, ...]  # the expected output's tokens


def plan(test: object) -> str | IoTest | None:
    """A row's test as the harness keeps it: code (a str), a stdin/stdout pair, or None (neither: it fails)."""
    if isinstance(test, dict):
        if not isinstance(test.get("input"), str) or not isinstance(test.get("output"), str):
            return None
        return IoTest(test["input"], tuple(test["output"].split()))
    return test if isinstance(test, str) else None


@dataclass(frozen=True)
class Grade:
    """Each test's outcome, and why each failed one failed (None for a pass)."""

    passed: tuple[bool, ...]
    reasons: tuple[str | None, ...]

    def notes(self) -> dict[str, int]:
        return dict(collections.Counter(f"failed/{r}" for r in self.reasons if r is not None))


def grade(code: str, tests: Sequence[object], timeout: float = TIMEOUT_S) -> Grade:
    """Each test's outcome; a test not answered within `timeout` (the whole row's wall clock) fails ("timeout")."""
    plans = [plan(t) for t in tests]
    passed = [False] * len(plans)
    reasons: list[str | None] = ["bad_test" if p is None else "timeout" for p in plans]
    snippets = [i for i, p in enumerate(plans) if isinstance(p, str)]
    side = TestsSide.shared(MEMORY_BYTES, FILE_BYTES, TESTS_PROCESSES, SCRATCH_BYTES) if snippets else None
    deadline = time.monotonic() + timeout  # the tests' process's start-up (once) is not the row's
    if side is not None:
        _run_code_tests(side, code, [(i, plans[i]) for i in snippets], deadline, timeout, passed, reasons)
    io = [(i, p) for i, p in enumerate(plans) if isinstance(p, IoTest)]
    if io and time.monotonic() < deadline:
        _run_io_tests(code, io, deadline, timeout, passed, reasons)
    return Grade(tuple(passed), tuple(reasons))


def _solution_task(code: str, mode: str, timeout: float) -> dict[str, Any]:
    return {"code": code, "mode": mode, "cpu": int(timeout) + 1, "memory": MEMORY_BYTES, "files": FILE_BYTES,
            "output": OUTPUT_BYTES}


def _run_code_tests(side: TestsSide, code: str, tests: list[tuple[int, Any]], deadline: float, timeout: float,
                    passed: list[bool], reasons: list[str | None]) -> None:
    """The solution in a jail of its own, the tests in a child of the tests' process, joined by two pipes; the
    verdicts come here, one line a test."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    ours, theirs = socket.socketpair()
    solution, row = None, None
    try:
        solution = Jailed(RUNNER, req_r, rep_w, processes=MAX_PROCESSES, scratch=SCRATCH_BYTES)
        row = side.start([theirs.fileno(), req_w, rep_r], timeout)
        for fd in (req_r, rep_w, req_w, rep_r):
            os.close(fd)
        req_r = rep_w = req_w = rep_r = -1
        theirs.close()
        channel = Channel(ours.fileno(), ours.fileno(), deadline, VERDICT_BYTES)
        channel.send({"tests": [t for _, t in tests], "reply_bytes": REPLY_BYTES,
                      "solution": {**_solution_task(code, "calls", timeout), **solution.task()}})
        for _ in tests:
            verdict = channel.receive()
            k = verdict.get("i") if isinstance(verdict, dict) else None
            if type(k) is not int or not 0 <= k < len(tests):
                break
            i = tests[k][0]
            passed[i] = verdict.get("passed") is True
            reason = verdict.get("reason")
            reasons[i] = None if passed[i] else (str(reason)[:40] if isinstance(reason, str) else "raised")
    except Broken:  # out of time, or a side is gone: the tests not yet answered fail
        pass
    finally:
        if row is not None:
            side.stop(row)
        if solution is not None:
            solution.close()
        for fd in (req_r, rep_w, req_w, rep_r):
            if fd >= 0:
                os.close(fd)
        theirs.close()
        ours.close()


def _run_io_tests(code: str, tests: list[tuple[int, IoTest]], deadline: float, timeout: float,
                  passed: list[bool], reasons: list[str | None]) -> None:
    session = Session(_solution_task(code, "io", timeout), deadline, REPLY_BYTES, MAX_PROCESSES, SCRATCH_BYTES)
    try:
        if session.receive() != {"loaded": True}:
            for i, _ in tests:
                reasons[i] = "not_loaded"
            return
        for i, test in tests:
            session.send({"stdin": test.stdin})
            answer = session.receive()
            passed[i], reasons[i] = _compare(test, answer)
    except Broken:
        pass
    finally:
        session.close()


def _compare(test: IoTest, answer: Any) -> tuple[bool, str | None]:
    if not isinstance(answer, dict) or not isinstance(answer.get("stdout"), str):
        return False, "bad_reply"
    if answer.get("over") is not False:
        return False, "output_too_long"
    if answer.get("status") != 0:
        return False, "exit_status"
    if tuple(answer["stdout"].split()) != test.expected:
        return False, "wrong_output"
    return True, None


def run_tests(code: str, tests: Sequence[object], timeout: float = TIMEOUT_S) -> list[bool]:
    """Each test's outcome (False for those not answered within `timeout`, the whole row's wall clock)."""
    return list(grade(code, tests, timeout).passed)


@reward("code_tests")
def code_tests(prompt: str, response: str, tests: object = None, **_: object) -> float:
    """The fraction of the row's `tests` the response's code passes (see the module docstring)."""
    cases = list(tests) if isinstance(tests, (list, tuple)) else ([tests] if tests else [])
    if not cases:
        return 0.0
    found = grade(extract_code(response), cases)
    return Graded(sum(found.passed) / len(cases), found.notes())
