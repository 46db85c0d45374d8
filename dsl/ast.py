"""The flow language's syntax tree: what `dsl.parser` builds from text and `dsl.lower` turns into a Graph.

Every node is a frozen dataclass carrying a `Span` (1-based line and column, exclusive end column, and
the character offsets used to slice a statement's text back out of its source).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Where a node is: `line`/`col` of its first character, `end_line`/`end_col` just past its last."""

    line: int
    col: int
    end_line: int
    end_col: int
    start_pos: int = 0
    end_pos: int = 0


class Located:
    """Mixin giving every node `line`, `col` and `end_col` (the caret's extent on the first line)."""

    span: Span

    @property
    def line(self) -> int:
        return self.span.line

    @property
    def col(self) -> int:
        return self.span.col

    @property
    def end_col(self) -> int:
        # a node spanning lines is underlined to the end of its first line only
        return self.span.end_col if self.span.end_line == self.span.line else self.span.col + 1


# ---- values ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Literal(Located):
    """An int, float, string or boolean literal."""

    value: int | float | str | bool
    span: Span


@dataclass(frozen=True)
class Name(Located):
    """An identifier used as a value: a declaration, a name bound in the step, a parameter, or `auto`."""

    name: str
    span: Span


@dataclass(frozen=True)
class RangeLit(Located):
    """`lo..hi`, inclusive (elastic sizes)."""

    lo: int
    hi: int
    span: Span


@dataclass(frozen=True)
class ListLit(Located):
    items: tuple[Expr, ...]
    span: Span


Expr = Literal | Name | RangeLit | ListLit


@dataclass(frozen=True)
class Ident(Located):
    """An identifier in a naming position (declaration name, key, keyword argument, method)."""

    name: str
    span: Span


@dataclass(frozen=True)
class Entry(Located):
    """`KEY = VALUE` inside `{ }`."""

    key: Ident
    value: Expr
    span: Span


@dataclass(frozen=True)
class Arg(Located):
    """A call argument: positional when `key` is None."""

    key: Ident | None
    value: Expr
    span: Span


# ---- step statements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call(Located):
    """`callee(args)` or `callee.method(args)`."""

    callee: Ident
    method: Ident | None
    args: tuple[Arg, ...]
    span: Span


@dataclass(frozen=True)
class Stmt(Located):
    """`target = call`, or a bare `call` (a sink such as `actor.update(...)`) when `target` is None."""

    target: Ident | None
    call: Call
    span: Span


# ---- declarations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlowDecl(Located):
    name: Ident
    span: Span


@dataclass(frozen=True)
class ImportDecl(Located):
    module: Literal
    span: Span


@dataclass(frozen=True)
class ModelDecl(Located):
    name: Ident
    role: Ident
    entries: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class RewardDecl(Located):
    """`reward NAME = "pkg.fn" { entries }` or `reward NAME = KIND("address") { entries }` (KIND: `http`)."""

    name: Ident
    target: Literal
    span: Span
    kind: Ident | None = None
    entries: tuple[Entry, ...] = ()


@dataclass(frozen=True)
class DataDecl(Located):
    """`data NAME = KIND(args) { entries }`."""

    name: Ident
    kind: Ident
    args: tuple[Arg, ...]
    entries: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class UseDecl(Located):
    template: Ident
    args: tuple[Arg, ...]
    span: Span


@dataclass(frozen=True)
class StepDecl(Located):
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True)
class TemplateParam(Located):
    """`name`, `name: role`, `name = default`."""

    name: Ident
    role: Ident | None
    default: Expr | None
    span: Span


@dataclass(frozen=True)
class TemplateDecl(Located):
    name: Ident
    params: tuple[TemplateParam, ...]
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True)
class RunDecl(Located):
    entries: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class PoolDecl(Located):
    name: Ident
    entries: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class Target(Located):
    """`model` or `model.method` on the left of `->`."""

    model: Ident
    method: Ident | None
    span: Span


@dataclass(frozen=True)
class Assign(Located):
    """`TARGET, TARGET -> POOL`."""

    targets: tuple[Target, ...]
    pool: Ident
    span: Span


@dataclass(frozen=True)
class PlacementDecl(Located):
    pools: tuple[PoolDecl, ...]
    assigns: tuple[Assign, ...]
    span: Span


@dataclass(frozen=True)
class EnvDecl(Located):
    """`env NAME = "module.Class" { entries }` or `tool NAME = "module.fn" { entries }` (`kind` is the keyword)."""

    kind: Ident
    name: Ident
    target: Literal
    entries: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class EvalDecl(Located):
    """`eval NAME { entries }`: a held-out evaluation (at the top level, or one stage's)."""

    name: Ident
    entries: tuple[Entry, ...]
    span: Span


StageItem = UseDecl | StepDecl | RunDecl | PlacementDecl | EvalDecl


@dataclass(frozen=True)
class StageDecl(Located):
    """`stage NAME { use ... | step { } ; run { } ; placement { } ; eval NAME { } }`: one stage of a pipeline, in file
    order."""

    name: Ident
    items: tuple[StageItem, ...]
    span: Span


Decl = (FlowDecl | ImportDecl | ModelDecl | RewardDecl | DataDecl | UseDecl | StepDecl | TemplateDecl | RunDecl
        | PlacementDecl | EnvDecl | StageDecl | EvalDecl)


@dataclass(frozen=True)
class Module:
    """A parsed `.flow` file: its declarations in order, plus the path and text (for diagnostics)."""

    path: str
    text: str
    decls: tuple[Decl, ...]


def strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` inside a string literal is kept)."""
    in_string = escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif in_string and ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
        elif ch == "#" and not in_string:
            return line[:i]
    return line
