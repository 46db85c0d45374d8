"""A data declaration's `columns` key (lowering, `dsl.lower`): each `"NAME = PATH"` string checked where it is
written, and every row read at check time checked to hold the path, so a misspelt path is a located error
before the run (flowrl.data.paths resolves the paths for the run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flowrl.data.paths import column_problem, parse_column
from flowrl.ir.graph import Value

from . import ast
from .diagnostics import Reporter
from .keys import Entry
from .values import describe, to_value

_EXAMPLE = 'columns = ["answer = reward_model.ground_truth"]'


def column_entries(at: Entry | None) -> list[tuple[ast.Expr, Value]]:
    """The `columns` value's items with where each is written: a list's elements, or the one string."""
    if at is None:
        return []
    value = at.entry.value
    items = value.items if isinstance(value, ast.ListLit) else (value,)
    return [(item, to_value(item)) for item in items]


def check_columns(rep: Reporter, at: Entry | None, prompt_key: str, rows: Sequence[Mapping[str, Any]],
                  shown: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """({keyword: path}, the entries as the graph keeps them) for a data block's `columns` entry (none: empty),
    reporting at each string what is wrong with it, and at the first one whose path a row of the data (`rows`,
    the file named `shown`) lacks."""
    columns: dict[str, str] = {}
    where: dict[str, ast.Expr] = {}
    kept: list[str] = []
    for item, value in column_entries(at):
        assert at is not None
        if not isinstance(value, str):
            rep.error(at.src, f"`columns` holds strings `NAME = PATH`, got {describe(value)}", item,
                      hint=f"for example `{_EXAMPLE}`")
            continue
        try:
            name, path = parse_column(value)
        except ValueError as e:
            rep.error(at.src, f"`columns`: \"{value}\": {e}", item)
            continue
        if name == prompt_key:
            rep.error(at.src, f"`columns` cannot set `{name}`: it is the prompt column", item,
                      hint="choose the prompt's column with `prompt_key`")
            continue
        if name in columns:
            rep.error(at.src, f"`columns` sets `{name}` twice", item, hint=f"first from `{columns[name]}`")
            continue
        columns[name], where[path] = path, item
        kept.append(value)
    problem = column_problem(rows, columns) if columns else None
    if problem is not None and at is not None:
        n, path, what, has = problem
        rep.error(at.src, f"{shown}, row {n}: {what}", where[path], hint=f"{has}; `columns` reads `{path}`")
    return columns, tuple(kept)
