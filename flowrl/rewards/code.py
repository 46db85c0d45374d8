"""`code_tests` (flowrl.rewards): runs a response's Python code against the row's tests in a sandbox; partial
credit by tests passed. The harness decides every verdict here, outside the solution's process.

The code is the response's last ```python fenced block, or the whole response. The row's `tests` is a list;
each test is one of:
- a Python snippet (`"assert add(2, 3) == 5"`), run after the solution in a copy of its namespace (the solution
  is loaded as module `solution`, so its `if __name__ == "__main__":` part does not run);
- `{"input": "...", "output": "..."}` (the competitive-programming form): the solution runs as a program with
  `input` on its stdin; it passes when it exits with status 0 and its stdout equals `output` token by token
  (whitespace-normalised: `" 1 2\n"` equals `"1  2"`).
Score = passed / len(tests); 0.0 when the code does not load.

How a verdict is made (the solution can write to any descriptor it holds, patch any builtin, exit early, kill
what it can: none of that passes a test):
- The sandbox (`flowrl.rewards.sandbox`) runs `flowrl/rewards/runner.py` beside the solution. It is sent the
  code, then one request per test, and answers each with what the solution computed; it never sees an expected
  value and never reports "passed". Requests go one at a time, answers are read as they come (500 tests in one
  row are 500 small round trips, never a pipe left to fill), each answer at most `REPLY_BYTES`, all within the
  row's `timeout`: a test not answered in time fails, and so do those after it.
- A snippet's top-level `assert`s are taken apart here: in a comparison (`==`, `<`, `in`, `is`, chained), an
  operand that is a literal (`5`, `[1, 2]`, `"ab"`, `None`) stays here, the others are sent to be evaluated
  (a "probe"); `and`, `or` and `not` are evaluated here too; any other expression is probed for its truth.
  A probed value comes back serialized to builtin types by exact type (`runner.plain`); an object of any other
  type, a subclass of `int` with its own `__eq__` included, fails the check. The comparison is made here on
  the decoded plain values, so a custom `__eq__` never runs. Other statements (setup, loops, a `def`) run
  beside the solution; an `assert` nested in them is checked there, so it is only as strong as the solution
  is honest, and a test without a top-level `assert` passes when the runner reports it raised nothing.
- A program's output is read (at most `OUTPUT_BYTES`, then it is killed and the test fails) and compared here.
- Expected values exist only in this process: never in the request, never in a file (the strict sandbox sees
  no file outside /usr: not the data set, nor the flow).

Limits, each tested with hostile code in tests/rewards/test_code.py: the row's wall clock (`TIMEOUT_S`), CPU
time, address space (`MEMORY_BYTES`), processes (`MAX_PROCESSES`, a fork bomb stops at its first forks), file
size and scratch space, no network. Where strict isolation is not available the sandbox says so once
(`SandboxWarning`), and the reward key `sandbox = "strict"` refuses to run (`flowrl.rewards.sandbox`).
"""

from __future__ import annotations

import ast
import operator
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flowrl.registry import reward
from flowrl.rewards.sandbox import Broken, Session

TIMEOUT_S = 5.0
MEMORY_BYTES = 1 << 30
MAX_PROCESSES = 8  # RLIMIT_NPROC for the session's own user: the runner, a program, what it starts
OUTPUT_BYTES = 1 << 20  # a program's stdout, per test
REPLY_BYTES = 8 << 20  # one answer from the runner (a probe's value, a program's output as JSON)
SCRATCH_BYTES = 64 << 20  # the sandbox's /tmp
FILE_BYTES = 1 << 20  # RLIMIT_FSIZE
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}


def extract_code(response: str) -> str:
    """The last ```python fenced block of a response, or the whole response."""
    blocks = FENCE.findall(response)
    return str(blocks[-1]) if blocks else response


# ---- the tests, as this side keeps them -------------------------------------------------------------------


@dataclass(frozen=True)
class Operand:
    """A literal kept here (`probe` < 0, `value`), or the index of a value the runner evaluates."""

    probe: int = -1
    value: Any = None


@dataclass(frozen=True)
class Check:
    """One top-level assert's test: `and` / `or` / `not` of parts, a (chained) comparison, or a truth."""

    kind: str  # "and" | "or" | "not" | "compare" | "truth"
    parts: tuple[Check, ...] = ()
    operands: tuple[Operand, ...] = ()
    ops: tuple[type[ast.cmpop], ...] = ()


@dataclass(frozen=True)
class AssertTest:
    steps: tuple[tuple[str, str], ...]  # ("run" | "probe", source): what the runner is sent
    checks: tuple[Check, ...]  # what is decided here, over the probes' values

    @property
    def probes(self) -> int:
        return sum(kind == "probe" for kind, _ in self.steps)


@dataclass(frozen=True)
class IoTest:
    stdin: str
    expected: tuple[str, ...]  # the expected output's tokens


class _Planner:
    def __init__(self) -> None:
        self.steps: list[tuple[str, str]] = []
        self.probes = 0

    def operand(self, node: ast.expr) -> Operand:
        try:
            return Operand(value=ast.literal_eval(node))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.steps.append(("probe", ast.unparse(node)))
            self.probes += 1
            return Operand(probe=self.probes - 1)

    def check(self, node: ast.expr) -> Check:
        if isinstance(node, ast.BoolOp):
            kind = "and" if isinstance(node.op, ast.And) else "or"
            return Check(kind, parts=tuple(self.check(v) for v in node.values))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return Check("not", parts=(self.check(node.operand),))
        if isinstance(node, ast.Compare) and all(type(op) in COMPARE for op in node.ops):
            return Check("compare", operands=tuple(self.operand(n) for n in [node.left, *node.comparators]),
                         ops=tuple(type(op) for op in node.ops))
        return Check("truth", operands=(self.operand(node),))


