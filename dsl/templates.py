"""Templates: the standard library (`dsl/stdlib/*.flow`) and `use T(k = v)` expansion into a step `Body`.

A parameter without a default binds to the file's declaration of the same name unless passed explicitly;
a parameter with a role annotation (`actor: policy`) must bind to a model of that role; a default may be
a literal, a declaration's name, or the name of an earlier parameter (`n = group`). Template bodies are
hygienic: they see their parameters and the step functions, not the file's other declarations.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import ROLES
from flowrl.ir.signatures import DPO_KINDS

from . import ast
from .diagnostics import Reporter, Source, closest, did_you_mean, one_of
from .parser import parse
from .steps import Body
from .values import Binding, LiteralB, ModelB, Unbound, kind_of, to_value

STDLIB_DIR = Path(__file__).with_name("stdlib")
STDLIB_PREFIX = "<stdlib>"


def stdlib_names() -> list[str]:
    """The standard templates, by name."""
    return sorted(p.stem for p in STDLIB_DIR.glob("*.flow"))


def leading_comment(text: str) -> list[str]:
    """The comment lines a flow or template file opens with, each without its `#` and the space after it (a
    line that is not a comment ends them): what the file says it is and what to expect of it."""
    out: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        out.append(stripped[1:].removeprefix(" ").rstrip())
    return out


def template_summary(name: str, width: int = 100) -> str:
    """One line on what standard template `name` is: the first sentence of its file's leading comment, cut at a
    word within `width` characters ("" when the file opens with no comment)."""
    text = " ".join(part for part in leading_comment(template_source(name)) if part)
    first = re.split(r"(?<=\.)(?<!Dr\.)(?<!al\.)\s+(?=[A-Z`(])", text, maxsplit=1)[0]  # "Dr. GRPO" goes on
    if len(first) <= width:
        return first
    depth, clauses = 0, []  # where a clause ends outside brackets: a cut there reads best, when it keeps enough
    for i, ch in enumerate(first[:width]):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ",;:" and first[i + 1:i + 2] == " ":
            clauses.append(i)
    cut = clauses[-1] if clauses and clauses[-1] >= width * 0.6 else None
    return (first[:cut] if cut is not None else first[:width - 1].rsplit(" ", 1)[0].rstrip(",;:")) + "…"


def template_source(name: str) -> str:
    """The text of a standard template's file (what `flowrl show NAME` prints)."""
    path = STDLIB_DIR / f"{name}.flow"
    if name not in stdlib_names():
        hint = did_you_mean(name, stdlib_names()) or f"templates: {', '.join(stdlib_names())}"
        raise FlowError(Diagnostic(f"unknown template `{name}`", hint=hint))
    return path.read_text(encoding="utf-8")


@functools.cache
def stdlib_template(name: str) -> tuple[ast.TemplateDecl, Source] | None:
    """The parsed standard template `name` (its diagnostics point into `<stdlib>/NAME.flow`)."""
    if name not in stdlib_names():
        return None
    path = f"{STDLIB_PREFIX}/{name}.flow"
    text = (STDLIB_DIR / f"{name}.flow").read_text(encoding="utf-8")
    for decl in parse(text, path).decls:
        if isinstance(decl, ast.TemplateDecl) and decl.name.name == name:
            return decl, Source(path, text)
    return None


def check_template(decl: ast.TemplateDecl, src: Source, rep: Reporter) -> None:
    """Declaration checks on a user template: unique parameter names, known roles."""
    seen: set[str] = set()
    for p in decl.params:
        if p.name.name in seen:
            rep.error(src, f"parameter `{p.name.name}` is declared twice in template `{decl.name.name}`", p.name)
        seen.add(p.name.name)
        if p.role is not None and p.role.name not in ROLES:
            rep.error(src, f"unknown role `{p.role.name}`", p.role,
                      hint=did_you_mean(p.role.name, ROLES) or f"roles: {', '.join(ROLES)}")


@dataclass(frozen=True)
class UseArg:
    """One argument of `use T(...)` and the file it was written in (the flow, or the `--set` overrides)."""

    arg: ast.Arg
    src: Source


