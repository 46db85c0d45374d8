"""Values as plain data between `code_tests`' processes (flowrl.rewards): what a call into the solution returns,
written by the solution's side (`encode`) and made into real values again on the tests' side (`decode`).

Standard library only: both jails run it, sent as source (`flowrl.rewards.sandbox.program`). A value crosses by
its contents, never by its code: builtin types by exact type, a subclass of one as its base (an `int` with its own
`__eq__` arrives as the `int` it holds), and common standard types as themselves, so that `==` on the tests' side
is Python's between the real values: `Counter`, `defaultdict` (with a builtin type as its factory), `OrderedDict`,
a namedtuple (rebuilt with its name and fields), `Fraction`, `Decimal`, `range`, `deque`, dict views, `date`,
`datetime` (naive or at a fixed offset), `time`, `timedelta`, numpy arrays and scalars; `IntEnum` / `IntFlag`
arrive as their int, `StrEnum` as its str. Ints travel in hex (linear both ways: no 4,300-digit limit).

Anything else (an object of a class the solution defines, a function, an iterator) crosses as a handle
(`["handle", id, kind, type name, class name]`): the tests' side makes it a proxy whose calls go back to the
solution (`flowrl.rewards.proxies`). `decode` trusts nothing: a malformed reply, a set or dict whose keys share
hashes past `FLOOD` (a hash-flooding reply: quadratic to build), a fraction past `FRACTION_BITS` (its gcd is
quadratic), more than `NAMEDTUPLES` namedtuple types (each a class compiled) or nesting past `MAX_DEPTH` raises
`BadReply`. What is left costs time linear in the reply's bytes (at most `REPLY_BYTES`, flowrl.rewards.code), and
all of it runs in the tests' process, under the row's deadline: never in the harness.
"""

from __future__ import annotations

import collections
import keyword
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datetime
    import decimal
    import fractions

MAX_DEPTH = 100
FLOOD = 64  # keys of one set or dict that may share a hash with another key
FRACTION_BITS = 1 << 17
NAMEDTUPLES = 256  # distinct namedtuple types a process makes
DTYPE = re.compile(r"[<>|=]?[biufcUS]\d{1,4}")  # numpy arrays of numbers, bools and strings only
FACTORIES = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set, "tuple": tuple,
             "bool": bool, "bytes": bytes, "frozenset": frozenset}
_VIEWS = {type({}.keys()): "keys", type({}.values()): "values", type({}.items()): "items",
          type(collections.OrderedDict().keys()): "keys", type(collections.OrderedDict().values()): "values",
          type(collections.OrderedDict().items()): "items"}
_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


class NoPlainForm(BaseException):
    """A value that cannot cross as plain data; the test that needed it fails, and says why. A BaseException, so
    that a test's `except Exception` (or `pytest.raises(Exception)`) cannot take it for the solution's raise."""


class BadReply(BaseException):
    """A reply that is not plain data as `encode` writes it, or too costly to decode (why in the message); a
    BaseException for the same reason as NoPlainForm."""


Handle = Callable[[Any], list[Any]]


def encode(x: Any, handle: Handle | None = None, depth: int = 0) -> list[Any]:
    """`x` as tagged JSON-ready lists; what has no plain form goes to `handle` (or raises NoPlainForm)."""
    if depth > MAX_DEPTH:
        raise NoPlainForm("nested deeper than 100 levels")
    t = type(x)
    if x is None:
        return ["none"]
    if t is bool:
        return ["bool", x]
    if t is int:
        return ["int", format(x, "x")]
    if t is float:
        return ["float", repr(x)]
    if t is str:
        return ["str", x]
    if t in (list, tuple, set, frozenset):
        return [t.__name__, [encode(v, handle, depth + 1) for v in x]]
    if t is dict:
        return ["dict", _pairs(x.items(), handle, depth)]
    return _standard(x, handle, depth)


def _pairs(items: Any, handle: Handle | None, depth: int) -> list[Any]:
    return [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in items]


