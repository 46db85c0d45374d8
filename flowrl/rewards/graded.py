"""A reward value that says why (flowrl.rewards): a float with `notes`, counts by name, that the scorers add to the
step's metrics (`reward/NAME/KEY`, flowrl.runtime.scoring). `code_tests` notes its failed tests by reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Graded(float):
    """`float(value)`, plus `notes` (name -> count). Pickles as both, so it crosses from a reward worker."""

    notes: dict[str, int]

    def __new__(cls, value: float, notes: Mapping[str, int] | None = None) -> Graded:
        out = super().__new__(cls, value)
        out.notes = dict(notes or {})
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (Graded, (float(self), self.notes))


def notes_of(value: object) -> dict[str, int]:
    """The notes a reward's value carries (none for a plain number)."""
    found = getattr(value, "notes", None) if isinstance(value, Graded) else None
    return {str(k): int(v) for k, v in found.items()} if isinstance(found, dict) else {}
