"""Literal values during lowering: AST expressions -> IR `Value`s, kind checks, and what names stand for.

A name in a step or template body stands for a `Binding`: a declared model, reward or data source, or
(for template parameters) a literal. The kinds are those of `flowrl.ir.signatures.KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.ir.graph import Range, Ref, Value

from . import ast
from .diagnostics import Source

KIND_NAMES = {
    "int": "an integer", "float": "a number", "number": "a number", "bool": "true or false",
    "str": "a string", "any": "a value", "node": "a name bound in the step",
}


class KindError(ValueError):
    """A literal of the wrong kind; `suggestion` is the corrected literal text when one is obvious."""

    def __init__(self, kind: str, value: Value, suggestion: str | None = None) -> None:
        super().__init__(f"expected {KIND_NAMES.get(kind, kind)}, got {describe(value)}")
        self.kind, self.value, self.suggestion = kind, value, suggestion


def to_value(expr: ast.Expr) -> Value:
    """The IR value of a literal expression; names become `Ref`s (callers decide what a name may mean)."""
    if isinstance(expr, ast.Literal):
        return expr.value
    if isinstance(expr, ast.RangeLit):
        return Range(expr.lo, expr.hi)
    if isinstance(expr, ast.ListLit):
        return tuple(to_value(item) for item in expr.items)
    return Ref(expr.name)


def describe(v: Value) -> str:
    """How a value is named in messages: `the string "8"`, `the integer 8`, `the name actor`."""
    if isinstance(v, bool):
        return f"`{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"the integer {v}"
    if isinstance(v, float):
        return f"the number {v!r}"
    if isinstance(v, str):
        return f'the string "{v}"'
    if isinstance(v, Range):
        return f"the range {v}"
    if isinstance(v, Ref):
        return f"the name `{v}`"
    if isinstance(v, tuple):
        return "a list"
    return "nothing"


def literal_text(v: Value) -> str:
    """`v` written as a flow literal."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple):
        return "[" + ", ".join(literal_text(x) for x in v) + "]"
    return str(v)


def coerce(kind: str, v: Value) -> Value:
    """`v` checked against `kind` (ints widen to floats for float parameters); raises KindError."""
    if kind == "any":
        return v
    if kind == "bool" and isinstance(v, bool):
        return v
    if kind == "str" and isinstance(v, str):
        return v
    if not isinstance(v, bool):
        if kind == "int" and isinstance(v, int):
            return v
        if kind == "float" and isinstance(v, (int, float)):
            return float(v)
        if kind == "number" and isinstance(v, (int, float)):
            return v
    raise KindError(kind, v, _suggest(kind, v))


def _suggest(kind: str, v: Value) -> str | None:
    if isinstance(v, str):  # a quoted number or boolean: suggest it without quotes
        try:
            parsed = _parse_scalar(v)
            coerce(kind, parsed)
            return literal_text(parsed)
        except (KindError, ValueError):
            return None
    if isinstance(v, Ref) and kind == "str":
        return literal_text(v.name)
    if isinstance(v, Ref) and kind == "bool" and v.name in ("True", "False"):
        return v.name.lower()
    return None


def _parse_scalar(text: str) -> Value:
    t = text.strip()
    if t in ("true", "false"):
        return t == "true"
    try:
        return int(t)
    except ValueError:
        return float(t)


@dataclass(frozen=True)
class ModelB:
    """A declared model; `role` is None when its declaration had a bad role (calls are then not checked)."""

    name: str
    role: str | None
    trainable: bool = True


@dataclass(frozen=True)
class RewardB:
    name: str
    target: str


@dataclass(frozen=True)
class DataB:
    name: str


@dataclass(frozen=True)
class LiteralB:
    """A template parameter bound to a literal; `expr`/`src` say where that literal was written."""

    param: str
    value: Value
    expr: ast.Expr
    src: Source


@dataclass(frozen=True)
class Unbound:
    """A template parameter whose binding failed (already reported): uses of it are not reported again."""

    name: str


Binding = ModelB | RewardB | DataB | LiteralB | Unbound


def kind_of(b: Binding) -> str:
    """What a binding is, for messages: "a policy model", "a reward", "data", "a literal"."""
    if isinstance(b, ModelB):
        return f"a {b.role} model" if b.role else "a model"
    if isinstance(b, RewardB):
        return "a reward"
    if isinstance(b, DataB):
        return "data"
    if isinstance(b, Unbound):
        return "unbound"
    return "a literal"