def _standard(x: Any, handle: Handle | None, depth: int) -> list[Any]:  # noqa: C901 (one branch a type)
    """The standard types and builtin subclasses, by their contents."""
    d = depth + 1
    if isinstance(x, bool):
        return ["bool", bool(x)]
    if isinstance(x, int):  # IntEnum, IntFlag, an int subclass: the int it holds
        return ["int", format(int.__index__(x), "x")]
    if isinstance(x, float):  # numpy.float64 among them
        return ["float", float.__repr__(x)]
    if isinstance(x, complex):
        return ["complex", repr(x.real), repr(x.imag)]
    if isinstance(x, str):
        return ["str", str.__str__(x)]
    if isinstance(x, (bytes, bytearray)):
        return ["bytearray" if isinstance(x, bytearray) else "bytes", bytes(x).hex()]
    fractions, decimal, datetime = (sys.modules.get(m) for m in ("fractions", "decimal", "datetime"))
    # (none of them imported: no value of theirs exists, and the solution's process is spared their import)
    if fractions is not None and isinstance(x, fractions.Fraction):
        return ["fraction", format(x.numerator, "x"), format(x.denominator, "x")]
    if decimal is not None and isinstance(x, decimal.Decimal):
        return ["decimal", decimal.Decimal.__str__(x)]
    if isinstance(x, tuple):
        fields = getattr(type(x), "_fields", None)
        items = [encode(v, handle, d) for v in tuple.__iter__(x)]
        if isinstance(fields, tuple) and all(type(f) is str for f in fields) and len(fields) == len(items):
            return ["namedtuple", type(x).__name__, list(fields), items]
        return ["tuple", items]
    if isinstance(x, dict):
        items = _pairs(dict.items(x), handle, depth)
        if isinstance(x, collections.Counter):
            return ["counter", items]
        if isinstance(x, collections.OrderedDict):
            return ["ordereddict", items]
        if isinstance(x, collections.defaultdict):
            factory = x.default_factory
            name = factory.__name__ if factory in FACTORIES.values() else None  # type: ignore[union-attr]
            return ["defaultdict", name, items]
        return ["dict", items]
    if isinstance(x, (list, set, frozenset)):
        kind = "list" if isinstance(x, list) else "set" if isinstance(x, set) else "frozenset"
        return [kind, [encode(v, handle, d) for v in x]]
    view = _VIEWS.get(type(x))
    if view == "items":
        return ["items", _pairs(x, handle, depth)]
    if view is not None:
        return [view, [encode(v, handle, d) for v in x]]
    if isinstance(x, range):
        return ["range", format(x.start, "x"), format(x.stop, "x"), format(x.step, "x")]
    if isinstance(x, collections.deque):
        return ["deque", [encode(v, handle, d) for v in x], x.maxlen]
    if datetime is not None and isinstance(x, (datetime.date, datetime.time)) and not _zoned(x):
        kind = "datetime" if isinstance(x, datetime.datetime) else "date" if isinstance(x, datetime.date) else "time"
        return [kind, x.isoformat()]
    if datetime is not None and isinstance(x, datetime.timedelta):
        return ["timedelta", x.days, x.seconds, x.microseconds]
    if type(x).__module__ == "numpy":
        out = _numpy(x, handle, d)
        if out is not None:
            return out
    if handle is None:
        raise NoPlainForm(f"a {type(x).__name__} has no plain form")
    return handle(x)


def _zoned(x: Any) -> bool:
    """A time zone other than a fixed offset (a zoneinfo zone's rules do not travel)."""
    import datetime

    tz = getattr(x, "tzinfo", None)
    return tz is not None and type(tz) is not datetime.timezone


def _numpy(x: Any, handle: Handle | None, depth: int) -> list[Any] | None:
    if type(x).__name__ == "ndarray" and x.dtype.fields is None and DTYPE.fullmatch(x.dtype.str):
        return ["ndarray", x.dtype.str, list(x.shape), [encode(v, handle, depth) for v in x.ravel().tolist()]]
    item = getattr(x, "item", None)
    if getattr(x, "ndim", None) == 0 and callable(item) and type(x).__name__ != "ndarray":  # a numpy scalar
        value = item()
        if type(value) in (bool, int, float, complex, str, bytes):
            return encode(value, handle, depth)
    return None


