"""JSONL prompt data: reading with file:line errors, the held-out split, and the per-step loader with resumable
state."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.data.chat import is_chat
from flowrl.errors import DataError, Diagnostic, Loc


def read_jsonl(path: str | Path, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """All rows of a JSONL file; raises DataError naming every bad line (file:line) at once."""
    p = Path(path)
    if not p.is_file():
        raise DataError(Diagnostic(f"data file not found: {p}"))
    rows: list[dict[str, Any]] = []
    problems: list[Diagnostic] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            loc = Loc(str(p), lineno, 1)
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                problems.append(Diagnostic(f"invalid JSON: {e.msg}", Loc(str(p), lineno, e.colno),
                                           source_line=line.rstrip("\n")))
                continue
            if not isinstance(row, dict):
                problems.append(Diagnostic("each line must be a JSON object", loc, source_line=line.rstrip("\n")))
            elif not (isinstance(row.get(prompt_key), str) or is_chat(row.get(prompt_key))):
                problems.append(Diagnostic(f"missing string field '{prompt_key}'", loc,
                                           source_line=line.rstrip("\n"),
                                           hint=f"every row needs \"{prompt_key}\": \"...\" (or chat messages)"))
            else:
                rows.append(row)
            if len(problems) >= 20:
                break
    if problems:
        raise DataError(problems)
    if not rows:
        raise DataError(Diagnostic(f"data file has no rows: {p}"))
    return rows


def held_out_problem(rows: list[dict[str, Any]], column: str) -> tuple[int, str] | None:
    """(row number from 1, what is wrong) for the first row whose `held_out` column is missing or not a bool,
    else None."""
    for i, row in enumerate(rows, 1):
        if column not in row:
            return i, f"row {i} has no column `{column}` (the data's `held_out` column)"
        if not isinstance(row[column], bool):
            return i, f"row {i}'s `{column}` is {json.dumps(row[column])}, not true or false"
    return None


def split_held_out(rows: list[dict[str, Any]], column: str | None,
                   path: str = "") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows to train on, held-out rows): the rows whose bool `column` is true are never served for training,
    only evaluated on (`held_out = "COLUMN"` on the data). No column: every row trains."""
    if not column:
        return rows, []
    problem = held_out_problem(rows, column)
    if problem is not None:
        line, message = problem
        raise DataError(Diagnostic(message, Loc(path, line, 1) if path else None,
                                   hint=f"give every row \"{column}\": true (held out) or false (trained on)"))
    return [r for r in rows if not r[column]], [r for r in rows if r[column]]


@dataclass
class PromptLoader:
    """Yields `batch` rows per step, reshuffling each epoch; its state is saved in checkpoints. `held_out`:
    rows never yielded, which a preference update evaluates on (`held_out = "COLUMN"`, `split_held_out`)."""

    rows: list[dict[str, Any]]
    batch: int
    shuffle: bool
    seed: int
    prompt_key: str = "prompt"
    epoch: int = 0
    cursor: int = 0
    held_out: list[dict[str, Any]] = field(default_factory=list)

    def _order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[tuple[int, dict[str, Any]]]:
        """(row index, row) pairs; wraps to the next epoch when the data runs out."""
        out: list[tuple[int, dict[str, Any]]] = []
        order = self._order()
        while len(out) < self.batch:
            if self.cursor >= len(order):
                self.epoch += 1
                self.cursor = 0
                order = self._order()
            idx = order[self.cursor]
            out.append((idx, self.rows[idx]))
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
