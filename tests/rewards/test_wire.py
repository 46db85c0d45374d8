"""`flowrl.rewards.wire`: values cross by their contents and compare on the tests' side as Python compares the
real values; builtin subclasses arrive as their base (a custom `__eq__` never travels); decoding refuses what is
malformed, hash-flooding or too costly, whatever the bytes."""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import fractions
import json
import math
from typing import Any

import numpy as np
import pytest

from flowrl.rewards.wire import FLOOD, BadReply, NoPlainForm, decode, encode


def cross(x: Any) -> Any:
    """What the tests' side gets for `x`: encoded, through JSON, decoded."""
    return decode(json.loads(json.dumps(encode(x))))


class Color(enum.IntEnum):
    RED = 1


class Flag(enum.IntFlag):
    A = 1
    B = 2


class Name(str, enum.Enum):
    ADA = "ada"


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("value,equal_to", [
    (collections.Counter("abca"), {"a": 2, "b": 1, "c": 1}),
    (collections.defaultdict(list, {1: [2]}), {1: [2]}),
    (collections.OrderedDict([(2, "b"), (1, "a")]), {1: "a", 2: "b"}),
    (Point(1, 2), (1, 2)),
    (Color.RED, 1),
    (Flag.A | Flag.B, 3),
    (Name.ADA, "ada"),
    (fractions.Fraction(1, 3), fractions.Fraction(2, 6)),
    (fractions.Fraction(1, 2), 0.5),
    (decimal.Decimal("0.1"), decimal.Decimal("0.10")),
    ({"a": 1, "b": 2}.keys(), {"a", "b"}),
    ({"a": 1}.items(), {("a", 1)}),
    (range(2, 10, 3), range(2, 10, 3)),
    (collections.deque([1, 2], maxlen=3), collections.deque([1, 2])),
    (frozenset({1, 2}), {1, 2}),
    (math.factorial(2000), math.factorial(2000)),  # 5,736 digits: past str()'s 4,300-digit limit
    (-(10 ** 5000) + 7, -(10 ** 5000) + 7),
    (float("inf"), float("inf")),
    (1 + 2j, complex(1, 2)),
    (b"\x00\xff", b"\x00\xff"),
    (bytearray(b"ab"), b"ab"),
    ("\ud800 lone surrogate", "\ud800 lone surrogate"),
    (datetime.datetime(2026, 1, 2, 3, 4, 5, 6), datetime.datetime(2026, 1, 2, 3, 4, 5, 6)),
    (datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
     datetime.datetime(2026, 1, 1, 22, tzinfo=datetime.timezone.utc)),
    (datetime.date(2026, 1, 2), datetime.date(2026, 1, 2)),
    (datetime.timedelta(days=-1, seconds=5), datetime.timedelta(days=-1, seconds=5)),
    (np.int64(6), 6),
    (np.float32(0.5), 0.5),
    (np.bool_(True), True),
    ([{1: (2, {3})}], [{1: (2, {3})}]),
], ids=lambda v: type(v).__name__)  # a value's own str: past 4,300 digits, str() raises
def test_standard_values_compare_as_the_real_ones_do(value: Any, equal_to: Any) -> None:
    got = cross(value)
    assert got == value and got == equal_to and value == equal_to


