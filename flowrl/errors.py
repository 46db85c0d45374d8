"""User-facing errors: diagnostics with a source location, rendered as `PATH:LINE:COL: error: ...` with a caret.

Every stage (parse, lowering, data checks, runtime) reports through these classes so the CLI never prints a
Python traceback for a user mistake.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from types import TracebackType


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
    severity: str = "error"  # "error", "warning" (shown, the flow still runs) or "note" (in `notes`)
    notes: tuple[Diagnostic, ...] = ()  # where else it comes from: the `use` of the template a line is in

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
        lines.extend(n.render() for n in self.notes)
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


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_NOT_USERS = tuple({*(os.path.realpath(os.path.join(_PACKAGE, d)) for d in ("", "dsl", "backends")), _PACKAGE,
                    *(os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                                            "platlib"))})


def user_frame_hint(tb: TracebackType | None) -> str:
    """Where the user's own code (a reward, a `@flowrl.function`) raised, from a traceback: never a path inside
    flowrl or an installed library, which would send the user to code that is not theirs."""
    import traceback

    for frame in reversed(traceback.extract_tb(tb)):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(_NOT_USERS) or os.path.realpath(path).startswith(
                _NOT_USERS):
            continue
        shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        return f"raised at {shown}:{frame.lineno} in {frame.name}"
    return "no code of yours raised it: if the flow is right, this is a flowrl bug; please report it"
