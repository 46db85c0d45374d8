"""`env` and `tool` declarations during lowering (`dsl.lower`): their blocks -> `flowrl.envs.EnvSpec`'s fields (the
class or tool function loaded and checked with `flowrl.envs.load`), the names a step uses for them, and a generate
node's `env` argument -> the spec it carries.

A generate node that runs an environment carries the whole spec in its attrs (`attrs["env"]`, a plain dict of
EnvSpec's fields, with the flow's folder and imports), so every backend's worker gets it with the node and
builds its pool from it; `attrs["max_total"]` caps a trajectory's response tokens (0: the model's positions), `attrs["env_at"]` says
where the env is declared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowrl.ir.graph import Node, Value, frozen
from flowrl.ir.signatures import ENV_KEYS, TOOL_KEYS

from . import ast
from .diagnostics import Reporter, Source, did_you_mean
from .keys import Entry
from .values import LiteralB, to_value

# How lowering reads a block (dsl.lower: its entries by key, checked, unknown keys reported) and fills it (each
# key's checked value or its default).
# (the block's entries, its `--set` override entries, keys, what): the entries by key, overrides winning
BlockOf = Callable[[Sequence[ast.Entry], Sequence[ast.Entry], Mapping[str, tuple[str, Value]], str], dict[str, Entry]]
Filled = Callable[[dict[str, Entry], Mapping[str, tuple[str, Value]], str], dict[str, Value]]


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
        "overlap": bool(values["overlap"]), "decode_batch": int(str(values["decode_batch"])), "options": dict(options),
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


def lower_envs(rep: Reporter, src: Source, decls: Sequence[ast.EnvDecl], imports: Sequence[str], folder: str,
               block_of: BlockOf, filled: Filled, overrides: Mapping[str, Sequence[ast.Entry]] | None = None,
               overrides_src: Source | None = None) -> dict[str, EnvInfo]:
    """Each `env`/`tool` declaration's spec (keys checked against ENV_KEYS / TOOL_KEYS, their limits and
    choices; an env's other keys are its class's options); the class or function is imported by the checks
    (`check_env_class`), with the flow's folder. `overrides`: `--set NAME.KEY=VALUE` entries by env name, written
    in `overrides_src` (they win over the block's own, class options included)."""
    out: dict[str, EnvInfo] = {}
    for d in decls:
        if d.name.name in out:
            continue
        kind = d.kind.name
        keys = TOOL_KEYS if kind == "tool" else ENV_KEYS
        extra = list((overrides or {}).get(d.name.name, ()))
        # an env's other keys go to its class's constructor (EnvSpec.options) when it takes them; any other
        # unknown key is reported with its did-you-mean, as in every other block
        takes = env_class_keywords(d.name.name, str(d.target.value), folder, imports) \
            if kind == "env" and any(e.key.name not in keys for e in [*d.entries, *extra]) else set()
        own = [e for e in d.entries if e.key.name in keys]
        before = len(rep.diagnostics)
        cls = str(d.target.value).rsplit(".", 1)[-1]
        written = [(e, src) for e in d.entries] + [(e, overrides_src or src) for e in extra]
        for e, at in written:
            if e.key.name not in keys and takes is not None and e.key.name not in takes:
                also = "" if kind == "tool" else \
                    f"; {cls} takes {', '.join(sorted(takes))}" if takes else f"; {cls} takes no keyword"
                rep.error(at, f"unknown {kind} key `{e.key.name}`", e.key,
                               hint=did_you_mean(e.key.name, [*keys, *takes]) or f"{kind} keys: {', '.join(keys)}{also}")
        options = {e.key.name: to_value(e.value) for e, _ in written
                   if e.key.name not in keys and (takes is None or e.key.name in takes)}
        block = block_of(own, [e for e in extra if e.key.name in keys], keys, kind)
        values = filled(block, keys, kind)
        out[d.name.name] = env_spec(rep, src, d, block, values, folder=folder, imports=imports,
                                    options=options)
        if len(rep.diagnostics) == before:  # a block that is right so far: does its class fit it?
            check_env_class(rep, src, out[d.name.name])
    return out


def check_env_class(rep: Reporter, src: Source, info: EnvInfo) -> None:
    """The env's class (or the tool's function) imports and has what it needs (`flowrl.envs.load`), reported on
    the declaration's target string."""
    from flowrl.envs import EnvSpec
    from flowrl.envs.load import EnvLoadError, load_env_class

    try:
        load_env_class(EnvSpec(**info.spec))
    except EnvLoadError as e:
        rep.error(src, e.problem, info.decl.target, hint=e.diagnostics[0].hint)


def env_class_keywords(name: str, target: str, folder: str, imports: Sequence[str]) -> set[str] | None:
    """The keywords an env class's constructor takes (an env block's keys beyond its own are passed to it); None
    when it takes any (`**options`) or cannot be loaded (`check_env_class` reports that)."""
    import inspect

    from flowrl.envs import EnvSpec
    from flowrl.envs.load import EnvLoadError, load_env_class

    try:
        cls = load_env_class(EnvSpec(name=name, target=target, kind="env", folder=folder, imports=tuple(imports)))
        params = inspect.signature(cls).parameters.values()
    except (EnvLoadError, TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
