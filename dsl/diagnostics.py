"""Helpers that turn a position in a flow source into a `flowrl.errors.Diagnostic` (parser and lowering).

A `Source` is a file's path and text; `Source.error(...)` builds the diagnostic with file:line:col, the
source line and a caret under the node. `did_you_mean` gives the "did you mean `x`?" hint.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from flowrl.errors import Diagnostic, FlowError, Loc

from .ast import EvalDecl, Located, Span, StageDecl, strip_comment


@dataclass(frozen=True)
class Source:
    """A flow file (or a template file, or the `--set` overrides) as diagnostics see it."""

    path: str
    text: str

    def line(self, n: int) -> str:
        lines = self.text.split("\n")
        return lines[n - 1].rstrip("\r") if 0 < n <= len(lines) else ""

    def loc(self, where: Located | Span) -> Loc:
        if isinstance(where, Span):
            end = where.end_col if where.end_line == where.line else where.col + 1
            return Loc(self.path, where.line, where.col, end)
        return Loc(self.path, where.line, where.col, where.end_col)

    def text_of(self, where: Located | Span) -> str:
        """The source text of a node, comments dropped, each line break and its indentation folded to a space."""
        span = where if isinstance(where, Span) else where.span
        raw = self.text[span.start_pos:span.end_pos]
        parts = (strip_comment(part).strip() for part in raw.splitlines())
        return " ".join(p for p in parts if p)

    def error(self, message: str, where: Located | Span, hint: str | None = None) -> Diagnostic:
        loc = self.loc(where)
        return Diagnostic(message, loc, hint=hint, source_line=self.line(loc.line))

    def error_at(self, message: str, line: int, col: int, width: int = 1, hint: str | None = None) -> Diagnostic:
        return Diagnostic(message, Loc(self.path, line, col, col + max(width, 1)), hint=hint,
                          source_line=self.line(line))


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name` (difflib ratio >= 0.6), or None. Among the equally similar, the one
    fewest typing slips away (a swapped pair of letters counts as one: `gpro` is `grpo`, not `gspo`)."""
    found = difflib.get_close_matches(name, sorted(set(candidates) - {name}), n=5, cutoff=0.6)
    if not found:
        return None
    best = difflib.SequenceMatcher(None, name, found[0]).ratio()
    tied = [c for c in found if difflib.SequenceMatcher(None, name, c).ratio() == best]
    return min(tied, key=lambda c: _slips(name, c))


def _slips(a: str, b: str) -> int:
    """Edits from `a` to `b`: insertions, deletions, substitutions and swaps of neighbours (optimal string
    alignment distance)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """"did you mean `x`?" for the closest candidate, or None when nothing is close."""
    best = closest(name, candidates)
    return f"did you mean `{best}`?" if best else None


def one_of(names: Iterable[str]) -> str:
    """`a`, `b` or `c` — for messages listing what is allowed."""
    items = [f"`{n}`" for n in names]
    if not items:
        return "nothing"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


class Reporter:
    """Collects every diagnostic of a compilation; `check()` raises the errors together (torchtune style);
    warnings are kept apart (`warnings`), for the graph to carry. A diagnostic in a standard template's file
    gets a note at the `use` that expanded it (`called_from`), so the user sees their own line too."""

    def __init__(self) -> None:
        self.diagnostics: list[Diagnostic] = []
        self.warnings: list[Diagnostic] = []
        self.called_from: dict[str, Diagnostic] = {}  # a template file's path -> a note at its `use`

    def error(self, src: Source, message: str, where: Located | Span, hint: str | None = None) -> None:
        self.add(src.error(message, where, hint))

    def warn(self, src: Source, message: str, where: Located | Span, hint: str | None = None) -> None:
        self.add(replace(src.error(message, where, hint), severity="warning"))

    def add(self, diag: Diagnostic) -> None:
        note = self.called_from.get(diag.loc.path) if diag.loc is not None else None
        if note is not None and not diag.notes:
            diag = replace(diag, notes=(note,))
        into = self.warnings if diag.severity == "warning" else self.diagnostics
        if diag not in into:  # the same literal reached twice through a template: report once
            into.append(diag)

    def extend(self, diags: Iterable[Diagnostic]) -> None:
        for d in diags:
            self.add(d)

    def check(self, main_path: str) -> None:
        """Raise FlowError with all diagnostics, the main file's first, each file's in line order."""
        if not self.diagnostics:
            return

        def key(d: Diagnostic) -> tuple[bool, str, int, int]:
            if d.loc is None:
                return (True, "", 0, 0)
            return (d.loc.path != main_path, d.loc.path, d.loc.line, d.loc.col)

        raise FlowError(sorted(self.diagnostics, key=key))


N = TypeVar("N", EvalDecl, StageDecl)


def unique_named(rep: Reporter, src: Source, decls: Sequence[N], what: str) -> list[N]:
    """`decls` but those whose name an earlier one took, each of those an error at its name (`what`: "eval",
    "stage", ...)."""
    first: dict[str, N] = {}
    for d in decls:
        name = d.name.name
        if name in first:
            rep.error(src, f"duplicate {what} name `{name}`", d.name,
                      hint=f"`{name}` is first declared on line {first[name].line}; {what} names must be unique")
            continue
        first[name] = d
    return list(first.values())
