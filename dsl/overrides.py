"""`--set KEY=VALUE` overrides, parsed into entries that lowering merges into the flow before checking.

Keys are `MODEL.KEY`, `DATA.KEY`, `REWARD.KEY`, `ENV.KEY` (an `env` or `tool`), `run.KEY`, `use.PARAM` or
`eval.NAME.KEY` (an `eval` block's key); values are flow literal text (`8`, `1e-4`,
`true`, `"s"`, `2..16`, a name). The overrides form their own source, `<overrides>`, one `KEY=VALUE`
line each, so a bad value is reported with a caret like any other error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from flowrl.errors import Diagnostic, FlowError, Loc

from . import ast
from .diagnostics import Reporter, Source, did_you_mean
from .parser import parse_value

OVERRIDES_PATH = "<overrides>"
_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Overrides:
    """Entries to merge, by target; `src` is the `<overrides>` source they point into."""

    src: Source
    models: dict[str, list[ast.Entry]] = field(default_factory=dict)
    data: dict[str, list[ast.Entry]] = field(default_factory=dict)
    rewards: dict[str, list[ast.Entry]] = field(default_factory=dict)
    run: list[ast.Entry] = field(default_factory=list)
    use: list[ast.Arg] = field(default_factory=list)
    envs: dict[str, list[ast.Entry]] = field(default_factory=dict)  # `env`/`tool` blocks, by name
    evals: dict[str, list[ast.Entry]] = field(default_factory=dict)  # `eval` blocks, by name (`eval.NAME.KEY`)


def parse_overrides(overrides: Mapping[str, str] | None, models: list[str], data: list[str], has_use: bool,
                    rep: Reporter, rewards: Sequence[str] = (), envs: Sequence[str] = (),
                    evals: Sequence[str] | None = None) -> Overrides:
    # one line per override in the `<overrides>` source (a value is a single line by nature)
    items = [(k.replace("\n", " "), v.replace("\n", " ")) for k, v in (overrides or {}).items()]
    lines = [f"{k}={v}" for k, v in items]
    src = Source(OVERRIDES_PATH, "\n".join(lines))
    out = Overrides(src)
    for i, (key, text) in enumerate(items):
        line = i + 1
        key_span = ast.Span(line, 1, line, len(key) + 1)
        if evals is not None and key.startswith("eval."):
            _eval_override(out, key, text, src, line, len(lines[i]), evals, rep)
            continue
        m = _KEY.match(key)
        if m is None:
            rep.error(src, f"override `{key}` must be MODEL.KEY, DATA.KEY, REWARD.KEY, ENV.KEY, run.KEY or use.PARAM", key_span)
            continue
        target, name = m.group(1), m.group(2)
        name_ident = ast.Ident(name, ast.Span(line, len(target) + 2, line, len(key) + 1))
        value = _value(text, src, line, len(key) + 1, rep)
        if value is None:
            continue
        span = ast.Span(line, 1, line, len(lines[i]) + 1)
        if target == "use":
            if not has_use:
                rep.error(src, f"override `{key}`: this flow has no `use`", key_span,
                          hint="`use.PARAM` overrides a template argument")
                continue
            out.use.append(ast.Arg(name_ident, value, span))
        elif target == "run":
            out.run.append(ast.Entry(name_ident, value, span))
        elif target in models:
            out.models.setdefault(target, []).append(ast.Entry(name_ident, value, span))
        elif target in data:
            out.data.setdefault(target, []).append(ast.Entry(name_ident, value, span))
        elif target in rewards:
            out.rewards.setdefault(target, []).append(ast.Entry(name_ident, value, span))
        elif target in envs:
            out.envs.setdefault(target, []).append(ast.Entry(name_ident, value, span))
        else:
            hint = did_you_mean(target, [*models, *data, *rewards, *envs, "run", "use"]) or (
                f"models: {', '.join(models) or 'none'}; data: {', '.join(data) or 'none'}; "
                f"rewards: {', '.join(rewards) or 'none'}; envs: {', '.join(envs) or 'none'}; or `run`, `use`")
            rep.error(src, f"override `{key}`: no model, data, reward or env named `{target}`",
                      ast.Span(line, 1, line, len(target) + 1), hint=hint)
    return out


def _eval_override(out: Overrides, key: str, text: str, src: Source, line: int, width: int, evals: Sequence[str],
                   rep: Reporter) -> None:
    """`eval.NAME.KEY=VALUE`: an entry of eval block NAME (applied to it in every stage that has it)."""
    parts = key.split(".")
    if len(parts) != 3 or not all(_NAME.fullmatch(a) for a in parts[1:]):
        rep.error(src, f"override `{key}` must be eval.NAME.KEY", ast.Span(line, 1, line, len(key) + 1),
                  hint="for example `eval.held.n=8`")
        return
    name, entry = parts[1], parts[2]
    if name not in evals:
        rep.error(src, f"override `{key}`: no eval named `{name}`", ast.Span(line, 6, line, 6 + len(name)),
                  hint=did_you_mean(name, evals) or f"evals: {', '.join(evals) or 'none'}")
        return
    value = _value(text, src, line, len(key) + 1, rep)
    if value is not None:
        ident = ast.Ident(entry, ast.Span(line, len(name) + 7, line, len(key) + 1))
        out.evals.setdefault(name, []).append(ast.Entry(ident, value, ast.Span(line, 1, line, width + 1)))


def _value(text: str, src: Source, line: int, offset: int, rep: Reporter) -> ast.Expr | None:
    """Parse `text` (written at column `offset + 1` of `line`) as a value; errors point into `src`."""
    try:
        expr = parse_value(Source(OVERRIDES_PATH, text))
    except FlowError as e:
        for d in e.diagnostics:
            rep.add(_shift_diag(d, src, line, offset))
        return None
    return _shift(expr, line, offset)


def _shift_diag(d: Diagnostic, src: Source, line: int, offset: int) -> Diagnostic:
    if d.loc is None:
        return d
    end = d.loc.end_col + offset if d.loc.end_col is not None else None
    return replace(d, loc=Loc(src.path, line, d.loc.col + offset, end), source_line=src.line(line))


def _shift(expr: ast.Expr, line: int, offset: int) -> ast.Expr:
    s = expr.span
    span = ast.Span(line, s.col + offset, line, s.end_col + offset)
    if isinstance(expr, ast.ListLit):
        return replace(expr, items=tuple(_shift(x, line, offset) for x in expr.items), span=span)
    return replace(expr, span=span)
