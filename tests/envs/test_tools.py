"""flowrl.envs.tools: the tool shorthand as an environment, directly and through the pool (a worker process, and
threads): which text is the call, what comes back, when the trajectory ends, what a failing tool gives."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowrl.envs import EnvPool, EnvSpec, Outcome, load_env_class
from flowrl.envs.tools import tool_arguments

HERE = str(Path(__file__).resolve().parent)


def spec(fn: str, workers: int = 0, on_error: str = "observe") -> EnvSpec:
    return EnvSpec("calc", f"sample_envs.{fn}", kind="tool", call="<calc>", stop=("</calc>",), workers=workers,
                   timeout=30.0, on_error=on_error, folder=HERE)


@pytest.mark.parametrize(("action", "args"), [
    ("so <calc>2+3</calc>", "2+3"),
    ("<calc>1+1</calc> then <calc>4*5</calc>", "4*5"),  # the last call is the one the turn ended on
    ("cut short <calc>7-", "7-"),  # a turn that hit its token cap: up to the end of the action
    ("<calc></calc>", ""),
    ("the answer is 5", None),  # no call: the final answer
    ("</calc> only the end", None),
])
def test_the_arguments_are_those_of_the_last_call(action: str, args: str | None) -> None:
    assert tool_arguments(action, "<calc>", "</calc>") == args


def test_without_an_end_marker_the_arguments_run_to_the_end() -> None:
    assert tool_arguments("x <c>a</c> b", "<c>", "") == "a</c> b"


@pytest.fixture(scope="module", params=[1, 0], ids=["process", "threads"])
def calc(request: pytest.FixtureRequest) -> Iterator[EnvPool]:
    pool = EnvPool(spec("calc", workers=request.param))
    yield pool
    pool.close()


def turn(pool: EnvPool, key: str, action: str) -> Outcome:
    return pool.step(key, action).result(timeout=60)


def test_a_trajectory_of_calls_then_an_answer(calc: EnvPool) -> None:
    reset = calc.reset("t", {"prompt": "2+3*4=", "answer": "14"}).result(timeout=60)
    assert (reset.observation, reset.done, reset.error) == ("", False, None)
    out = turn(calc, "t", "<calc>3*4</calc>")
    assert (out.observation, out.reward, out.done, out.error) == ("12", 0.0, False, None)
    out = turn(calc, "t", "then <calc>2+12</calc>")
    assert (out.observation, out.reward, out.done, out.error) == ("14", 0.0, False, None)
    out = turn(calc, "t", " so 14")
    assert (out.observation, out.reward, out.done, out.error) == ("", 0.0, True, None)


def test_a_failing_call_is_observed(calc: EnvPool) -> None:
    calc.reset("f", {}).result(timeout=60)
    out = turn(calc, "f", "<calc>1/0</calc>")
    error = "raised ZeroDivisionError: integer division or modulo by zero"
    assert (out.observation, out.done, out.error) == (error, False, error)
    assert turn(calc, "f", "<calc>8/2</calc>").observation == "4"  # the trajectory goes on


def test_the_row_reaches_the_tool() -> None:
    pool = EnvPool(EnvSpec("look", "sample_envs.lookup", kind="tool", call="<q>", stop=("</q>",), workers=0,
                           folder=HERE))
    try:
        pool.reset("k", {"prompt": "p", "table": {"paris": "france"}}).result(timeout=60)
        assert turn(pool, "k", "<q> paris </q>").observation == "france"
    finally:
        pool.close()


def test_async_number_and_other_results() -> None:
    made: Any = load_env_class(spec("async_upper"))
    assert inspect.iscoroutinefunction(made.step)  # the host awaits it on its event loop
    pool = EnvPool(spec("async_upper"))
    try:
        pool.reset("a", {}).result(timeout=60)
        assert turn(pool, "a", "<calc>abc</calc>").observation == "ABC"
    finally:
        pool.close()
    number = load_env_class(spec("number"))()
    number.reset({})
    assert number.step("<calc>abcd</calc>") == ("4", 0.0, False)
    listing = load_env_class(spec("listing"))()
    listing.reset({})
    with pytest.raises(TypeError, match="^tool listing returned a list, not a str$"):
        listing.step("<calc>a</calc>")