class Expander:
    """Binds a `use` to its template; `decls` are the file's models, rewards and data by name."""

    def __init__(self, rep: Reporter, decls: Mapping[str, Binding],
                 templates: Mapping[str, tuple[ast.TemplateDecl, Source]]) -> None:
        self.rep = rep
        self.decls = decls
        self.templates = templates

    def find(self, name: str) -> tuple[ast.TemplateDecl, Source] | None:
        return self.templates.get(name) or stdlib_template(name)

    def expand(self, use: ast.UseDecl, src: Source, args: list[UseArg]) -> Body | None:
        name = use.template.name
        found = self.find(name)
        if found is None:
            known = sorted(set(stdlib_names()) | set(self.templates))
            hint = (f"`{name}` is a kind of the `dpo` template: write `use dpo(dpo = \"{name}\")`"
                    if name in DPO_KINDS else did_you_mean(name, known) or f"templates: {', '.join(known)}")
            self.rep.error(src, f"unknown template `{name}`", use.template, hint=hint)
            return None
        tdecl, tsrc = found
        if tsrc.path != src.path:  # a standard template: its lines' problems also point at this `use`
            note = src.error(f"in the standard template `{name}` (`flowrl show {name}`), used here", use.template)
            self.rep.called_from[tsrc.path] = replace(note, severity="note")
        given = self._given(name, tdecl, args)
        env: dict[str, Binding] = {}
        origins: dict[str, tuple[Source, ast.Located]] = {}
        for p in tdecl.params:
            pname = p.name.name
            ua = given.get(pname)
            b = self._bind(use, src, name, tdecl, p, ua, tsrc, env)
            env[pname] = b if b is not None else Unbound(pname)
            origins[pname] = (ua.src, ua.arg.value) if ua is not None else (src, use.template)
        # the body is lowered even when a binding failed, so its other problems are reported too
        return Body(tdecl.body, tsrc, env, template=name, origins=origins, via=src.loc(use.template))

    def _given(self, name: str, tdecl: ast.TemplateDecl, args: list[UseArg]) -> dict[str, UseArg]:
        params = [p.name.name for p in tdecl.params]
        given: dict[str, UseArg] = {}
        seen_keyword, n_pos = False, 0
        for ua in args:
            arg = ua.arg
            if arg.key is None:
                if seen_keyword:
                    self.rep.error(ua.src, "positional argument after keyword arguments", arg,
                                   hint="pass template arguments by name: `use T(NAME = VALUE)`")
                    continue
                if n_pos >= len(params):
                    self.rep.error(ua.src, f"too many positional arguments for template `{name}`", arg,
                                   hint=f"it takes {one_of(params)}")
                    continue
                pname = params[n_pos]
                n_pos += 1
            else:
                seen_keyword = True
                pname = arg.key.name
                if pname not in params:
                    self.rep.error(ua.src, f"unknown argument `{pname}` for template `{name}`", arg.key,
                                   hint=did_you_mean(pname, params) or f"template `{name}` takes {one_of(params)}")
                    continue
            if pname in given:
                self.rep.error(ua.src, f"argument `{pname}` of template `{name}` is given twice", arg)
                continue
            given[pname] = ua
        return given

    def _bind(self, use: ast.UseDecl, src: Source, name: str, tdecl: ast.TemplateDecl, p: ast.TemplateParam,
              ua: UseArg | None, tsrc: Source, earlier: Mapping[str, Binding]) -> Binding | None:
        pname = p.name.name
        # where a problem with this binding is reported: the argument as written, else the `use` itself
        wsrc, where = (ua.src, ua.arg.value) if ua is not None else (src, use.template)
        b: Binding | None
        if ua is None and p.default is None:  # bind to the file's declaration of the same name
            b = self.decls.get(pname)
            if b is None:
                self._missing(use, src, name, tdecl, p)
                return None
        else:
            expr, esrc = (ua.arg.value, ua.src) if ua is not None else (p.default, tsrc)
            assert expr is not None
            if isinstance(expr, ast.Name) and ua is None and expr.name in earlier:
                b = earlier[expr.name]  # a default naming an earlier parameter (`n = group`)
            elif isinstance(expr, ast.Name):
                b = self.decls.get(expr.name)
                if b is None:
                    message = (f"unknown name `{expr.name}`" if ua is not None else
                               f"template `{name}` parameter `{pname}` defaults to `{expr.name}`, "
                               "which is not declared")
                    self.rep.error(wsrc, message, where, hint=did_you_mean(expr.name, self.decls))
                    return None
            else:
                b = LiteralB(pname, to_value(expr), expr, esrc)
        role = p.role.name if p.role is not None else None
        if role is not None and not (isinstance(b, ModelB) and b.role in (role, None)):
            shown = f"`{b.name}`" if not isinstance(b, LiteralB) else "the argument"
            self.rep.error(wsrc, f"template `{name}` needs `{pname}` to be a {role} model, "
                                 f"but {shown} is {kind_of(b)}", where,
                           hint=f"pass a {role} model: `use {name}({pname} = NAME)`")
            return None
        return b

    def _missing(self, use: ast.UseDecl, src: Source, name: str, tdecl: ast.TemplateDecl,
                 p: ast.TemplateParam) -> None:
        pname = p.name.name
        if p.role is not None:
            role = p.role.name
            source = '"tiny:gpt2"'
            for q in tdecl.params:  # copy weights from the template's policy, as bound in this file
                if q.role is not None and q.role.name == "policy" and role != "policy":
                    actor = self.decls.get(q.name.name)
                    source = actor.name if isinstance(actor, ModelB) else q.name.name
                    break
            self.rep.error(src, f"template `{name}` needs a {role} model `{pname}`, but none is declared",
                           use.template,
                           hint=f"declare `model {pname} : {role} {{ source = {source} }}`, "
                                f"or pass one: `use {name}({pname} = NAME)`")
            return
        near = closest(pname, self.decls)
        if near is not None:
            hint = f"did you mean `{near}`? pass it explicitly: `use {name}({pname} = {near})`"
        elif _called(tdecl, pname):
            hint = f"declare `reward {pname} = \"pkg.module.fn\"`, or pass one: `use {name}({pname} = NAME)`"
        else:
            hint = f"declare `data {pname} = jsonl(\"PATH\")`, or pass one: `use {name}({pname} = NAME)`"
        self.rep.error(src, f"template `{name}` needs `{pname}`, but nothing named `{pname}` is declared",
                       use.template, hint=hint)


def _called(tdecl: ast.TemplateDecl, pname: str) -> bool:
    return any(s.call.callee.name == pname and s.call.method is None for s in tdecl.body)
