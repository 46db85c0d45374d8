"""`eval NAME { ... }` declarations -> `flowrl.ir.EvalDecl`s (lowering, `dsl.lower`, once the step's nodes exist).

Every key is resolved here, so the runtime and `flowrl compile` see what will run: `data` must name a declared data
set the step does not train on; `reward` a declared reward (default: the one the step scores with, else the flow's
only one); `model` a policy (default: the one the step generates with, else the one it trains, else the flow's only
policy); `max_tokens` that model's generate's (in a pipeline, from another stage's generate of it when this stage
has none); `every` the run's `checkpoint_every`. Problems are reported located, all at once, with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from flowrl.ir.graph import DataDecl, EvalDecl, ModelDecl, Node, RewardDecl, Value
from flowrl.ir.signatures import TINY_SOURCES
from flowrl.models.sources import hf_positions, tiny_tokenizer

from . import ast
from .diagnostics import Reporter, Source, did_you_mean, unique_named
from .keys import Entry

Block = dict[str, Entry]
BlockFn = Callable[[ast.EvalDecl], Block]  # its entries (and overrides) by key, unknown and repeated keys reported
FilledFn = Callable[[Block], dict[str, Value]]  # each key's checked value, or its default


@dataclass(frozen=True)
class EvalContext:
    """What an `eval` block is resolved against: the flow's declarations, the step's nodes and run settings, and
    (in a pipeline) each policy's generate `max_tokens` found in any stage."""

    models: Sequence[ModelDecl]
    rewards: Sequence[RewardDecl]
    data: Sequence[DataDecl]
    nodes: Sequence[Node]
    run: Mapping[str, Value]
    max_tokens: Mapping[str, int] = field(default_factory=dict)  # model -> a generate's max_tokens elsewhere
    prompts: Mapping[str, Sequence[str]] = field(default_factory=dict)  # data name -> its prompts (after `limit`)


def generate_max_tokens(nodes: Sequence[Node]) -> dict[str, int]:
    """model -> the max_tokens of the first generate of it among `nodes`."""
    out: dict[str, int] = {}
    for n in nodes:
        if n.op == "generate" and n.model is not None and isinstance(n.attrs.get("max_tokens"), int):
            out.setdefault(n.model, int(str(n.attrs["max_tokens"])))
    return out


def eval_model(decl: ast.EvalDecl, ctx: EvalContext) -> str | None:
    """The model an eval block evaluates: its `model`, else the default (None when there is none)."""
    for e in decl.entries:
        if e.key.name == "model" and isinstance(e.value, ast.Name):
            return e.value.name
    return _default_model(ctx)


def _default_model(ctx: EvalContext) -> str | None:
    roles = {m.name: m.role for m in ctx.models}
    for op in ("generate", "update"):
        used = next((n.model for n in ctx.nodes if n.op == op and n.model and roles.get(n.model) == "policy"), None)
        if used is not None:
            return used
    policies = [m.name for m in ctx.models if m.role == "policy"]
    return policies[0] if len(policies) == 1 else None


def _default_reward(ctx: EvalContext) -> str | None:
    by_target = {r.target: r.name for r in ctx.rewards}
    used = next((str(n.attrs.get("fn")) for n in ctx.nodes if n.op == "reward"), None)
    if used is not None and used in by_target:
        return by_target[used]
    return ctx.rewards[0].name if len(ctx.rewards) == 1 else None


def lower_evals(rep: Reporter, src: Source, decls: Sequence[ast.EvalDecl], ctx: EvalContext, block: BlockFn,
                filled: FilledFn) -> list[EvalDecl]:
    """The resolved evaluations; problems reported to `rep` (a block with a problem is left out)."""
    out: list[EvalDecl] = []
    for d in unique_named(rep, src, decls, "eval"):
        resolved = _lower_one(rep, src, d, ctx, block(d), filled)
        if resolved is not None:
            out.append(resolved)
    return out


def _lower_one(rep: Reporter, src: Source, d: ast.EvalDecl, ctx: EvalContext, entries: Block,
               filled: FilledFn) -> EvalDecl | None:
    name = d.name.name
    values = filled(entries)
    ok = True
    data = _named(rep, src, d, entries.get("data"), "data", [x.name for x in ctx.data])
    trained = {n.id for n in ctx.nodes if n.op == "data"}
    if data is None:
        ok = False
        if "data" not in entries:
            rep.error(src, f"eval `{name}` has no `data`", d.name,
                      hint="add `data = NAME`: a data declaration of held-out prompts")
    elif data in trained:
        ok = False
        at = entries["data"]
        rep.error(at.src, f"eval `{name}` evaluates on `{data}`, which the step trains on", at.entry.value,
                  hint="declare the held-out prompts as data of their own (`data held = jsonl(\"...\")`); "
                       "the same file under another name evaluates on training prompts on purpose")
    reward = _named(rep, src, d, entries.get("reward"), "reward", [r.name for r in ctx.rewards])
    if reward is None and "reward" not in entries:
        reward = _default_reward(ctx)
        if reward is None:
            rep.error(src, f"eval `{name}` has no reward to score with", d.name,
                      hint="declare one (`reward correct = \"flowrl.rewards.arith_exact\"`) and name it: "
                           "`reward = correct`")
    ok = ok and reward is not None
    model = _model(rep, src, d, entries, ctx)
    ok = ok and model is not None
    max_tokens = values.get("max_tokens")
    if max_tokens is None and model is not None:
        max_tokens = generate_max_tokens(ctx.nodes).get(model, ctx.max_tokens.get(model))
        if max_tokens is None:
            ok = False
            rep.error(src, f"eval `{name}` needs `max_tokens`: nothing generates with `{model}` to take it from",
                      d.name, hint="add `max_tokens = N` to the eval block")
    if ok and model is not None and data is not None and isinstance(max_tokens, int):
        ok = _fits(rep, src, d, entries.get("max_tokens"), ctx, model, data, max_tokens)
    every = values.get("every")
    if every is None:
        every = ctx.run.get("checkpoint_every", 0)
    if not ok or model is None or data is None or reward is None:
        return None
    return EvalDecl(name=name, data=data, model=model, reward=reward, loc=src.loc(d),
                    n=int(str(values["n"])), temperature=float(str(values["temperature"])),
                    max_tokens=int(str(max_tokens)), every=int(str(every or 0)), at_start=bool(values["at_start"]))


