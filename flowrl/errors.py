"""User-facing errors: diagnostics with a source location, rendered as `PATH:LINE:COL: error: ...` with a caret.

Every stage (parse, lowering, data checks, runtime) reports through these classes so the CLI never prints a
Python traceback for a user mistake.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A position in a source file; line and col are 1-based. `end_col` is exclusive (caret width)."""

    path: str
    line: int
    col: int
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    """One problem in a file. `source_line` is the text of `loc.line` (without newline) when known."""

    message: str
    loc: Loc | None = None
    hint: str | None = None
    source_line: str | None = None
    severity: str = "error"

    def render(self) -> str:
        head = f"{self.loc}: {self.severity}: {self.message}" if self.loc else f"{self.severity}: {self.message}"
        lines = [head]
        if self.loc is not None and self.source_line is not None:
            text = self.source_line.expandtabs(1)
            lines.append(f"    {text}")
            width = 1
            if self.loc.end_col is not None and self.loc.end_col > self.loc.col:
                width = self.loc.end_col - self.loc.col
            lines.append("    " + " " * (self.loc.col - 1) + "^" * width)
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


class FlowError(Exception):
    """Raised for any user error; carries every diagnostic found (a file's errors are reported together)."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic | str):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(diagnostics)]
        elif isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class DataError(FlowError):
    """Bad input data (a JSONL line that does not parse, a row without `prompt`): names file and line."""


class RewardError(FlowError):
    """A reward function that raised or returned a non-number; names the sample."""


class ExecutionError(FlowError):
    """A node failed at run time; names the node and its flow source line."""
