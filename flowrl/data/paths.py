"""Nested columns (flowrl.data): a data declaration's `columns = ["answer = reward_model.ground_truth"]` gives each
row a top-level `answer` read from the dotted path, so a reward that takes `answer` scores data laid out as verl's
preprocessing scripts write it (`reward_model: {"ground_truth": ..., "style": "rule"}`, `extra_info: {...}`).

The row keeps every column it had (nested ones reach the reward whole, as `**row`: `reward_model={...}`); the
mapped keyword is added beside them. A path steps into objects by key and into lists by a 0-based index
(`prompt.0.content`). A row without the path, or with null there, is an error naming the file, the row and what
the last object it reached holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from flowrl.errors import DataError, Diagnostic

__all__ = ["MISSING", "ColumnProblem", "column_problem", "columns_of", "parse_column", "path_problem", "resolve",
           "with_columns"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_ENTRY = re.compile(r"\s*([^=\s]+)\s*=\s*(\S+)\s*$")
MISSING = object()  # what `resolve` returns for a path a row does not have


def parse_column(text: str) -> tuple[str, str]:
    """`"NAME = PATH"` -> (NAME, PATH); ValueError saying what is wrong with it."""
    m = _ENTRY.match(text)
    if m is None:
        raise ValueError("write `NAME = PATH`, e.g. \"answer = reward_model.ground_truth\"")
    name, path = m.group(1), m.group(2)
    if not _NAME.match(name):
        raise ValueError(f"`{name}` is not a keyword a reward can take (letters, digits and _)")
    if any(not part for part in path.split(".")):
        raise ValueError(f"`{path}` has an empty step (write keys joined by single dots)")
    return name, path


def columns_of(option: Any) -> dict[str, str]:
    """A data declaration's `columns` option (one "NAME = PATH" string or several; None: none) as {NAME: PATH}."""
    if option is None:
        return {}
    items = [option] if isinstance(option, str) else list(option)
    return dict(parse_column(str(item)) for item in items)


def resolve(row: Mapping[str, Any], path: str) -> Any:
    """The value at dotted `path` in `row` (MISSING when the row has none there)."""
    value: Any = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return MISSING
    return value


def _holds(value: Any) -> str:
    if isinstance(value, Mapping):
        return "holds " + (", ".join(str(k) for k in value) or "nothing")
    if isinstance(value, list):
        return f"is a list of {len(value)}"
    return f"is {type(value).__name__}, not an object"


def path_problem(row: Mapping[str, Any], path: str) -> tuple[str, str] | None:
    """(what is wrong, what the row has where the path stops) for a path `row` lacks or holds null at, else None."""
    value: Any = row
    parts = path.split(".")
    for i, part in enumerate(parts):
        at = ".".join(parts[:i]) or "the row"
        where = f"`{at}`" if i else at
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return f"no `{path}`", f"{where} {_holds(value)}"
        if value is None and i < len(parts) - 1:
            return f"no `{path}`", f"`{'.'.join(parts[:i + 1])}` is null"
    if value is None:
        return f"`{path}` is null", "a reward keyword needs a value in every row"
    return None


ColumnProblem = tuple[int, str, str, str]  # (row number from 1, the path, what is wrong, what the row has)


def column_problem(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str],
                   first_row: int = 1) -> ColumnProblem | None:
    """The first row (numbered from `first_row`) lacking one of `columns`' paths, else None."""
    for n, row in enumerate(rows, first_row):
        for path in columns.values():
            problem = path_problem(row, path)
            if problem is not None:
                return n, path, *problem
    return None


def with_columns(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str],
                 where: str = "") -> list[dict[str, Any]]:
    """Each row with `columns` (keyword -> dotted path) added at its top level; raises DataError naming `where`
    and the row when a path is missing. No columns: the rows as they are."""
    if not columns:
        return [dict(r) for r in rows]
    problem = column_problem(rows, columns)
    if problem is not None:
        n, _, what, has = problem
        raise DataError(Diagnostic(f"{where}, row {n}: {what}" if where else f"row {n}: {what}", hint=has))
    return [{**row, **{name: resolve(row, path) for name, path in columns.items()}} for row in rows]
