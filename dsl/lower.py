"""AST -> `flowrl.ir.Graph`: the second stage of the front end, after `dsl.parser`.

Checks the declarations (models, rewards, data, run, imports; Python references and data files are
resolved now, not mid-run), expands the `use`d template or takes the `step`, lowers it with
`dsl.steps`, places it with `dsl.placement`, and raises one FlowError holding every problem in the file.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import flowrl.rewards  # noqa: F401  (registers the shipped rewards by name)
from flowrl import registry
from flowrl.data.jsonl import held_out_problem
from flowrl.data.tables import DATA_KINDS, prompt_plain, read_data
from flowrl.errors import DataError
from flowrl.ir.graph import ROLES, DataDecl, Graph, ModelDecl, Range, Ref, RewardDecl, Value, frozen
from flowrl.ir.signatures import (
    DATA_KEYS,
    EVAL_KEYS,
    HTTP_REWARD_KEYS,
    MODEL_KEYS,
    REWARD_KEYS,
    REWARD_KINDS,
    RUN_KEYS,
)
from flowrl.models.lora_spec import LORA_KEYS
from flowrl.models.sources import hf_positions

from . import ast
from .checks import Flow, check_device, check_flow, check_loggers, check_shape, check_source
from .columns import check_columns
from .diagnostics import Reporter, Source, did_you_mean
from .environments import EnvInfo, attach_envs, env_bindings, lower_envs
from .evals import EvalContext, lower_evals
from .keys import Entry as _Entry
from .keys import check_value
from .lora import check_lora
from .overrides import Overrides, parse_overrides
from .placement import Placer, ReplicasAt
from .steps import Body, DataSource, StepLowering, may_train, trainable_when_updated
from .templates import Expander, UseArg, check_template
from .values import KIND_NAMES, Binding, DataB, KindError, ModelB, RewardB, coerce, describe, to_value

# A tiny model's config (`charset` makes its tokenizer); keys missing from MODEL_KEYS are ignored.
CONFIG_KEYS = tuple(k for k in ("layers", "dim", "heads", "vocab", "context", "charset", "dropout") if k in MODEL_KEYS)
SHAPE_KEYS = ("layers", "dim", "heads", "vocab", "context", "charset")  # fixed by the weights a model starts from
FIELD_KEYS = ("source", "trainable", "lr", "engine", "gpus", "replicas")  # ModelDecl fields
TRAINABLE_ROLES = ("policy", "critic")
_EXAMPLE_PATH = {"jsonl": "data/train.jsonl", "parquet": "data/train.parquet", "datasets": "data/train"}
ENV_ONLY_REWARD = "zero"  # flowrl.rewards.zero: the `reward` of a flow whose rewards are its environment's alone


def flow_folder(path: str) -> str:
    """The folder relative paths in a flow are resolved against (the cwd for `<string>` sources)."""
    if path.startswith("<"):
        return os.getcwd()
    return os.path.dirname(os.path.abspath(path))


def default_flow_name(path: str) -> str:
    return "flow" if path.startswith("<") else Path(path).stem


@contextlib.contextmanager
def _importable(folder: str) -> Iterator[None]:
    """Let `import "my_rewards"` find a module next to the flow file while the flow is checked."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def lower(module: ast.Module, overrides: Mapping[str, str] | None = None, *,
          generated: Mapping[str, int] | None = None, evals: Sequence[str] = ()) -> Graph:
    """Lower a parsed flow to a Graph; raises FlowError listing every problem found. A pipeline's stage also gets
    `generated` (its policies' generate `max_tokens` in any stage: the default of an `eval` in a stage that
    generates nothing) and `evals` (every stage's eval names, which `eval.NAME.KEY` overrides may name)."""
    return _Lowering(module, overrides, generated, evals).run()


