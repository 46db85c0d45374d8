"""Step bodies -> graph nodes: resolve each name, check each call against its signature, order the DAG.

A `Body` is the statements of a `step { }` (or of a template after its parameters are bound) with the
names they may use. Calls are checked against `flowrl.ir.signatures` (model methods per role, built-in
functions) and `flowrl.registry.FUNCTIONS` (user functions, signature read with `inspect`). Nodes come
out in topological order, ties in statement order; their `worker_group` is filled in later by placement.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from flowrl import registry
from flowrl.errors import Loc
from flowrl.ir.graph import CONTROLLER, ModelDecl, Node, Value, frozen
from flowrl.ir.signatures import (
    DATA_LOSSES,
    FUNCTIONS,
    LOSS_KEYS,
    METHODS,
    REWARD,
    ROLLOUT_LOSSES,
    SCORE,
    WRITTEN_ONLY,
    Param,
    Signature,
)

from . import ast
from .dag import cycle_through, strongly_connected, topological
from .diagnostics import Reporter, Source, did_you_mean, one_of
from .keys import out_of_limit
from .refill import mark_loops
from .shaping import check_overlong
from .values import (
    KIND_NAMES,
    Binding,
    DataB,
    KindError,
    LiteralB,
    ModelB,
    RewardB,
    Unbound,
    coerce,
    describe,
    kind_of,
    literal_text,
    to_value,
)


@dataclass(frozen=True)
class Body:
    """Statements plus what their free names mean; `template` names the template they were expanded from,
    and `origins` says where each template parameter was bound (the `use` argument, or the `use`)."""

    stmts: tuple[ast.Stmt, ...]
    src: Source
    env: Mapping[str, Binding]
    template: str | None = None
    origins: Mapping[str, tuple[Source, ast.Located]] = field(default_factory=dict)
    via: Loc | None = None  # the `use` that expanded a template's body


@dataclass(frozen=True)
class DataSource:
    """What a `data` node needs from its declaration."""

    loc: Loc
    text: str
    attrs: Mapping[str, Value]


@dataclass
class _Pending:
    id: str
    stmt: ast.Stmt
    index: int
    op: str
    model: str | None
    method: str | None
    inputs: list[tuple[str, str]] = field(default_factory=list)
    attrs: dict[str, Value] = field(default_factory=dict)


_ANNOTATION_KINDS = {int: "int", float: "float", bool: "bool", str: "str",
                     "int": "int", "float": "float", "bool": "bool", "str": "str"}
_LITERAL_TYPES = (int, float, str, bool, type(None))


def user_function_signature(name: str, fn: Callable[..., Any]) -> Signature:
    """A `@flowrl.function`: parameters before `*` take nodes, keyword-only ones take (annotated) literals."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C function): no argument can be checked
        return Signature(name, (), op="fn")
    out: list[Param] = []
    for p in params:
        has_default = p.default is not inspect.Parameter.empty
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            out.append(Param(p.name, "node", required=not has_default, positional=True))
        elif p.kind == inspect.Parameter.KEYWORD_ONLY:
            kind = _ANNOTATION_KINDS.get(p.annotation, "any")
            default = p.default if has_default and isinstance(p.default, _LITERAL_TYPES) else None
            out.append(Param(p.name, kind, required=not has_default, default=default))
    return Signature(name, tuple(out), op="fn")