# ---- the tests' side ---------------------------------------------------------------------------------------

Resolve = Callable[[list[Any]], Any]


def decode(v: Any, resolve: Resolve | None = None, depth: int = 0) -> Any:
    """The value `encode` wrote; handles go to `resolve`. Anything malformed or too costly raises BadReply."""
    if depth > MAX_DEPTH:
        raise BadReply("nested too deep")
    if not isinstance(v, list) or not v or not isinstance(v[0], str):
        raise BadReply("not a tagged value")
    fn = _DECODE.get(v[0])
    if fn is None:
        if v[0] in ("handle", "ref") and resolve is not None:
            return resolve(v)
        raise BadReply(f"unknown tag {v[0][:20]!r}")
    try:
        return fn(v, resolve, depth + 1)
    except (BadReply, NoPlainForm):
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, ArithmeticError) as e:
        raise BadReply(f"malformed {v[0]}: {type(e).__name__}") from None


def _items(v: Any, resolve: Resolve | None, depth: int) -> list[Any]:
    if not isinstance(v, list):
        raise BadReply("not a list of values")
    return [decode(x, resolve, depth) for x in v]


def _keys(keys: list[Any]) -> None:
    """Refuse a hash-flooding reply: many keys on one hash make a set or dict quadratic to build."""
    if len(keys) - len({hash(k) for k in keys}) > FLOOD:
        raise BadReply(f"{len(keys)} keys on {len({hash(k) for k in keys})} hashes (hash flooding)")


def _mapping(v: Any, resolve: Resolve | None, depth: int) -> list[tuple[Any, Any]]:
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
        raise BadReply("not a list of pairs")
    pairs = [(decode(k, resolve, depth), decode(x, resolve, depth)) for k, x in v]
    _keys([k for k, _ in pairs])
    return pairs


def _set(kind: type) -> Callable[[Any, Resolve | None, int], Any]:
    def make(v: Any, resolve: Resolve | None, depth: int) -> Any:
        items = _items(v[1], resolve, depth)
        _keys(items)
        return kind(items)
    return make


def _int(s: Any) -> int:
    if not isinstance(s, str) or len(s) > (8 << 20):
        raise BadReply("not an int")
    return int(s, 16)


def _float(s: Any) -> float:
    if not isinstance(s, str) or len(s) > 40:
        raise BadReply("not a float")
    return float(s)


def _fraction(v: Any, resolve: Resolve | None, depth: int) -> fractions.Fraction:
    import fractions

    num, den = _int(v[1]), _int(v[2])
    if num.bit_length() + den.bit_length() > FRACTION_BITS:
        raise BadReply("a fraction too large to normalize")
    return fractions.Fraction(num, den)


def _decimal(v: Any, resolve: Resolve | None, depth: int) -> decimal.Decimal:
    import decimal

    if not isinstance(v[1], str) or len(v[1]) > (8 << 20):
        raise BadReply("not a decimal")
    return decimal.Decimal(v[1])


def _namedtuple(v: Any, resolve: Resolve | None, depth: int) -> tuple[Any, ...]:
    name, fields, items = v[1], v[2], _items(v[3], resolve, depth)
    if not (isinstance(name, str) and isinstance(fields, list) and len(fields) == len(items) <= 255
            and all(isinstance(f, str) and f.isidentifier() and not keyword.iskeyword(f) and not f.startswith("_")
                    for f in fields) and len(set(fields)) == len(fields)):
        raise BadReply("a malformed namedtuple")
    key = (name if name.isidentifier() and not keyword.iskeyword(name) else "namedtuple", tuple(fields))
    if key not in _NAMEDTUPLES:
        if len(_NAMEDTUPLES) >= NAMEDTUPLES:  # each a class made (compiled) here: a bound on what a reply costs
            raise BadReply(f"more than {NAMEDTUPLES} namedtuple types")
        _NAMEDTUPLES[key] = collections.namedtuple(key[0], key[1])
    return _NAMEDTUPLES[key](*items)


