"""A reward's signature against `fn(prompt, response, **row) -> float`, from the signature alone."""

from __future__ import annotations

from typing import Any

from flowrl.registry import RewardFn
from flowrl.rewards.signature import expected_signature, signature_problem


def ok(prompt: str, response: str, answer: object = None, **_: object) -> float:
    return 0.0


def named_columns(prompt: str, response: str, answer: object) -> float:  # `answer` comes from the row
    return 0.0


def anything(*args: Any, **kwargs: Any) -> float:
    return 0.0


def one(response: str) -> float:
    return 0.0


def none() -> float:
    return 0.0


def positional_only(prompt: str, response: str, extra: int, /) -> float:  # the row cannot fill it
    return 0.0


def test_signatures_that_can_be_called() -> None:
    for fn in (ok, named_columns, anything, max):  # max: a builtin without a signature; the call will tell
        assert signature_problem(RewardFn(fn.__name__, fn)) is None


def test_signatures_that_cannot_say_why() -> None:
    assert signature_problem(RewardFn("one", one)) == "'one' takes (response), not the prompt and the response"
    assert signature_problem(RewardFn("none", none)) == "'none' takes (nothing), not the prompt and the response"
    assert signature_problem(RewardFn("len", len)) == "'len' takes (obj), not the prompt and the response"
    assert signature_problem(RewardFn("p", positional_only)) == \
        "'p' needs positional arguments (extra) beyond the prompt and the response"


def test_the_hint_names_the_expected_form() -> None:
    assert expected_signature(False) == \
        "a reward is `fn(prompt, response, **row) -> float` (`row`: the data row's other columns)"
    assert expected_signature(True) == "a batched reward is `fn(prompts, responses, **columns) -> list[float]`"