class StepLowering:
    """Lowers one body; `rep` collects the problems. `data` holds every declared data source."""

    def __init__(self, rep: Reporter, data: Mapping[str, DataSource]) -> None:
        self.rep = rep
        self.data = data
        # (node id, parameter) -> where its literal was written: the argument, the `use` argument or template
        # default it came through, or the call itself for a signature default (for checks across nodes)
        self.written: dict[tuple[str, str], tuple[Source, ast.Located]] = {}

    # ---- entry point --------------------------------------------------------------------------

    def lower(self, body: Body) -> list[Node]:
        before = len(self.rep.diagnostics)
        bound = self._collect_bound(body)
        pending: list[_Pending] = []
        used_data: dict[str, int] = {}  # data name -> index of its first consumer
        failed = False
        for i, stmt in enumerate(body.stmts):
            p = self._statement(body, stmt, i, bound)
            failed = failed or p is None
            if p is not None:
                pending.append(p)
                for _, src in p.inputs:
                    if src not in bound:
                        used_data.setdefault(src, i)
        self._check_ids(body, pending, used_data, bound)
        cyclic = self._check_cycles(body, pending, bound)
        if cyclic or failed or len(self.rep.diagnostics) > before:  # (a statement may fail on an Unbound silently)
            return []
        nodes = self._ordered(body, pending, used_data)
        check_overlong(self.rep, nodes, self.written)
        return mark_loops(self.rep, body.src, body.stmts, body.env, nodes, self.written)  # dynamic sampling

    # ---- names ----------------------------------------------------------------------------------

    def _collect_bound(self, body: Body) -> dict[str, int]:
        bound: dict[str, int] = {}
        for i, stmt in enumerate(body.stmts):
            if stmt.target is None:
                continue
            name = stmt.target.name
            if name in bound:
                first = body.stmts[bound[name]]
                self.rep.error(body.src, f"`{name}` is bound twice in one step", stmt.target,
                               hint=f"it is first bound on line {first.line}; each name is bound once "
                                    "(single assignment), so give this one another name")
            elif name in body.env:
                what = (f"a parameter of template `{body.template}`" if body.template
                        else f"already declared ({kind_of(body.env[name])})")
                self.rep.error(body.src, f"cannot bind `{name}`: it is {what}", stmt.target,
                               hint="choose another name")
            else:
                bound[name] = i
        return bound

    def _misuse(self, body: Body, name: ast.Name | ast.Ident, b: Binding, usage: str, message: str,
                hint: str | None = None) -> None:
        """A name used as something it is not. For a template parameter the fault is in what the `use`
        bound to it, so that is where the error points."""
        if isinstance(b, Unbound):
            return
        if body.template is not None and name.name in body.origins:
            src, where = body.origins[name.name]
            shown = "the argument" if isinstance(b, LiteralB) else f"`{getattr(b, 'name', name.name)}`"
            self.rep.error(src, f"template `{body.template}` uses `{name.name}` as {usage}, "
                                f"but {shown} is {kind_of(b)}", where)
            return
        self.rep.error(body.src, message, name, hint=hint)

    def _unknown(self, body: Body, name: ast.Name | ast.Ident, candidates: list[str],
                 extra_hint: str | None = None) -> None:
        hint = did_you_mean(name.name, candidates) or extra_hint
        self.rep.error(body.src, f"unknown name `{name.name}`", name, hint=hint)

    # ---- one statement --------------------------------------------------------------------------

    def _statement(self, body: Body, stmt: ast.Stmt, index: int, bound: dict[str, int]) -> _Pending | None:
        call = stmt.call
        resolved = self._callee(body, call, bound)
        if resolved is None:
            return None
        sig, op, model, method, fn = resolved
        what = call.callee.name + (f".{call.method.name}" if call.method else "")
        if method == "update" and stmt.target is not None:
            self.rep.error(body.src, f"`{what}(...)` is a training step and has no result to bind", stmt.target,
                           hint=f"write `{what}(...)` on its own, without `{stmt.target.name} =`")
            return None
        if method != "update" and stmt.target is None:
            self.rep.error(body.src, f"the result of `{what}(...)` is not bound to a name", call.callee,
                           hint=f"write `NAME = {what}(...)`; only `MODEL.update(...)` stands alone")
            return None
        node_id = stmt.target.name if stmt.target is not None else f"{model}.update"
        p = _Pending(node_id, stmt, index, op, model, method)
        if fn is not None:
            p.attrs["fn"] = fn
        if not self._bind(body, sig, call, what, bound, p):
            return None
        if method == "update" and not self._check_update(body, call, what, bound, p):
            return None
        return p

    def _loss_keys(self, body: Body, call: ast.Call, loss: str, p: _Pending) -> bool:
        """A policy update keeps the keys of its own loss (LOSS_KEYS): another loss's defaults are dropped, and
        another loss's key written is an error."""
        if loss not in LOSS_KEYS:
            return True
        ok = True
        written = {a.key.name: a.key for a in call.args if a.key is not None}
        for other, keys in LOSS_KEYS.items():
            for key in keys if other != loss else ():
                if key in LOSS_KEYS[loss]:
                    continue
                if key in written:
                    self.rep.error(body.src, f"argument `{key}` is not used by loss \"{loss}\"", written[key],
                                   hint=f"remove `{key} = ...`; it belongs to loss \"{other}\"")
                    ok = False
                p.attrs.pop(key, None)
                self.written.pop((p.id, key), None)
        return ok

    def _scale_factor(self, p: _Pending) -> bool:
        """`loss_scale_factor` divides the token sum of agg = "seq-mean-token-sum-norm" only: with another agg it
        would do nothing, so writing it there is an error."""
        factor = int(str(p.attrs.get("loss_scale_factor", 0) or 0))
        agg = str(p.attrs.get("agg"))
        if factor == 0 or agg == "seq-mean-token-sum-norm":
            return True
        src, where = self.written[(p.id, "loss_scale_factor")]
        self.rep.error(src, f"`loss_scale_factor` only divides agg = \"seq-mean-token-sum-norm\", but this "
                            f"update's agg is \"{agg}\"", where,
                       hint="write agg = \"seq-mean-token-sum-norm\" (Dr. GRPO: the token sum over a constant), or "
                            "remove `loss_scale_factor = ...`")
        return False

    def _check_update(self, body: Body, call: ast.Call, what: str, bound: dict[str, int], p: _Pending) -> bool:
        """What an update trains on must suit its loss: ppo_clip and cispo a rollout with `advantages`; sft, dpo
        and bradley_terry a data node of rows (flowrl.runtime.preference_update); dpo (but simpo) its reference's
        log-probs. False after reporting every problem."""
        loss = str(p.attrs.get("loss"))
        inputs = dict(p.inputs)
        src = inputs.get("rollout")
        first = next((a for a in call.args if a.key is None or a.key.name == "rollout"), None)
        where: ast.Located = first.value if first is not None else call.callee
        ok = True
        if loss in ROLLOUT_LOSSES:
            if "advantages" not in inputs:
                self.rep.error(body.src, f"missing required argument `advantages` of `{what}`", call.callee,
                               hint="add `advantages = NAME`")
                ok = False
            if src is not None and src not in bound:
                self.rep.error(body.src, f"loss \"{loss}\" trains on a rollout, but `{src}` is a data node", where,
                               hint=f"generate one first: `rollout = MODEL.generate({src}, ...)`; to train on its "
                                    "rows write loss = \"sft\" (demonstrations) or \"dpo\" (preference pairs)")
                ok = False
            return self._loss_keys(body, call, loss, p) and self._scale_factor(p) and ok
        if loss not in DATA_LOSSES:
            return ok
        if src is not None and src in bound:
            self.rep.error(body.src, f"loss \"{loss}\" trains on a data node of rows, but `{src}` is computed in "
                                     "the step", where,
                           hint="pass a `data` declaration: rows of prompt/chosen/rejected (dpo, bradley_terry) or "
                                "prompt/response (sft)")
            ok = False
        ok = self._loss_keys(body, call, loss, p) and ok
        for extra in ("advantages", "old_logp"):
            if extra in inputs:
                key = next(a.key for a in call.args if a.key is not None and a.key.name == extra)
                self.rep.error(body.src, f"argument `{extra}` is not used by loss \"{loss}\"", key,
                               hint=f"remove `{extra} = ...`; it belongs to loss \"ppo_clip\"")
                ok = False
        if loss == "dpo" and p.attrs.get("dpo") != "simpo" and "ref_logp" not in inputs:
            self.rep.error(body.src, f"missing argument `ref_logp` of `{what}`: loss \"dpo\" compares the policy "
                                     "with its reference", call.callee,
                           hint=f"add `ref_logp = NAME` with `NAME = REF.logprobs({src or 'pairs'})`, or write "
                                "dpo = \"simpo\" (no reference)")
            ok = False
        return ok

    def _callee(self, body: Body, call: ast.Call, bound: dict[str, int]
                ) -> tuple[Signature, str, str | None, str | None, str | None] | None:
        """(signature, op, model, method, fn) for a call, or None after reporting why it is wrong."""
        name = call.callee.name
        b = body.env.get(name)
        if call.method is not None:
            method = call.method.name
            if isinstance(b, Unbound):
                return None
            if isinstance(b, ModelB):
                if b.role is None:  # its declaration already failed; don't pile on
                    return None
                methods = METHODS[b.role]
                sig = methods.get(method)
                if sig is None:
                    hint = did_you_mean(method, methods) or f"a {b.role} model has {one_of(methods)}"
                    self.rep.error(body.src, f"model `{name}` ({b.role}) has no method `{method}`", call.method,
                                   hint=hint)
                    return None
                if method == "update" and not b.trainable:
                    self.rep.error(body.src, f"model `{name}` is not trainable", call.method,
                                   hint=f"set `trainable = true` in the declaration of `{b.name}`")
                    return None
                return sig, sig.op, b.name, method, None
            if b is not None:
                self._misuse(body, call.callee, b, "a model",
                             f"`{name}.{method}(...)` needs a model, but `{name}` is {kind_of(b)}")
                return None
            if name in bound:
                self.rep.error(body.src, f"`{name}.{method}(...)` needs a model, but `{name}` is a value "
                                         "computed in the step", call.callee)
                return None
            models = [n for n, x in body.env.items() if isinstance(x, ModelB)]
            self._unknown(body, call.callee, models)
            return None
        if isinstance(b, RewardB):
            return REWARD, REWARD.op, None, None, b.target
        if isinstance(b, ModelB):
            if b.role == "reward_model":
                return SCORE, SCORE.op, b.name, "score", None
            if b.role is not None:
                example = next(iter(METHODS[b.role]))
                self._misuse(body, call.callee, b, "a function", f"`{name}` is a model; call one of its methods",
                             hint=f"for example `{name}.{example}(...)`")
            return None
        if b is not None:
            self._misuse(body, call.callee, b, "a function", f"`{name}` is {kind_of(b)}, not a function")
            return None
        if name in bound:
            self.rep.error(body.src, f"`{name}` is a value computed in the step, not a function", call.callee)
            return None
        if name in FUNCTIONS:
            return FUNCTIONS[name], "fn", None, None, name
        if name in registry.FUNCTIONS:
            return user_function_signature(name, registry.FUNCTIONS[name]), "fn", None, None, name
        callables = [*FUNCTIONS, *registry.FUNCTIONS,
                     *(n for n, x in body.env.items() if isinstance(x, RewardB)
                       or (isinstance(x, ModelB) and x.role == "reward_model"))]
        self._unknown(body, call.callee, callables,
                      extra_hint=f"functions: {', '.join(sorted(set(FUNCTIONS) | set(registry.FUNCTIONS)))}; "
                                 "a Python function needs `@flowrl.function` and `import \"its.module\"`")
        return None

    # ---- arguments ------------------------------------------------------------------------------

    def _bind(self, body: Body, sig: Signature, call: ast.Call, what: str, bound: dict[str, int],
              p: _Pending) -> bool:
        ok = True
        given: dict[str, ast.Arg] = {}
        positional = sig.positional
        seen_keyword, n_pos = False, 0
        stray = True  # False once a positional argument was dropped: it was meant for some parameter
        for arg in call.args:
            if arg.key is None:
                if seen_keyword:
                    self.rep.error(body.src, "positional argument after keyword arguments", arg,
                                   hint="write positional arguments first, or name this one: `PARAM = ...`")
                    ok = stray = False
                    continue
                if n_pos >= len(positional):
                    takes = one_of(q.name for q in positional) if positional else "none"
                    self.rep.error(body.src, f"too many positional arguments for `{what}`", arg,
                                   hint=f"its positional parameters: {takes}; pass the rest as `NAME = VALUE`")
                    ok = False
                    continue
                param = positional[n_pos]
                n_pos += 1
            else:
                seen_keyword = True
                found = sig.param(arg.key.name)
                if found is None:
                    names = [q.name for q in sig.params]
                    hint = did_you_mean(arg.key.name, names) or f"`{what}` takes {one_of(names)}"
                    self.rep.error(body.src, f"unknown argument `{arg.key.name}` for `{what}`", arg.key, hint=hint)
                    ok = False
                    continue
                param = found
            if param.name in given:
                self.rep.error(body.src, f"argument `{param.name}` of `{what}` is given twice", arg)
                ok = False
                continue
            given[param.name] = arg
        for param in sig.params:
            found_arg = given.get(param.name)
            if found_arg is None:
                if param.required and stray:
                    placeholder = "NAME" if param.kind == "node" else "VALUE"
                    self.rep.error(body.src, f"missing required argument `{param.name}` of `{what}`", call.callee,
                                   hint=f"add `{param.name} = {placeholder}`")
                    ok = False
                elif param.kind != "node" and param.name not in WRITTEN_ONLY:
                    p.attrs[param.name] = param.default
                    self.written[(p.id, param.name)] = (body.src, call.callee)
                continue
            if param.kind == "node":
                node = self._node_arg(body, param, found_arg.value, what, bound)
                if node is None:
                    ok = False
                else:
                    p.inputs.append((param.name, node))
            else:
                good, value = self._literal_arg(body, param, found_arg.value, what, bound)
                if good:
                    p.attrs[param.name] = value
                    self.written[(p.id, param.name)] = self._origin(body, found_arg.value)
                else:
                    ok = False
        return ok

    def _node_arg(self, body: Body, param: Param, expr: ast.Expr, what: str, bound: dict[str, int]) -> str | None:
        if not isinstance(expr, ast.Name):
            self.rep.error(body.src, f"argument `{param.name}` of `{what}` needs a name bound in the step, "
                                     f"got {describe(to_value(expr))}", expr)
            return None
        if expr.name in bound:
            return expr.name
        b = body.env.get(expr.name)
        if isinstance(b, DataB):
            return b.name
        if b is None:
            self._unknown(body, expr, [*bound, *(n for n, x in body.env.items() if isinstance(x, DataB))])
            return None
        if isinstance(b, Unbound):
            return None
        hint = None
        if isinstance(b, RewardB):
            hint = f"call it first: `scores = {expr.name}(rollout)`, then pass `scores`"
        elif isinstance(b, ModelB) and b.role:
            hint = f"call one of its methods first, e.g. `x = {expr.name}.{next(iter(METHODS[b.role]))}(...)`"
        self._misuse(body, expr, b, "a step value", f"argument `{param.name}` of `{what}` needs a name bound "
                                                     f"in the step, but `{expr.name}` is {kind_of(b)}", hint=hint)
        return None

    def _literal_arg(self, body: Body, param: Param, expr: ast.Expr, what: str, bound: dict[str, int]) -> tuple[bool, Value]:
        """(True, the checked value), or (False, None) after reporting the problem."""
        src, where, owner, pname = body.src, expr, f"`{what}`", param.name
        if isinstance(expr, ast.Name):
            b = body.env.get(expr.name)
            if expr.name in bound:
                self.rep.error(src, f"argument `{param.name}` of `{what}` takes {KIND_NAMES[param.kind]}, "
                                    f"not a value computed in the step", expr)
                return False, None
            if isinstance(b, LiteralB):
                value: Value = b.value
                src, where, owner, pname = b.src, b.expr, f"template `{body.template}`", b.param
            elif b is None:
                hint = did_you_mean(expr.name, [n for n, x in body.env.items() if isinstance(x, LiteralB)])
                if hint is None and param.kind == "str":
                    hint = f"write the string `{param.name} = \"{expr.name}\"`"
                self.rep.error(src, f"unknown name `{expr.name}`", expr, hint=hint)
                return False, None
            else:
                self._misuse(body, expr, b, KIND_NAMES[param.kind], f"argument `{param.name}` of `{what}` takes "
                                                                   f"{KIND_NAMES[param.kind]}, but `{expr.name}` "
                                                                   f"is {kind_of(b)}")
                return False, None
        else:
            value = to_value(expr)
        try:
            value = coerce(param.kind, value)
        except KindError as e:
            hint = f"write `{pname} = {e.suggestion}`" if e.suggestion else None
            self.rep.error(src, f"argument `{pname}` of {owner} must be {KIND_NAMES[param.kind]}, "
                                f"got {describe(value)}", where, hint=hint)
            return False, None
        if param.choices and value not in param.choices:
            hint = did_you_mean(str(value), param.choices)
            self.rep.error(src, f"argument `{pname}` of {owner} must be one of "
                                f"{', '.join(literal_text(c) for c in param.choices)}, got {describe(value)}",
                           where, hint=hint)
            return False, None
        if param.limit is not None and value is not None and out_of_limit(param.limit, value):
            self.rep.error(src, f"argument `{pname}` of {owner} must be {param.limit}, got {describe(value)}", where,
                           hint=param.limit.why)
            return False, None
        return True, value

    @staticmethod
    def _origin(body: Body, expr: ast.Expr) -> tuple[Source, ast.Located]:
        """Where the literal an argument stands for was written (through a template parameter, if it is one)."""
        b = body.env.get(expr.name) if isinstance(expr, ast.Name) else None
        return (b.src, b.expr) if isinstance(b, LiteralB) else (body.src, expr)

    # ---- the graph ------------------------------------------------------------------------------

    def _check_ids(self, body: Body, pending: list[_Pending], used_data: dict[str, int],
                   bound: dict[str, int]) -> None:
        seen: dict[str, _Pending] = {}
        for p in pending:
            if p.id in seen and p.stmt.target is None:  # a bound name used twice is reported already
                self.rep.error(body.src, f"`{p.id}` appears twice in one step", p.stmt.call,
                               hint=f"a model is updated once per step (first on line {seen[p.id].stmt.line})")
            seen[p.id] = p
        for name in used_data:
            if name in bound and name in seen and seen[name].stmt.target is not None:
                target = seen[name].stmt.target
                assert target is not None
                self.rep.error(body.src, f"`{name}` is bound here and also names the data passed in", target,
                               hint=f"rename the data declaration `{name}`")

    def _check_cycles(self, body: Body, pending: list[_Pending], bound: dict[str, int]) -> bool:
        """Report each cycle once ("cycle: a -> b -> a"); True when there was one."""
        by_id = {p.id: p for p in pending}
        deps = {p.id: [s for _, s in p.inputs if s in by_id and s in bound] for p in pending}
        found = False
        for scc in strongly_connected(deps):
            start = min(scc, key=lambda n: by_id[n].index)
            if len(scc) == 1 and start not in deps[start]:
                continue
            path = cycle_through(start, deps, set(scc))
            first = by_id[start].stmt
            self.rep.error(body.src, "cycle: " + " -> ".join(path), first.target or first.call,
                           hint="each name must be computed from names computed before it; break the loop")
            found = True
        return found

    def _ordered(self, body: Body, pending: list[_Pending], used_data: dict[str, int]) -> list[Node]:
        nodes: dict[str, Node] = {}
        key: dict[str, tuple[int, int]] = {}
        deps: dict[str, list[str]] = {}
        for name, first in used_data.items():
            source = self.data[name]
            nodes[name] = Node(name, "data", source.loc, attrs=frozen(source.attrs), text=source.text)
            key[name], deps[name] = (first, 0), []
        for p in pending:
            nodes[p.id] = Node(
                p.id, p.op, body.src.loc(p.stmt), model=p.model, method=p.method, inputs=tuple(p.inputs),
                attrs=frozen(p.attrs), worker_group=CONTROLLER, dispatch="split" if p.model else "controller",
                text=body.src.text_of(p.stmt), via=body.via,
            )
            key[p.id], deps[p.id] = (p.index, 1), [s for _, s in p.inputs]
        return [nodes[n] for n in topological(deps, key)]


def may_train(decl: ModelDecl, block: Mapping[str, object]) -> bool:
    """Whether a step may update `decl`: a trainable model, or a reward model whose `trainable` is not written
    (it becomes trainable when a step updates it, `trainable_when_updated`)."""
    return decl.trainable or (decl.role == "reward_model" and "trainable" not in block)


def trainable_when_updated(models: list[ModelDecl], nodes: list[Node]) -> list[ModelDecl]:
    """The declarations with each reward model a step updates made trainable (so it gets an optimizer)."""
    updated = {n.model for n in nodes if n.op == "update"}
    return [replace(m, trainable=True) if m.role == "reward_model" and m.name in updated else m for m in models]