def _defaultdict(v: Any, resolve: Resolve | None, depth: int) -> collections.defaultdict[Any, Any]:
    if v[1] is not None and v[1] not in FACTORIES:
        raise BadReply("an unknown default factory")
    return collections.defaultdict(FACTORIES[v[1]] if v[1] else None, _mapping(v[2], resolve, depth))


def _deque(v: Any, resolve: Resolve | None, depth: int) -> collections.deque[Any]:
    if v[2] is not None and (type(v[2]) is not int or v[2] < 0):
        raise BadReply("a malformed deque")
    return collections.deque(_items(v[1], resolve, depth), v[2])


def _ndarray(v: Any, resolve: Resolve | None, depth: int) -> Any:
    try:
        import numpy
    except ImportError:
        raise NoPlainForm("a numpy array, and numpy is not importable on the tests' side") from None
    dtype, shape, items = v[1], v[2], _items(v[3], resolve, depth)
    if not (isinstance(dtype, str) and DTYPE.fullmatch(dtype) and isinstance(shape, list) and len(shape) <= 32
            and all(type(n) is int and n >= 0 for n in shape)):
        raise BadReply("a malformed array")
    return numpy.array(items, dtype=numpy.dtype(dtype)).reshape(shape)


def _text(kind: str) -> Callable[[Any, Resolve | None, int], Any]:
    def make(v: Any, resolve: Resolve | None, depth: int) -> Any:
        import datetime

        if not isinstance(v[1], str) or len(v[1]) > 64:
            raise BadReply("malformed")
        return getattr(datetime, kind).fromisoformat(v[1])
    return make


def _bool(v: Any, resolve: Resolve | None, depth: int) -> bool:
    if type(v[1]) is not bool:
        raise BadReply("not a bool")
    return v[1]


def _str(v: Any, resolve: Resolve | None, depth: int) -> str:
    if not isinstance(v[1], str):
        raise BadReply("not a str")
    return v[1]


def _timedelta(v: Any, resolve: Resolve | None, depth: int) -> datetime.timedelta:
    import datetime

    if not all(type(n) is int for n in v[1:4]):
        raise BadReply("a malformed timedelta")
    return datetime.timedelta(days=v[1], seconds=v[2], microseconds=v[3])


_DECODE: dict[str, Callable[[Any, Resolve | None, int], Any]] = {
    "none": lambda v, r, d: None,
    "bool": _bool,
    "int": lambda v, r, d: _int(v[1]),
    "float": lambda v, r, d: _float(v[1]),
    "complex": lambda v, r, d: complex(_float(v[1]), _float(v[2])),
    "str": _str,
    "bytes": lambda v, r, d: bytes.fromhex(v[1]),
    "bytearray": lambda v, r, d: bytearray.fromhex(v[1]),
    "list": lambda v, r, d: _items(v[1], r, d),
    "tuple": lambda v, r, d: tuple(_items(v[1], r, d)),
    "set": _set(set),
    "frozenset": _set(frozenset),
    "dict": lambda v, r, d: dict(_mapping(v[1], r, d)),
    "counter": lambda v, r, d: collections.Counter(dict(_mapping(v[1], r, d))),
    "ordereddict": lambda v, r, d: collections.OrderedDict(_mapping(v[1], r, d)),
    "defaultdict": _defaultdict,
    "namedtuple": _namedtuple,
    "fraction": _fraction,
    "decimal": _decimal,
    "keys": lambda v, r, d: dict.fromkeys(_set(list)(v, r, d)).keys(),
    "values": lambda v, r, d: dict(enumerate(_items(v[1], r, d))).values(),
    "items": lambda v, r, d: dict(_mapping(v[1], r, d)).items(),
    "range": lambda v, r, d: range(_int(v[1]), _int(v[2]), _int(v[3])),
    "deque": _deque,
    "date": _text("date"),
    "datetime": _text("datetime"),
    "time": _text("time"),
    "timedelta": _timedelta,
    "ndarray": _ndarray,
}