class _Lowering:
    def __init__(self, module: ast.Module, overrides: Mapping[str, str] | None,
                 generated: Mapping[str, int] | None = None, evals: Sequence[str] = ()) -> None:
        self.module = module
        self.generated = dict(generated or {})
        self.all_evals = list(evals)
        self.src = Source(module.path, module.text)
        self.rep = Reporter()
        self.folder = flow_folder(module.path)
        self.overrides = overrides
        self.cycle_members: set[str] = set()  # models already reported in a source cycle

    def run(self) -> Graph:
        models_ast = [d for d in self.module.decls if isinstance(d, ast.ModelDecl)]
        rewards_ast = [d for d in self.module.decls if isinstance(d, ast.RewardDecl)]
        data_ast = [d for d in self.module.decls if isinstance(d, ast.DataDecl)]
        envs_ast = [d for d in self.module.decls if isinstance(d, ast.EnvDecl)]
        self._unique_names([*models_ast, *rewards_ast, *data_ast, *envs_ast])
        iterations = [d for d in self.module.decls if isinstance(d, (ast.UseDecl, ast.StepDecl))]
        ovr = parse_overrides(self.overrides, [d.name.name for d in models_ast], [d.name.name for d in data_ast],
                              any(isinstance(d, ast.UseDecl) for d in iterations), self.rep,
                              rewards=[d.name.name for d in rewards_ast], envs=[d.name.name for d in envs_ast],
                              evals=self._eval_names())
        with _importable(self.folder):
            imports = self._imports()
            self._ovr = ovr
            rewards = [self._reward(d, ovr) for d in rewards_ast]
            envs = self._envs(envs_ast, imports)
        models, replicas_at = self._models(models_ast, ovr)
        data, sources = self._data(data_ast, ovr)
        run = self._run(ovr)
        check_device(self.rep, self._run_block, run.get("device"))
        run["log"] = check_loggers(self.rep, self._run_block, run.get("log"))
        env: dict[str, Binding] = {}
        for m in models:
            env.setdefault(m.name, ModelB(m.name, m.role if m.role in ROLES else None,
                                          may_train(m, self._model_blocks[m.name])))
        for r in rewards:
            env.setdefault(r.name, RewardB(r.name, r.target))
        for d in data:
            env.setdefault(d.name, DataB(d.name))
        for name, b in env_bindings(envs_ast, self.src).items():
            env.setdefault(name, b)
        if envs_ast:  # a flow with an environment may leave `reward` out: its scores are then the env's alone
            env.setdefault("reward", RewardB("reward", ENV_ONLY_REWARD))
        body, template = self._iteration(iterations, env, ovr)
        steps = StepLowering(self.rep, sources)
        nodes = attach_envs(self.rep, self.src, steps.lower(body) if body is not None else [], envs, steps.written)
        models = trainable_when_updated(models, nodes)  # a reward model a step updates gets an optimizer
        if envs_ast and all(r.target != ENV_ONLY_REWARD for r in rewards) and any(
                n.op == "reward" and n.attrs.get("fn") == ENV_ONLY_REWARD for n in nodes):
            rewards.append(RewardDecl("reward", ENV_ONLY_REWARD, self.src.loc(envs_ast[0]), False, "python", frozen()))
            for unused in rewards_ast:  # declared, yet the scores are the environment's alone: say so
                name = unused.name.name
                self.rep.warn(self.src, f"reward `{name}` is not used: the scores are the environment's alone",
                              unused.name, hint=f"to grade trajectories with it, pass it: `reward = {name}`")
        evals = lower_evals(self.rep, self.src, [d for d in self.module.decls if isinstance(d, ast.EvalDecl)],
                            EvalContext(models, rewards, data, nodes, run, self.generated, self._prompts),
                            lambda d: self._block(d.entries, ovr.evals.get(d.name.name, ()), ovr, EVAL_KEYS, "eval"),
                            lambda block: self._filled(block, EVAL_KEYS, "eval"))
        if not self.rep.diagnostics:  # checks across declarations and nodes, on a flow that is right so far
            checked = Flow(self.src, models, self._model_blocks, data, {d.name.name: d for d in data_ast},
                           self._data_blocks, self._prompts, self._shown, nodes, steps.written,
                           str(run.get("device", "auto")), envs, frozenset(e.data for e in evals))
            check_flow(self.rep, checked)
            check_lora(self.rep, checked)
        placements = [d for d in self.module.decls if isinstance(d, ast.PlacementDecl)]
        pools, groups, nodes = Placer(self.rep, models, replicas_at).place(placements, self.src, nodes)
        flow = self._flow_name()
        self.rep.check(self.module.path)
        return Graph(
            flow=flow, path=self.module.path, models=tuple(models), nodes=tuple(nodes),
            rewards=tuple(rewards), data=tuple(data), run=frozen(run), pools=pools, worker_groups=groups,
            imports=tuple(imports), template=template, warnings=tuple(self.rep.warnings), evals=tuple(evals),
        )

    def _eval_names(self) -> list[str]:
        """The `eval` blocks `eval.NAME.KEY` overrides may name: this flow's, and (a stage of a pipeline) every
        stage's, so an override of one stage's eval is no error in the others."""
        names = [d.name.name for d in self.module.decls if isinstance(d, ast.EvalDecl)]
        return names + [n for n in self.all_evals if n not in names]

    # ---- names ----------------------------------------------------------------------------------

    def _unique_names(self, decls: Sequence[ast.ModelDecl | ast.RewardDecl | ast.DataDecl | ast.EnvDecl]) -> None:
        first: dict[str, ast.ModelDecl | ast.RewardDecl | ast.DataDecl | ast.EnvDecl] = {}
        kinds = {ast.ModelDecl: "model", ast.RewardDecl: "reward", ast.DataDecl: "data"}

        def kind_of(d: ast.ModelDecl | ast.RewardDecl | ast.DataDecl | ast.EnvDecl) -> str:
            return d.kind.name if isinstance(d, ast.EnvDecl) else kinds[type(d)]

        for d in sorted(decls, key=lambda d: (d.line, d.col)):
            name, kind = d.name.name, kind_of(d)
            if name in first:
                prev = first[name]
                prev_kind = kind_of(prev)
                message = (f"duplicate {kind} name `{name}`" if prev_kind == kind
                           else f"duplicate name `{name}`: it is already declared as {prev_kind}")
                self.rep.error(self.src, message, d.name,
                               hint=f"`{name}` is first declared on line {prev.line}; names must be unique")
            else:
                first[name] = d

    def _flow_name(self) -> str:
        flows = [d for d in self.module.decls if isinstance(d, ast.FlowDecl)]
        for extra in flows[1:]:
            self.rep.error(self.src, "a flow is named once", extra.name,
                           hint=f"it is already named `{flows[0].name.name}` on line {flows[0].line}")
        return flows[0].name.name if flows else default_flow_name(self.module.path)

    # ---- Python references ----------------------------------------------------------------------

    def _imports(self) -> list[str]:
        out = []
        for d in self.module.decls:
            if not isinstance(d, ast.ImportDecl):
                continue
            name = str(d.module.value)
            try:
                registry.import_module(name)
            except registry.ResolveError as e:
                self.rep.error(self.src, str(e), d.module,
                               hint="the module must be importable: installed, or next to the flow file")
            out.append(name)
        return out

    def _reward(self, d: ast.RewardDecl, ovr: Overrides) -> RewardDecl:
        target = str(d.target.value)
        extra = ovr.rewards.get(d.name.name, ())
        if d.kind is not None:
            return self._remote_reward(d, extra)
        block = self._block(d.entries, extra, ovr, REWARD_KEYS, "reward")
        options = {k: v for k, v in self._filled(block, REWARD_KEYS, "reward").items() if k in block}
        batched = False
        try:
            batched = registry.resolve_reward(target).batched
        except registry.ResolveError as e:
            hint = did_you_mean(target, registry.REWARDS) if "." not in target else None
            self.rep.error(self.src, f"cannot resolve reward \"{target}\": {e}", d.target,
                           hint=hint or "a reward is a dotted path to a Python callable (\"pkg.module.fn\") or a "
                                        "name registered with @flowrl.reward (add `import \"pkg.module\"`)")
        return RewardDecl(d.name.name, target, self.src.loc(d), batched, "python", frozen(options))

    def _envs(self, decls: Sequence[ast.EnvDecl], imports: Sequence[str]) -> dict[str, EnvInfo]:
        return lower_envs(self.rep, self.src, decls, imports, self.folder,
                          lambda entries, extra, keys, what: self._block(entries, extra, self._ovr, keys, what),
                          lambda block, keys, what: self._filled(block, keys, what),
                          overrides=self._ovr.envs, overrides_src=self._ovr.src)

    def _remote_reward(self, d: ast.RewardDecl, extra: Sequence[ast.Entry]) -> RewardDecl:
        """`reward NAME = http("url") { ... }`: a scoring service; every key gets its value or default."""
        assert d.kind is not None
        kind, url = d.kind.name, str(d.target.value)
        if kind not in REWARD_KINDS:
            self.rep.error(self.src, f"unknown reward kind `{kind}`", d.kind,
                           hint=did_you_mean(kind, REWARD_KINDS) or 'write `http("http://host:port/path")`, or a '
                                                                      'Python reward as a string `"pkg.module.fn"`')
        elif not url.startswith(("http://", "https://")):
            self.rep.error(self.src, f"`http` takes a URL starting with http:// or https://, got \"{url}\"", d.target,
                           hint='write `http("http://127.0.0.1:8000/score")`')
        block = self._block(d.entries, extra, self._ovr, HTTP_REWARD_KEYS, "http reward")
        options = self._filled(block, HTTP_REWARD_KEYS, "http reward")
        return RewardDecl(d.name.name, url, self.src.loc(d), True, kind, frozen(options))

    # ---- blocks ---------------------------------------------------------------------------------

    def _block(self, entries: Sequence[ast.Entry], extra: Sequence[ast.Entry], ovr: Overrides,
               keys: Mapping[str, tuple[str, Value]], what: str) -> dict[str, _Entry]:
        """Known entries by key (an override replaces the flow's entry); unknown or repeated keys reported."""
        out: dict[str, _Entry] = {}
        for e, src in [*((e, self.src) for e in entries), *((e, ovr.src) for e in extra)]:
            key = e.key.name
            if key not in keys:
                self.rep.error(src, f"unknown {what} key `{key}`", e.key,
                               hint=did_you_mean(key, keys) or f"{what} keys: {', '.join(keys)}")
                continue
            if key in out and out[key].src is src:
                self.rep.error(src, f"`{key}` is set twice", e.key, hint=f"first set on line {out[key].entry.line}")
                continue
            out[key] = _Entry(e, src)
        return out

    def _typed(self, key: str, kind: str, at: _Entry, what: str | None = None) -> tuple[bool, Value]:
        """(True, the checked value), or (False, None) after reporting the problem: a value of the wrong kind,
        or (for a key of block `what`) outside the key's limit or choices (flowrl.ir.signatures.KEY_LIMITS)."""
        value = to_value(at.entry.value)
        try:
            value = coerce(kind, value)
            return (what is None or check_value(self.rep, what, key, at, value)), value
        except KindError as err:
            hint = f"write `{key} = {err.suggestion}`" if err.suggestion else None
            self.rep.error(at.src, f"`{key}` must be {KIND_NAMES[kind]}, got {describe(value)}", at.entry.value,
                           hint=hint)
            return False, None

    def _filled(self, block: dict[str, _Entry], keys: Mapping[str, tuple[str, Value]], what: str,
                skip: Sequence[str] = ()) -> dict[str, Value]:
        """Each key's checked value, or its default (also when the value was wrong: that is reported)."""
        out: dict[str, Value] = {}
        for key, (kind, default) in keys.items():
            if key in skip:
                continue
            good, value = self._typed(key, kind, block[key], what) if key in block else (False, None)
            out[key] = value if good else default
        return out

    # ---- models ---------------------------------------------------------------------------------

    def _models(self, decls: list[ast.ModelDecl], ovr: Overrides) -> tuple[list[ModelDecl], dict[str, ReplicasAt]]:
        blocks = {d.name.name: self._block(d.entries, ovr.models.get(d.name.name, ()), ovr, MODEL_KEYS, "model")
                  for d in decls}
        self._model_blocks = blocks
        own: dict[str, tuple[str, dict[str, Value]]] = {}  # models with a literal source: (source, config)
        for d in decls:
            if d.name.name in own:
                continue
            own_source = self._literal_source(d, blocks[d.name.name])
            if own_source is not None:
                own[d.name.name] = own_source
        out: list[ModelDecl] = []
        replicas_at: dict[str, ReplicasAt] = {}
        seen: set[str] = set()
        for d in decls:
            name = d.name.name
            if name in seen:
                continue
            seen.add(name)
            block = blocks[name]
            role = d.role.name
            if role not in ROLES:
                self.rep.error(self.src, f"unknown role `{role}`", d.role,
                               hint=did_you_mean(role, ROLES) or f"roles: {', '.join(ROLES)}")
            source, source_model, config = self._source(d, block, blocks, own)
            if name in own:  # a model with weights of its own: can its config make one?
                check_shape(self.rep, self.src, d, block, source, config)
            fields = self._filled(block, MODEL_KEYS, "model", skip=(*CONFIG_KEYS, "source", "replicas"))
            if "lora_rank" not in block:  # no adapters: no LoRA keys (one written alone is reported, dsl/lora.py)
                fields = {k: v for k, v in fields.items() if k not in LORA_KEYS}
            trainable = fields.pop("trainable", None)
            if trainable is None:
                trainable = role in TRAINABLE_ROLES
            lr = fields.pop("lr", None)
            if "lr" not in block and not trainable:  # the default learning rate is for trainable models
                lr = None
            engine = str(fields.pop("engine", "torch"))
            gpus = fields.pop("gpus", 0)
            replicas = self._replicas(block.get("replicas"))
            if "replicas" in block:
                replicas_at[name] = ReplicasAt(block["replicas"].src, block["replicas"].entry.value)
            out.append(ModelDecl(
                name=name, role=role, source=source, loc=self.src.loc(d), config=frozen(config),
                source_model=source_model, trainable=bool(trainable),
                lr=float(lr) if isinstance(lr, (int, float)) else None, engine=engine,
                gpus=float(gpus) if isinstance(gpus, (int, float)) else 0.0, replicas=replicas,
                options=frozen(fields),
            ))
        return out, replicas_at

    def _literal_source(self, d: ast.ModelDecl, block: dict[str, _Entry]) -> tuple[str, dict[str, Value]] | None:
        """(source, config) for a `tiny:` or `hf:` source; None for a model-name source or an error."""
        at = block.get("source")
        if at is None:
            self.rep.error(self.src, f"model `{d.name.name}` has no `source`", d.name,
                           hint='add `source = "tiny:gpt2"`, `source = "hf:PATH"` or `source = OTHER_MODEL`')
            return None
        value = at.entry.value
        if isinstance(value, ast.Name):
            return None
        if not (isinstance(value, ast.Literal) and isinstance(value.value, str)
                and value.value.startswith(("tiny:", "hf:"))):
            self.rep.error(at.src, f"`source` must be \"tiny:NAME\", \"hf:PATH\" or a model's name, "
                                   f"got {describe(to_value(value))}", value,
                           hint='for example `source = "tiny:gpt2"`')
            return None
        source = value.value
        tiny = source.startswith("tiny:")
        if not tiny:  # a local Hugging Face directory, relative to the flow file
            source = "hf:" + os.path.normpath(os.path.join(self.folder, source[3:]))
        check_source(self.rep, at, source, self.folder)
        config: dict[str, Value] = {}
        for key in CONFIG_KEYS:
            kind, default = MODEL_KEYS[key]
            if key in block:
                if not tiny and key in SHAPE_KEYS:
                    self.rep.error(block[key].src, f"`{key}` only applies to tiny: sources", block[key].entry.key,
                                   hint="an hf: model's shape comes from its config.json")
                    continue
                good, v = self._typed(key, kind, block[key], "model")
                config[key] = v if good else default
            elif tiny and default is not None:
                config[key] = default
        positions = None if tiny else hf_positions(source[3:])
        if positions is not None:  # the workers fit prompts and pairs to `context`: the checkpoint's, not 512
            config["context"] = positions
        return source, config

    def _source(self, d: ast.ModelDecl, block: dict[str, _Entry], blocks: Mapping[str, dict[str, _Entry]],
                own: Mapping[str, tuple[str, dict[str, Value]]]) -> tuple[str, str | None, dict[str, Value]]:
        """(source, source_model, config); a model-name source copies the source and shape of the model at the
        root of its chain, and the other config (dropout) of the model it names."""
        name = d.name.name
        if name in own:
            return own[name][0], None, dict(own[name][1])
        at = block.get("source")
        if at is None or not isinstance(at.entry.value, ast.Name):
            return "", None, {}
        ref = at.entry.value
        if ref.name not in blocks:
            self.rep.error(at.src, f"`source` names `{ref.name}`, which is not a declared model", ref,
                           hint=did_you_mean(ref.name, blocks) or "declare that model, or use a \"tiny:\" or "
                                                                    "\"hf:\" source")
            return "", None, {}
        chain, cur = [name], ref.name
        while cur not in own:
            if cur in chain:
                if name not in self.cycle_members:  # report a cycle once, at its first model
                    self.cycle_members.update(chain)
                    self.rep.error(at.src, "source cycle: " + " -> ".join([*chain, cur]), ref,
                                   hint="one model in the chain needs a \"tiny:\" or \"hf:\" source")
                return "", ref.name, {}
            chain.append(cur)
            nxt = blocks[cur].get("source")
            if nxt is None or not isinstance(nxt.entry.value, ast.Name) or nxt.entry.value.name not in blocks:
                return "", ref.name, {}  # the broken link is reported on its own model
            cur = nxt.entry.value.name
        source, config = own[cur][0], dict(own[cur][1])
        for between in reversed(chain[1:]):  # settings such as dropout pass down the chain: a <- b <- c
            for key in CONFIG_KEYS:
                if key in blocks[between] and key not in SHAPE_KEYS:
                    with contextlib.suppress(KindError):  # a bad value is reported on its own model
                        config[key] = coerce(MODEL_KEYS[key][0], to_value(blocks[between][key].entry.value))
        for key in CONFIG_KEYS:
            if key not in block:
                continue
            if key in SHAPE_KEYS:
                self.rep.error(block[key].src, f"`{key}` cannot be set on `{name}`: its weights come from `{cur}`",
                               block[key].entry.key, hint=f"set it on `{cur}` instead")
                continue
            good, v = self._typed(key, MODEL_KEYS[key][0], block[key], "model")
            if good:
                config[key] = v
        return source, ref.name, config

    def _replicas(self, at: _Entry | None) -> int | str | Range:
        if at is None:
            return 1
        value = to_value(at.entry.value)
        if value in (Ref("auto"), "auto"):
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        if isinstance(value, Range) and 1 <= value.lo <= value.hi:
            return value
        self.rep.error(at.src, f"`replicas` must be a positive integer, `auto` or a range such as 1..8, "
                               f"got {describe(value)}", at.entry.value)
        return 1

    # ---- data and run ---------------------------------------------------------------------------

    def _data(self, decls: list[ast.DataDecl], ovr: Overrides) -> tuple[list[DataDecl], dict[str, DataSource]]:
        out: list[DataDecl] = []
        sources: dict[str, DataSource] = {}
        self._data_blocks: dict[str, dict[str, _Entry]] = {}
        self._prompts: dict[str, list[str]] = {}  # each data set's prompts, for the checks across keys
        self._shown: dict[str, str] = {}
        for d in decls:
            name = d.name.name
            if name in sources:
                continue
            block = self._block(d.entries, ovr.data.get(name, ()), ovr, DATA_KEYS, "data")
            self._data_blocks[name] = block
            # a key without a default left unset (held_out) is left out, as graphs printed it before the key existed
            options = {k: v for k, v in self._filled(block, DATA_KEYS, "data").items() if v is not None}
            path = self._data_path(d)
            key = str(options.get("prompt_key", "prompt"))
            rows: list[dict[str, Any]] = []
            if path is not None:
                rows = self._check_data(d, path, key)
                limit = options.get("limit")
                rows = rows[:limit] if isinstance(limit, int) and limit > 0 else rows
                self._prompts[name] = [prompt_plain(r[key]) for r in rows]
                held = held_out_problem(rows, str(options["held_out"])) if "held_out" in options else None
                if held is not None:  # the column a preference update evaluates on (flowrl.data.jsonl)
                    at = block["held_out"]
                    self.rep.error(at.src, held[1], at.entry.value, hint="held_out names a bool column of the data")
                self._shown[name] = self._shown_path(str(to_value(d.args[0].value)))
            if "columns" in options:  # nested paths as reward keywords (dsl.columns), each row checked to hold them
                shown = self._shown.get(name, "the data")
                options["columns"] = check_columns(self.rep, block["columns"], key, rows, shown)[1]
            out.append(DataDecl(name, d.kind.name, path or "", self.src.loc(d), frozen(options)))
            sources[name] = DataSource(self.src.loc(d), self.src.text_of(d), options)
        return out, sources

    def _data_path(self, d: ast.DataDecl) -> str | None:
        kind = d.kind.name
        if kind not in DATA_KINDS:
            self.rep.error(self.src, f"unknown data kind `{kind}`", d.kind,
                           hint=did_you_mean(kind, DATA_KINDS) or f"data kinds: {', '.join(DATA_KINDS)}")
            return None
        args = d.args
        if len(args) != 1 or args[0].key is not None or not (
                isinstance(args[0].value, ast.Literal) and isinstance(args[0].value.value, str)):
            self.rep.error(self.src, f"`{kind}` takes one path string", args[0] if args else d.kind,
                           hint=f'write `{kind}("{_EXAMPLE_PATH.get(kind, "data/train.jsonl")}")` (relative to the flow file)')
            return None
        return os.path.normpath(os.path.join(self.folder, str(args[0].value.value)))

    def _check_data(self, d: ast.DataDecl, path: str, prompt_key: str) -> list[dict[str, Any]]:
        """Read the file (a `datasets` directory) now, so a missing or malformed file is a check-time error, not a mid-run crash; its rows
        ([] after reporting a problem)."""
        where = d.args[0].value
        written = str(to_value(where))
        try:
            return read_data(d.kind.name, path, prompt_key=prompt_key)
        except DataError as e:
            for diag in e.diagnostics:
                if diag.loc is None:  # about the file as a whole: point at the path in the flow
                    message = diag.message.replace(path, written)
                    hint = f"paths are relative to the flow file's folder ({self.folder})"
                    self.rep.error(self.src, message, where, hint=hint if "not found" in message else None)
                else:  # about a line of the data file: keep its line, name the file as the flow does
                    loc = replace(diag.loc, path=self._shown_path(written)) if diag.loc.path == path else diag.loc
                    hint = diag.hint or f"read by data `{d.name.name}` ({self.src.loc(d)})"
                    self.rep.add(replace(diag, loc=loc, hint=hint))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            self.rep.error(self.src, f"cannot read data file \"{written}\": {type(e).__name__}: {e}", where)
        return []

    def _shown_path(self, written: str) -> str:
        """A data file as messages name it: next to the flow's path as the user gave it (`examples/x.flow`
        reads `examples/data/x.jsonl`), so messages don't depend on the machine."""
        if os.path.isabs(written) or self.module.path.startswith("<"):
            return written
        return os.path.normpath(os.path.join(os.path.dirname(self.module.path), written))

    def _run(self, ovr: Overrides) -> dict[str, Value]:
        runs = [d for d in self.module.decls if isinstance(d, ast.RunDecl)]
        for extra in runs[1:]:
            self.rep.error(self.src, "a flow has at most one `run` block", extra,
                           hint=f"merge it into the one on line {runs[0].line}")
        block = self._block(runs[0].entries if runs else (), ovr.run, ovr, RUN_KEYS, "run")
        self._run_block = block
        filled = self._filled(block, RUN_KEYS, "run")
        return filled

    # ---- the iteration --------------------------------------------------------------------------

    def _iteration(self, iterations: list[ast.UseDecl | ast.StepDecl], env: dict[str, Binding],
                   ovr: Overrides) -> tuple[Body | None, str | None]:
        templates: dict[str, tuple[ast.TemplateDecl, Source]] = {}
        for t in self.module.decls:
            if isinstance(t, ast.TemplateDecl):
                if t.name.name in templates:
                    self.rep.error(self.src, f"template `{t.name.name}` is declared twice", t.name,
                                   hint=f"first declared on line {templates[t.name.name][0].line}")
                    continue
                check_template(t, self.src, self.rep)
                templates[t.name.name] = (t, self.src)
        if not iterations:
            self.rep.error(self.src, "this flow has no iteration", ast.Span(1, 1, 1, 2),
                           hint="add `use TEMPLATE(...)` (e.g. `use grpo(group = 8)`) or a `step { ... }` block")
            return None, None
        first = iterations[0]
        for extra in iterations[1:]:
            self.rep.error(self.src, "a flow has exactly one `use` or `step`", extra,
                           hint=f"the first is on line {first.line}; remove one of them")
        if isinstance(first, ast.StepDecl):
            return Body(first.body, self.src, env), None
        args = [UseArg(a, self.src) for a in first.args]
        overridden = {a.key.name for a in ovr.use if a.key is not None}
        args = [a for a in args if a.arg.key is None or a.arg.key.name not in overridden]
        args += [UseArg(a, ovr.src) for a in ovr.use]
        body = Expander(self.rep, env, templates).expand(first, self.src, args)
        return body, first.template.name
