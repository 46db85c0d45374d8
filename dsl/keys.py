"""Declaration keys against what they accept (lowering, `dsl.lower`): the numbers within each key's `Limit` and
the strings among its choices, as `flowrl.ir.signatures.KEY_LIMITS` / `KEY_CHOICES` declare them once.

A block is the entries of one `model`, `data`, `run` or `reward` declaration (overrides included), by key.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.ir.graph import Value
from flowrl.ir.signatures import KEY_CHOICES, KEY_LIMITS, Limit

from . import ast
from .diagnostics import Reporter, Source, did_you_mean


@dataclass(frozen=True)
class Entry:
    """One `KEY = VALUE` of a block and the file it was written in (the flow, or the `--set` overrides)."""

    entry: ast.Entry
    src: Source


def out_of_limit(limit: Limit, value: Value) -> bool:
    """True for a number outside `limit` (a value of another kind is the kind check's to report)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not limit.holds(float(value))


def check_value(rep: Reporter, what: str, key: str, at: Entry, value: Value) -> bool:
    """Report `value` (of `what`'s `key`, already of the right kind) when it is outside the key's limit or
    choices; True when it is fine."""
    limit = KEY_LIMITS.get(what, {}).get(key)
    if limit is not None and out_of_limit(limit, value):
        rep.error(at.src, f"`{key}` must be {limit}", at.entry.value, hint=limit.why)
        return False
    allowed = KEY_CHOICES.get(what, {}).get(key)
    if allowed and isinstance(value, str) and value not in allowed:
        rep.error(at.src, f"`{key}` must be one of {', '.join(allowed)}", at.entry.value,
                  hint=did_you_mean(value, allowed))
        return False
    return True