def _named(rep: Reporter, src: Source, d: ast.EvalDecl, at: Entry | None, key: str,
           declared: Sequence[str]) -> str | None:
    """The declaration an entry names (a bare name among `declared`), or None after reporting (None, silently,
    when the entry is absent)."""
    if at is None:
        return None
    value = at.entry.value
    what = {"data": "data set", "reward": "reward", "model": "model"}[key]
    if not isinstance(value, ast.Name):
        example = value.value if isinstance(value, ast.Literal) and isinstance(value.value, str) else "NAME"
        rep.error(at.src, f"`{key}` names a declared {what}", value,
                  hint=f"write `{key} = {example}`, without quotes" if example != "NAME" else
                  f"write `{key} = NAME`")
        return None
    if value.name not in declared:
        rep.error(at.src, f"`{key}` names `{value.name}`, which is not a declared {what}", value,
                  hint=did_you_mean(value.name, declared) or
                  (f"{what}s: {', '.join(declared)}" if declared else f"declare one with `{key} NAME = ...`"))
        return None
    return value.name


def _model(rep: Reporter, src: Source, d: ast.EvalDecl, entries: Block, ctx: EvalContext) -> str | None:
    at = entries.get("model")
    roles = {m.name: m.role for m in ctx.models}
    if at is None:
        model = _default_model(ctx)
        if model is None:
            rep.error(src, f"eval `{d.name.name}` has no policy to evaluate", d.name,
                      hint="name it: `model = NAME` (a policy)")
        return model
    model = _named(rep, src, d, at, "model", list(roles))
    if model is not None and roles[model] != "policy":
        rep.error(at.src, f"`model` must be a policy; `{model}` is a {roles[model]}", at.entry.value,
                  hint="an evaluation generates answers: name the policy")
        return None
    return model


def _fits(rep: Reporter, src: Source, d: ast.EvalDecl, at: Entry | None, ctx: EvalContext, model: str, data: str,
          max_tokens: int) -> bool:
    """The prompts of `data` and `max_tokens` within the model's positions, as a generate's are checked: the prompts
    that are longer are left out of the evaluation (a warning, with their count; verl filters its validation set
    alike), and none fitting is an error. False after an error."""
    decls = {m.name: m for m in ctx.models}
    root = decls[model]
    while root.source_model is not None and root.source_model in decls:
        root = decls[root.source_model]
    lengths: list[int] = []
    if root.source in TINY_SOURCES:
        tok = tiny_tokenizer(root.config)
        context = root.config.get("context")
        lengths = [len(tok.encode(p)) + (tok.bos_id is not None) for p in ctx.prompts.get(data, ())]
    else:  # an hf: checkpoint: its positions from config.json; its tokenizer is not loaded to check
        context, lengths = hf_positions(root.source[3:]), [1]
    longest = max(lengths, default=1)
    if not isinstance(context, int) or longest + max_tokens <= context:
        return True
    where: ast.Located = at.entry.value if at is not None else d.name
    where_src = at.src if at is not None else src
    over = sum(n + max_tokens > context for n in lengths)
    if over < len(lengths):
        rep.warn(where_src, f"eval `{d.name.name}`: `max_tokens = {max_tokens}` leaves the prompts of `{data}` "
                            f"{context - max_tokens} of model `{root.name}`'s {context} positions: {over} of "
                            f"{len(lengths)} prompts are longer (the longest has {longest} tokens with <bos>) and are "
                            "left out of the evaluation", where,
                 hint=f"to keep them, give `{root.name}` more positions (`context = {longest + max_tokens}`) or "
                      "lower `max_tokens`")
        return True
    rep.error(where_src, f"eval `{d.name.name}`: `max_tokens = {max_tokens}` and the longest prompt of `{data}` "
                         f"({longest} tokens) need {longest + max_tokens} positions; model `{root.name}` has {context}",
              where, hint=f"`max_tokens` can be at most {context - longest} here" if context > longest else
              f"the prompts alone fill the positions: give `{root.name}` more (`context = {longest + max_tokens}`)")
    return False
