"""Data as users have it (flowrl.data): parquet files and local Hugging Face `datasets` directories (written by
`Dataset.save_to_disk`), read into the same rows as JSONL, and the checks every row set gets — the columns a
use needs (prompts, preference pairs, demonstrations) and prompts as plain text or chat messages.

A `datasets` directory is read with pyarrow alone (its `state.json` names the Arrow files, each an Arrow IPC
stream), so neither reading nor `flowrl check` needs the `datasets` package. Problems name the file and the row
(1-based, as a person counts them); every bad row is reported at once, up to 20.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowrl.data.chat import is_chat
from flowrl.errors import DataError, Diagnostic

__all__ = ["DATA_KINDS", "ROW_KINDS", "check_rows", "is_chat", "prompt_plain", "read_data", "read_disk_dataset",
           "read_parquet", "read_rows"]

# The readers a `data NAME = KIND("path")` declaration may name.
DATA_KINDS = ("jsonl", "parquet", "datasets")

# The columns each kind of row needs; a prompt is text or chat messages, the others text.
ROW_KINDS: Mapping[str, tuple[str, ...]] = {
    "prompts": ("prompt",),
    "pairs": ("prompt", "chosen", "rejected"),
    "demos": ("prompt", "response"),
}
_MAX_PROBLEMS = 20


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401  (the submodule the readers use)
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:  # pragma: no cover - the base install has it
        raise DataError(Diagnostic("reading parquet and datasets directories needs pyarrow: pip install pyarrow")) from e
    return pyarrow


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a parquet file as dicts (column -> Python value)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(Diagnostic(f"data file not found: {p}"))
    pa = _pyarrow()
    try:
        table = pa.parquet.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise DataError(Diagnostic(f"cannot read parquet file {p}: {e}")) from e
    return list(table.to_pylist())


def read_disk_dataset(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a directory written by `datasets.Dataset.save_to_disk` (a `DatasetDict`'s directory needs its
    split named: `.../train`)."""
    p = Path(path)
    if not p.is_dir():
        raise DataError(Diagnostic(f"datasets directory not found: {p}"))
    state = p / "state.json"
    if not state.is_file():
        splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        hint = f" (a DatasetDict: name a split, e.g. {p / splits[0]})" if splits else ""
        raise DataError(Diagnostic(f"not a datasets directory (no state.json): {p}{hint}"))
    try:
        files = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(Diagnostic(f"unreadable state.json in {p}: {type(e).__name__}: {e}")) from e
    pa = _pyarrow()
    rows: list[dict[str, Any]] = []
    for name in files:
        try:
            with pa.memory_map(str(p / name)) as source:
                rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
        except (pa.ArrowException, OSError) as e:
            raise DataError(Diagnostic(f"cannot read {p / name}: {e}")) from e
    return rows


def read_rows(kind: str, path: str | Path) -> list[dict[str, Any]]:
    """Rows from a data declaration's reader: "parquet" or "datasets"."""
    if kind == "parquet":
        return read_parquet(path)
    if kind == "datasets":
        return read_disk_dataset(path)
    raise ValueError(f"unknown table kind {kind!r}")


def _message_problem(messages: Sequence[Any]) -> str | None:
    if not messages:
        return "has no messages"
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            return f"message {i} is not an object"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"message {i} has no string \"{key}\""
    return None


def check_rows(rows: Sequence[Mapping[str, Any]], where: str, columns: Sequence[str] = ("prompt",),
               first_row: int = 1, prompt_key: str = "prompt") -> None:
    """Raise DataError naming every row (`where`, row N) that lacks one of `columns` or whose value is of the
    wrong type: a prompt is a string or chat messages, every other column a string."""
    problems: list[Diagnostic] = []
    if not rows:
        raise DataError(Diagnostic(f"data has no rows: {where}"))
    for n, row in enumerate(rows, first_row):
        missing = [c for c in columns if c not in row]
        if missing:
            found = ", ".join(sorted(row)) or "none"
            problems.append(Diagnostic(f"{where}, row {n}: no column {', '.join(repr(c) for c in missing)}",
                                       hint=f"its columns: {found}; this use needs {', '.join(columns)}"))
        for c in columns:
            if c not in row:
                continue
            value = row[c]
            if c == prompt_key and is_chat(value):
                problem = _message_problem(value)
                if problem is not None:
                    problems.append(Diagnostic(f"{where}, row {n}: the chat prompt {problem}",
                                               hint='write [{"role": "user", "content": "..."}, ...]'))
            elif not isinstance(value, str):
                problems.append(Diagnostic(f"{where}, row {n}: column '{c}' is {type(value).__name__}, not text"))
        if len(problems) >= _MAX_PROBLEMS:
            break
    if problems:
        raise DataError(problems)


def read_data(kind: str, path: str | Path, prompt_key: str = "prompt",
              columns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The rows of a data declaration (`kind` one of DATA_KINDS), each checked to hold `prompt_key` (text or chat
    messages) and `columns` (text); raises DataError naming the file and the bad rows (a JSONL file by line)."""
    if kind == "jsonl":
        from flowrl.data.jsonl import read_jsonl
        rows = read_jsonl(path, prompt_key=prompt_key)
    else:
        rows = read_rows(kind, path)
    wanted = [prompt_key, *(c for c in columns if c != prompt_key)]
    check_rows(rows, str(path), wanted, prompt_key=prompt_key)
    return rows


def prompt_plain(value: Any) -> str:
    """A prompt as text without a model at hand: chat messages in the tiny models' template (`render_plain`)."""
    from flowrl.data.chat import render_plain
    return render_plain(value) if is_chat(value) else str(value)
