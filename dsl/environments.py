"""`env` and `tool` declarations during lowering (`dsl.lower`): their blocks -> `flowrl.envs.EnvSpec`'s fields,
the names a step uses for them, and a generate node's `env` argument -> the spec it carries.

A generate node that runs an environment carries the whole spec in its attrs (`attrs["env"]`, a plain dict of
EnvSpec's fields, with the flow's folder and imports), so every backend's worker gets it with the node and
builds its pool from it; `attrs["max_total"]` caps a trajectory's response tokens (0: the model's positions), `attrs["env_at"]` says
where the env is declared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowrl.ir.graph import Node, Value, frozen

from . import ast
from .diagnostics import Reporter, Source, did_you_mean
from .keys import Entry
from .values import LiteralB


@dataclass(frozen=True)
class EnvInfo:
    """One declared env or tool: its declaration, its block as written and the spec a generate node carries."""

    decl: ast.EnvDecl
    block: Mapping[str, Entry]
    spec: Mapping[str, Any]  # EnvSpec's fields, plain values (it crosses to workers in a node's attrs)
    max_total: int = 0  # response tokens of a whole trajectory; 0: max_turns x max_tokens

    @property
    def name(self) -> str:
        return self.decl.name.name

    @property
    def kind(self) -> str:
        return self.decl.kind.name


def env_spec(rep: Reporter, src: Source, d: ast.EnvDecl, block: Mapping[str, Entry], values: Mapping[str, Value],
             *, folder: str, imports: Sequence[str], options: Mapping[str, Value]) -> EnvInfo:
    """The spec of `d` from its checked key values (`values`: each key's value or default); reports a stop text
    that is not a string or a list of strings, and a tool without its `call` or `end` marker."""
    kind, name = d.kind.name, d.name.name
    call = ""
    stop: tuple[str, ...] = ()
    if kind == "tool":
        for key in ("call", "end"):
            at = block.get(key)
            if values.get(key) is None and at is None:
                example = '`call = "<calc>", end = "</calc>"`'
                rep.error(src, f"tool `{name}` has no `{key}` marker", d.name,
                          hint=f"a tool's arguments are written between its markers: add {example}")
            elif at is not None and values.get(key) == "":
                rep.error(at.src, f"`{key}` is empty", at.entry.value, hint="a marker is at least one character")
        call, end = str(values.get("call") or ""), str(values.get("end") or "")
        stop = (end,) if end else ()
    else:
        stop = _stop_texts(rep, block.get("stop"), values.get("stop"))
    spec = {
        "name": name, "target": str(d.target.value), "kind": kind, "max_turns": int(str(values["max_turns"])),
        "stop": stop, "workers": int(str(values["workers"])), "timeout": float(str(values["timeout"])),
        "on_error": str(values["on_error"]), "call": call, "imports": tuple(imports), "folder": folder,
        "overlap": bool(values["overlap"]), "options": dict(options),
    }
    return EnvInfo(d, dict(block), spec, int(str(values["max_total"])))


def _stop_texts(rep: Reporter, at: Entry | None, value: Value) -> tuple[str, ...]:
    texts = (value,) if isinstance(value, str) else value if isinstance(value, tuple) else None
    if at is None:
        return ()
    if texts is None or not all(isinstance(t, str) for t in texts):
        rep.error(at.src, "`stop` must be a string or a list of strings", at.entry.value,
                  hint='for example `stop = "</answer>"` or `stop = ["\\n", "."]`')
        return ()
    if any(t == "" for t in texts):
        rep.error(at.src, "`stop` holds an empty string", at.entry.value, hint="a stop text is at least one character")
        return ()
    return tuple(str(t) for t in texts)


def env_bindings(decls: Sequence[ast.EnvDecl], src: Source) -> dict[str, LiteralB]:
    """What an env's name stands for in a step or a `use` (`env = calc`): the string of its name, which
    `generate`'s `env` parameter takes; and `none`, the templates' default (no environment)."""
    out = {d.name.name: LiteralB("env", d.name.name, ast.Name(d.name.name, d.name.span), src) for d in decls}
    out.setdefault("none", LiteralB("env", "", ast.Name("none", ast.Span(1, 1, 1, 2)), src))
    return out


def attach_envs(rep: Reporter, src: Source, nodes: Sequence[Node], envs: Mapping[str, EnvInfo],
                written: Mapping[tuple[str, str], tuple[Source, ast.Located]]) -> list[Node]:
    """Generate nodes with their env's spec in place of its name (an unknown name reported where it was written),
    `max_total`, and `env_at`: where the env is declared (run-time errors name it); a generate without an
    environment keeps no `env` key, so its graph is what it was before environments."""
    src_of = {name: src.loc(info.decl) for name, info in envs.items()}
    out = []
    for n in nodes:
        name = n.attrs.get("env") if n.op == "generate" else None
        if n.op != "generate" or "env" not in n.attrs:
            out.append(n)
            continue
        rest = {k: v for k, v in n.attrs.items() if k != "env"}
        if not name:
            out.append(replace(n, attrs=frozen(rest)))
            continue
        info = envs.get(str(name))
        if info is None:
            wsrc, where = written[(n.id, "env")]
            rep.error(wsrc, f"`env` names `{name}`, which is not a declared env or tool", where,
                      hint=did_you_mean(str(name), envs) or
                      'declare it: `env NAME = "module.Class" { ... }` or `tool NAME = "module.fn" { ... }`')
            out.append(replace(n, attrs=frozen(rest)))
            continue
        out.append(replace(n, attrs=frozen({**rest, "env": dict(info.spec), "max_total": info.max_total,
                                            "env_at": str(src_of[str(name)])})))
    return out