def plan(test: object) -> AssertTest | IoTest | None:
    """A row's test as the harness keeps it; None for one that is neither form (it fails)."""
    if isinstance(test, dict):
        if not isinstance(test.get("input"), str) or not isinstance(test.get("output"), str):
            return None
        return IoTest(test["input"], tuple(test["output"].split()))
    if not isinstance(test, str):
        return None
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    planner, checks = _Planner(), []
    for stmt in body:
        if isinstance(stmt, ast.Assert):
            checks.append(planner.check(stmt.test))
        else:
            planner.steps.append(("run", ast.unparse(stmt)))
    return AssertTest(tuple(planner.steps), tuple(checks))


# ---- deciding, on what the runner answered ----------------------------------------------------------------

_FAILED = object()  # a probe that raised, or whose value was not plain data


def decode(v: Any) -> Any:
    """A probe's tagged value (`runner.plain`) as builtins made here; anything malformed raises."""
    tag = v[0]
    if tag == "none":
        return None
    if tag == "bool" and isinstance(v[1], bool):
        return v[1]
    if tag == "int" and isinstance(v[1], str):
        return int(v[1])  # more than 4,300 digits raises: a failed check, not seconds of parsing
    if tag == "float" and isinstance(v[1], str):
        return float(v[1])
    if tag == "complex":
        return complex(float(v[1]), float(v[2]))
    if tag == "str" and isinstance(v[1], str):
        return v[1]
    if tag == "bytes" and isinstance(v[1], str):
        return bytes.fromhex(v[1])
    if tag in ("list", "tuple", "set", "frozenset") and isinstance(v[1], list):
        kind = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag]
        return kind(decode(x) for x in v[1])
    if tag == "dict" and isinstance(v[1], list):
        return {decode(k): decode(x) for k, x in v[1]}
    raise ValueError(f"not a plain value: {str(v)[:80]}")


def _value(operand: Operand, values: Sequence[Any]) -> Any:
    if operand.probe < 0:
        return operand.value
    try:
        return decode(values[operand.probe])
    except Exception:
        return _FAILED


def holds(check: Check, values: Sequence[Any]) -> bool | None:
    """Python's meaning of the assert's test over the decoded values; None where it would have raised."""
    if check.kind in ("and", "or"):
        for part in check.parts:
            got = holds(part, values)
            if got is None or got is (check.kind == "or"):
                return got
        return check.kind == "and"
    if check.kind == "not":
        got = holds(check.parts[0], values)
        return None if got is None else not got
    left = _value(check.operands[0], values)
    if left is _FAILED:
        return None
    if check.kind == "truth":
        return bool(left)
    for op, operand in zip(check.ops, check.operands[1:], strict=True):
        right = _value(operand, values)
        if right is _FAILED:
            return None
        try:
            if not COMPARE[op](left, right):
                return False
        except Exception:  # `1 < "a"`: the assert would have raised
            return None
        left = right
    return True


def passed(test: AssertTest | IoTest, answer: Any) -> bool:
    if not isinstance(answer, dict):
        return False
    if isinstance(test, IoTest):
        out = answer.get("stdout")
        return (answer.get("status") == 0 and answer.get("over") is False and isinstance(out, str)
                and tuple(out.split()) == test.expected)
    values = answer.get("values")
    if answer.get("error") is not None or not isinstance(values, list) or len(values) != test.probes:
        return False
    return all(holds(c, values) is True for c in test.checks)


def _request(test: AssertTest | IoTest) -> dict[str, Any]:
    if isinstance(test, IoTest):
        return {"stdin": test.stdin}
    return {"steps": [list(s) for s in test.steps]}


def run_tests(code: str, tests: Sequence[object], timeout: float = TIMEOUT_S) -> list[bool]:
    """Each test's outcome (False for those not answered within `timeout`, the whole row's wall clock)."""
    deadline = time.monotonic() + timeout
    plans = [plan(t) for t in tests]
    outcome = [False] * len(plans)
    for mode, form in (("assert", AssertTest), ("io", IoTest)):
        mine = [i for i, p in enumerate(plans) if isinstance(p, form)]
        if not mine or time.monotonic() >= deadline:
            continue
        task = {"code": code, "mode": mode, "cpu": int(timeout) + 1, "memory": MEMORY_BYTES, "files": FILE_BYTES,
                "output": OUTPUT_BYTES}
        session = Session(task, deadline, REPLY_BYTES, MAX_PROCESSES, SCRATCH_BYTES)
        try:
            if session.receive() != {"loaded": True}:
                continue
            for i in mine:
                test = plans[i]
                assert test is not None
                session.send(_request(test))
                outcome[i] = passed(test, session.receive())
        except Broken:  # out of time, or the runner is gone: the rest fail
            pass
        finally:
            session.close()
    return outcome


@reward("code_tests")
def code_tests(prompt: str, response: str, tests: object = None, **_: object) -> float:
    """The fraction of the row's `tests` the response's code passes (see the module docstring)."""
    cases = list(tests) if isinstance(tests, (list, tuple)) else ([tests] if tests else [])
    if not cases:
        return 0.0
    return sum(run_tests(extract_code(response), cases)) / len(cases)
