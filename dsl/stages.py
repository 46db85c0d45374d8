"""A flow with `stage NAME { ... }` blocks -> a `Pipeline` of graphs, one per stage (the front end's staged path).

Each stage is lowered by `dsl.lower` as a flow of its own: the file's declarations (models, data, rewards,
imports, templates, environments), the stage's `use` or `step`, the file-level `run { }` with the stage's own
entries merged over it, and the stage's `placement { }` (else the file's, less the models the stage leaves out).
`eval` blocks: a top-level one evaluates in every stage whose step uses its model (a stage that trains only a
reward model is skipped: the policy is as it was), a stage's own in that stage (in place of a top-level one of
the same name); an eval in a stage that generates nothing takes `max_tokens` from another stage's generate.
A stage's graph holds only the models its step uses, plus the models their `source`s need to be built: it is
lowered once with every model to learn which those are, then again with just them.

Overrides: `stage.NAME.KEY=V` sets run key KEY of stage NAME (`stage.NAME.use.PARAM=V` a template argument of its
`use`); the plain keys (`run.KEY`, `MODEL.KEY`, `DATA.KEY`, `use.PARAM`) apply to every stage (a `use.PARAM` to every
stage with a `use`), the stage's own keys over them.

Semantics across stages (carried out by `flowrl.runtime.pipeline`): a model keeps its weights from the end of the last
stage that had it; a model first used in a stage with `source = other` starts from `other`'s weights at the start of
that stage; optimizer state does not carry over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flowrl.errors import Diagnostic, FlowError, Loc
from flowrl.ir.graph import Graph, ModelDecl
from flowrl.ir.verify import verify
from flowrl.models.sources import hf_score_head, hf_source_problem

from . import ast
from .diagnostics import Reporter, Source, did_you_mean, unique_named
from .evals import EvalContext, eval_model, generate_max_tokens
from .lower import lower
from .overrides import OVERRIDES_PATH

UNTRAINED_HINT = "train it in an earlier stage, or give it a checkpoint source"


@dataclass(frozen=True)
class Stage:
    """One stage: its name, its graph (whose `run` holds the stage's merged run settings) and where it is declared."""

    name: str
    graph: Graph
    loc: Loc

    @property
    def run(self) -> Mapping[str, Any]:
        return self.graph.run

    @property
    def steps(self) -> int:
        return int(str(self.graph.run.get("steps", 100)))


@dataclass(frozen=True)
class Pipeline:
    """A staged flow, compiled: its stages in the order they run."""

    flow: str
    path: str
    stages: tuple[Stage, ...]
    warnings: tuple[Diagnostic, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise FlowError(Diagnostic(f"no stage named `{name}` in {self.path}",
                                   hint=did_you_mean(name, self.names) or f"stages: {', '.join(self.names)}"))


def has_stages(module: ast.Module) -> bool:
    return any(isinstance(d, ast.StageDecl) for d in module.decls)


def lower_pipeline(module: ast.Module, overrides: Mapping[str, str] | None = None) -> Pipeline:
    """Lower every stage of a staged flow (verified graphs); raises FlowError with every problem of the file."""
    src = Source(module.path, module.text)
    rep = Reporter()
    stages = _stages(module, src, rep)
    per_stage = _split_overrides(overrides or {}, stages, rep)
    rep.check(module.path)
    names = _eval_names(module)
    wholes = {d.name.name: _lower_whole(module, d, per_stage[d.name.name], rep, names) for d in stages}
    generated: dict[str, int] = {}  # each policy's generate max_tokens in any stage: an eval's default elsewhere
    for whole in wholes.values():
        for model, tokens in generate_max_tokens(whole.nodes if whole is not None else ()).items():
            generated.setdefault(model, tokens)
    out: list[Stage] = []
    for decl in stages:
        whole = wholes[decl.name.name]
        graph = None if whole is None else _lower_stage(module, decl, whole, per_stage[decl.name.name], rep,
                                                        generated, names)
        if graph is not None:
            out.append(Stage(decl.name.name, graph, src.loc(decl.name)))
    if not rep.diagnostics:
        check_reward_models(rep, src, out)
    rep.check(module.path)
    warnings: list[Diagnostic] = []
    for s in out:
        warnings.extend(w for w in s.graph.warnings if w not in warnings)
    return Pipeline(out[0].graph.flow, module.path, tuple(out), tuple(warnings))


# ---- the stage blocks -------------------------------------------------------------------------------


def _stages(module: ast.Module, src: Source, rep: Reporter) -> list[ast.StageDecl]:
    """The stage declarations, after reporting what is wrong with them as a set."""
    stages = [d for d in module.decls if isinstance(d, ast.StageDecl)]
    for top in (d for d in module.decls if isinstance(d, (ast.UseDecl, ast.StepDecl))):
        word = "use" if isinstance(top, ast.UseDecl) else "step"
        rep.error(src, f"a flow has either stages or a top-level `{word}`, not both", top,
                  hint=f"move it into a stage (`stage NAME {{ {word} ... }}`), or remove the stages")
    for extra in [d for d in module.decls if isinstance(d, ast.RunDecl)][1:]:
        rep.error(src, "a flow has at most one `run` block", extra,
                  hint="merge the two; a stage's own settings go in its `run { }`")
    named = unique_named(rep, src, stages, "stage")
    for s in named:
        name = s.name.name
        iterations = [i for i in s.items if isinstance(i, (ast.UseDecl, ast.StepDecl))]
        if not iterations:
            rep.error(src, f"stage `{name}` has no `use` or `step`", s.name,
                      hint="add `use TEMPLATE(...)` or a `step { ... }` block inside its `{ }`")
        for again in iterations[1:]:
            rep.error(src, "a stage has exactly one `use` or `step`", again,
                      hint=f"the first is on line {iterations[0].line}; put the other in a stage of its own")
        for kind, word in ((ast.RunDecl, "run"), (ast.PlacementDecl, "placement")):
            blocks: list[ast.StageItem] = [i for i in s.items if isinstance(i, kind)]
            for more in blocks[1:]:
                rep.error(src, f"a stage has at most one `{word}` block", more,
                          hint=f"merge it into the one on line {blocks[0].line}")
    return named


def _split_overrides(overrides: Mapping[str, str], stages: Sequence[ast.StageDecl],
                     rep: Reporter) -> dict[str, dict[str, str]]:
    """Each stage's overrides as `dsl.lower` takes them: the plain keys, then the stage's own keys translated
    (`stage.NAME.KEY` -> `run.KEY`, `stage.NAME.use.PARAM` -> `use.PARAM`), which win over plain ones."""
    names = [s.name.name for s in stages]
    has_use = {s.name.name: any(isinstance(i, ast.UseDecl) for i in s.items) for s in stages}
    src = Source(OVERRIDES_PATH, "\n".join(f"{k}={v}" for k, v in overrides.items()))
    plain = {k: v for k, v in overrides.items() if not k.startswith("stage.")}
    out = {n: {k: v for k, v in plain.items() if not k.startswith("use.") or has_use[n]} for n in names}
    for line, (key, value) in enumerate(overrides.items(), start=1):
        if key.startswith("use.") and not any(has_use.values()):
            rep.error(src, f"override `{key}`: no stage of this flow has a `use`", ast.Span(line, 1, line, len(key) + 1),
                      hint="`use.PARAM` overrides a template argument")
        if not key.startswith("stage."):
            continue
        parts = key.split(".")
        stage = parts[1] if len(parts) > 1 else ""
        if len(parts) < 3 or not all(parts):
            rep.error(src, f"override `{key}` must be stage.NAME.KEY (a run key) or stage.NAME.use.PARAM",
                      ast.Span(line, 1, line, len(key) + 1), hint="for example `stage.sft.steps=10`")
            continue
        if stage not in out:
            rep.error(src, f"override `{key}`: no stage named `{stage}`", ast.Span(line, 7, line, 7 + len(stage)),
                      hint=did_you_mean(stage, names) or f"stages: {', '.join(names)}")
            continue
        rest = parts[2:]
        if len(rest) == 1:
            out[stage][f"run.{rest[0]}"] = value
        elif len(rest) == 2 and rest[0] in ("run", "use"):
            out[stage][".".join(rest)] = value
        else:
            rep.error(src, f"override `{key}` must be stage.NAME.KEY (a run key) or stage.NAME.use.PARAM",
                      ast.Span(line, 1, line, len(key) + 1), hint=f"for example `stage.{stage}.steps=10`")
    return out


# ---- one stage ----------------------------------------------------------------------------------------


def _eval_names(module: ast.Module) -> list[str]:
    """Every `eval` block's name, top-level and in stages."""
    stages = [i for d in module.decls if isinstance(d, ast.StageDecl) for i in d.items]
    return list(dict.fromkeys(e.name.name for e in [*module.decls, *stages] if isinstance(e, ast.EvalDecl)))


def _lower_whole(module: ast.Module, stage: ast.StageDecl, overrides: Mapping[str, str],
                 rep: Reporter, evals: Sequence[str]) -> Graph | None:
    """The stage lowered with every model and no `eval` (what it uses); None after adding its problems to `rep`."""
    try:
        return lower(_stage_module(module, stage, None, ()), overrides, evals=evals)
    except FlowError as e:
        rep.extend(e.diagnostics)  # the same problem found in several stages is reported once
        return None


def _lower_stage(module: ast.Module, stage: ast.StageDecl, whole: Graph, overrides: Mapping[str, str],
                 rep: Reporter, generated: Mapping[str, int], evals: Sequence[str]) -> Graph | None:
    """The stage's graph with only the models it needs and its evaluations; None after adding its problems to
    `rep`. A top-level `eval` applies to the stages whose step uses its model (a stage training only a reward
    model leaves the policy as it was); a stage's own `eval` blocks apply to it, one of the same name in its place."""
    own = _stage_evals(module, stage, whole)
    keep = _needed(whole) | {m for e in own if (m := _named_model(e)) in {d.name for d in whole.models}}
    dropped = {m.name for m in whole.models} - keep
    kept_overrides = {k: v for k, v in overrides.items() if k.split(".", 1)[0] not in dropped}
    try:
        return verify(lower(_stage_module(module, stage, keep, own), kept_overrides, generated=generated, evals=evals))
    except FlowError as e:
        rep.extend(e.diagnostics)
        return None


def _stage_evals(module: ast.Module, stage: ast.StageDecl, whole: Graph) -> list[ast.EvalDecl]:
    own = [i for i in stage.items if isinstance(i, ast.EvalDecl)]
    mine = {e.name.name for e in own}
    ctx = EvalContext(whole.models, whole.rewards, whole.data, whole.nodes, whole.run)
    used = {n.model for n in whole.nodes if n.model}
    shared = [d for d in module.decls if isinstance(d, ast.EvalDecl) and d.name.name not in mine
              and eval_model(d, ctx) in used]
    return [*shared, *own]


def _named_model(decl: ast.EvalDecl) -> str | None:
    return next((e.value.name for e in decl.entries if e.key.name == "model" and isinstance(e.value, ast.Name)),
                None)


def _needed(graph: Graph) -> set[str]:
    """The models the nodes use, plus the chain of `source` models each is built from."""
    decls = {m.name: m for m in graph.models}
    keep: set[str] = set()
    todo = [n.model for n in graph.nodes if n.model]
    while todo:
        name = todo.pop()
        if name in keep or name not in decls:
            continue
        keep.add(name)
        if decls[name].source_model is not None:
            todo.append(str(decls[name].source_model))
    return keep


def _stage_module(module: ast.Module, stage: ast.StageDecl, keep: set[str] | None,
                  evals: Sequence[ast.EvalDecl]) -> ast.Module:
    """The flow one stage is: shared declarations (models limited to `keep` unless None), the stage's parts and
    the `eval` blocks that apply to it."""
    own = [d for d in module.decls if isinstance(d, (ast.FlowDecl, ast.ImportDecl, ast.RewardDecl, ast.DataDecl,
                                                      ast.TemplateDecl, ast.EnvDecl))]
    models = [d for d in module.decls if isinstance(d, ast.ModelDecl) and (keep is None or d.name.name in keep)]
    iteration = [i for i in stage.items if isinstance(i, (ast.UseDecl, ast.StepDecl))][:1]
    decls: list[ast.Decl] = [*own, *models, *iteration, *evals]
    run = _merged_run(module, stage)
    if run is not None:
        decls.append(run)
    placement = next((i for i in stage.items if isinstance(i, ast.PlacementDecl)), None)
    if placement is None:
        placement = next((d for d in module.decls if isinstance(d, ast.PlacementDecl)), None)
        if placement is not None and keep is not None:
            placement = _placement_for(placement, keep)
    if placement is not None:
        decls.append(placement)
    return ast.Module(module.path, module.text, tuple(sorted(decls, key=lambda d: (d.line, d.col))))


def _merged_run(module: ast.Module, stage: ast.StageDecl) -> ast.RunDecl | None:
    """The file's `run { }` with the stage's entries over it (a key the stage sets replaces the file's)."""
    top = next((d for d in module.decls if isinstance(d, ast.RunDecl)), None)
    own = next((i for i in stage.items if isinstance(i, ast.RunDecl)), None)
    if own is None:
        return top
    if top is None:
        return own
    mine = {e.key.name for e in own.entries}
    return ast.RunDecl((*(e for e in top.entries if e.key.name not in mine), *own.entries), own.span)


def _placement_for(decl: ast.PlacementDecl, keep: set[str]) -> ast.PlacementDecl:
    """The file's placement less the pins of models the stage leaves out."""
    assigns = []
    for a in decl.assigns:
        targets = tuple(t for t in a.targets if t.model.name in keep)
        if targets:
            assigns.append(ast.Assign(targets, a.pool, a.span))
    return ast.PlacementDecl(decl.pools, tuple(assigns), decl.span)


# ---- checks across stages ------------------------------------------------------------------------------


def check_reward_models(rep: Reporter, src: Source, stages: Sequence[Stage]) -> None:
    """A reward model that scores rollouts before any earlier stage trained it must start from a reward model's
    checkpoint: with a `tiny:` source, another model's weights or a causal LM's checkpoint (a fresh value head) its
    scores are noise."""
    trained: set[str] = set()
    for s in stages:
        decls = {m.name: m for m in s.graph.models}
        for node in s.graph.nodes:
            m = decls.get(node.model or "")
            if m is None or m.role != "reward_model" or node.method != "score" or m.name in trained:
                continue
            origin = _untrained(m)
            if origin is None:
                continue
            loc = node.via or node.loc
            line = src.line(loc.line) if loc.path == src.path else None
            diag = Diagnostic(f"reward model `{m.name}` scores rollouts in stage `{s.name}`, but no earlier stage "
                              f"trains it and {origin}", loc, hint=UNTRAINED_HINT, source_line=line)
            rep.add(diag)
        trained.update(n.model for n in s.graph.nodes if n.model and n.method == "update")


def _untrained(m: ModelDecl) -> str | None:
    """Why `m` would score with an untrained value head, or None (a reward model's checkpoint)."""
    if m.source_model is not None:
        return f"its weights are `{m.source_model}`'s with a new value head"
    if m.source.startswith("tiny:"):
        return f"its source \"{m.source}\" has random weights"
    path = m.source.removeprefix("hf:")
    if hf_source_problem(path) is None and not hf_score_head(path):  # a causal LM's checkpoint: its head is new
        return (f"its checkpoint \"{path}\" is not a reward model's (a one-label ...ForSequenceClassification): "
                "it gets a new value head")
    return None