def test_types_that_differ_from_their_plain_form_stay_themselves() -> None:
    """Where Python says the real value is not equal to its plain form, neither is what crosses."""
    assert cross(range(3)) != [0, 1, 2] and list(cross(range(3))) == [0, 1, 2]
    assert cross(collections.deque([1])) != [1]
    assert cross({"a": 1}.values()) != [1] and list(cross({"a": 1}.values())) == [1]
    assert cross(decimal.Decimal("0.1")) != 0.1
    assert list(cross({"b": 1, "a": 2}.keys())) == ["b", "a"]  # order kept
    assert cross(Point(1, 2)).x == 1 and type(cross(Point(1, 2))).__name__ == "Point"
    counted = cross(collections.Counter("aab"))
    assert isinstance(counted, collections.Counter) and counted.most_common(1) == [("a", 2)]
    assert cross(collections.defaultdict(int))["missing"] == 0  # a builtin factory travels
    array = cross(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert isinstance(array, np.ndarray) and array.dtype == np.int32 and array.shape == (2, 3)
    assert np.array_equal(array, [[0, 1, 2], [3, 4, 5]])


def test_a_subclass_arrives_as_its_base_and_its_eq_does_not_travel() -> None:
    class Always(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    class Loud(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    assert type(cross(Always(3))) is int and cross(Always(3)) != 4
    assert type(cross(Loud("a"))) is str and cross(Loud("a")) != "b"
    assert type(cross([Always(1)])[0]) is int


def test_what_has_no_plain_form_is_refused_or_handed_over() -> None:
    class Thing:
        pass

    with pytest.raises(NoPlainForm, match="a Thing has no plain form"):
        encode(Thing())
    handed: list[Any] = []
    assert encode([Thing()], lambda x: handed.append(x) or ["handle", 0, "object", "Thing", None, True]) == \
        ["list", [["handle", 0, "object", "Thing", None, True]]]
    assert len(handed) == 1
    nested: list[Any] = []
    nested.append(nested)
    with pytest.raises(NoPlainForm, match="nested deeper"):
        encode(nested)


@pytest.mark.parametrize("reply,why", [
    (["set", [["int", format(i * (2**61 - 1), "x")] for i in range(FLOOD + 100)]], "hash flooding"),
    (["dict", [[["int", format(i * (2**61 - 1), "x")], ["none"]] for i in range(FLOOD + 100)]], "hash flooding"),
    (["frozenset", [["int", "1"]] * 1000], "hash flooding"),
    (["fraction", "1" + "0" * 40000, "3"], "too large"),
    (["int", "12z"], "malformed int"),
    (["bool", 1], "not a bool"),
    (["list", "abc"], "not a list"),
    (["namedtuple", "P", ["_x"], [["none"]]], "namedtuple"),
    (["namedtuple", "P", ["import os"], [["none"]]], "namedtuple"),
    (["defaultdict", "eval", []], "factory"),
    (["ndarray", "|O8", [1], [["none"]]], "malformed array"),
    (["handle", 1, "object", "X", None, True], "unknown tag"),
    (["nothing"], "unknown tag"),
    ("str", "not a tagged value"),
    ([["list", []]] * 2, "not a tagged value"),
])
def test_a_malformed_or_costly_reply_is_refused(reply: Any, why: str) -> None:
    with pytest.raises(BadReply, match=why):
        decode(reply)


def test_namedtuple_types_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrl.rewards import wire

    monkeypatch.setattr(wire, "_NAMEDTUPLES", {})
    reply = ["list", [["namedtuple", f"T{i}", ["a"], [["none"]]] for i in range(wire.NAMEDTUPLES)]]
    assert len(decode(reply)) == wire.NAMEDTUPLES
    assert decode(["namedtuple", "T0", ["a"], [["int", "1"]]]).a == 1  # made once, used again
    with pytest.raises(BadReply, match="namedtuple types"):
        decode(["namedtuple", "Another", ["a"], [["none"]]])


def test_deep_nesting_is_refused_not_a_crash() -> None:
    deep: Any = ["none"]
    for _ in range(200):
        deep = ["list", [deep]]
    with pytest.raises(BadReply, match="nested too deep"):
        decode(deep)


def test_refusals_are_not_exceptions_a_test_can_catch() -> None:
    """A test's `except Exception` (or `pytest.raises(Exception)`) does not take a refusal for the solution's
    raise: both derive from BaseException only."""
    assert not issubclass(NoPlainForm, Exception) and not issubclass(BadReply, Exception)
