"""`flowrl eval` and `flowrl.evaluate` (flowrl.runtime): a run's checkpoint, or its step-0 weights, evaluated outside
the run the way an `eval` block evaluates inside it (flowrl.runtime.evaluation: same prompts, seeds and figures).

Everything comes from the run directory: run.json (the seed), graph.json (the models as they ran, `--set` overrides
applied; the flow's `eval` blocks, generate and rewards, which give the defaults) and checkpoints/. Where the data
file is an `eval` block's data set, that block's name, `n`, `temperature`, `max_tokens`, reward, `prompt_key` and
`limit` are the defaults (of several blocks on that file, the one whose `n` and `temperature` are those asked
for), so `flowrl eval RUN --init --data FILE` gives a step-0 evaluation's numbers exactly; for another file the
model's first `eval` block gives them (but `prompt_key` and `limit`); without one the flow's generate gives
`max_tokens`, its reward the reward, and `n = 1`, `temperature = 0`. A pipeline's run directory evaluates the last
stage whose step uses the model (OUT/stages/NAME), or with `step` the stage that holds that pipeline-wide step.
`PolicyEval` is the piece under it: one model of a flow rebuilt here, answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flowrl import registry
from flowrl.errors import DataError, Diagnostic, FlowError, Loc
from flowrl.ir.graph import DataDecl, ModelDecl, RewardDecl, frozen
from flowrl.models.sources import device_problem
from flowrl.runtime.batch import Batch
from flowrl.runtime.evaluation import (
    EvalSpec,
    Outcome,
    Rows,
    data_rows,
    eval_seed,
    extractor_for,
    fitting,
    generate_all,
    outcome,
    score_all,
)
from flowrl.runtime.samples import append_samples, with_kind
from flowrl.runtime.scoring import Scorer, make_scorer
from flowrl.runtime.worker import ModelWorker

CKPT_DIR = "checkpoints"  # = flowrl.runtime.runner.CKPT_DIR (the runner imports this module's neighbours)


class PolicyEval:
    """Model `model` of a flow (`models`: its declarations) built on this process from the run's seed, as every
    rank builds it; `load(weights)` sets its weights (None: back to step 0); `evaluate` answers and scores."""

    def __init__(self, models: Sequence[ModelDecl], model: str, *, seed: int, device: str = "cpu") -> None:
        decls = {m.name: m for m in models}
        # never trained here: no optimizer; a training engine (deepspeed) generates with torch, as its worker does
        own = replace(decls[model], trainable=False, engine="torch" if decls[model].engine == "deepspeed"
                      else decls[model].engine)
        self.model = model
        self.worker = ModelWorker([own], list(models), seed=seed, device=device)
        module = self.worker.models[model].module
        self.initial = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def load(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        self.worker.models[self.model].module.load_state_dict(dict(weights if weights is not None else self.initial))

    def generate(self, prompts: Batch, attrs: dict[str, Any], seed: int) -> Batch:
        return self.worker.generate(self.model, prompts, attrs, step_seed=seed)

    def evaluate(self, rows: Rows, spec: EvalSpec, scorer: Scorer, *, seed: int, step: int, prompt_key: str = "prompt",
                 reward_target: str = "", data: str = "") -> Outcome:
        """Numbered `rows` (place in the data set, row) answered `spec.n` times each with the run's seed `seed` at
        `step` and scored (maj@K with the answer reader of `reward_target`, when given)."""
        rollouts = generate_all(self.generate, rows, prompt_key, spec, eval_seed(seed, step, spec.name))
        extractor = extractor_for(reward_target) if reward_target else None
        return outcome(rollouts, score_all(rollouts, scorer), spec.n, extractor, data)


@dataclass(frozen=True)
class Evaluated:
    """What `evaluate` found: the figures (`mean@K`, `pass@k`, ...), every sample, and which weights."""

    metrics: dict[str, float]
    rows: int
    step: int  # the run's step (a pipeline's: pipeline-wide); 0 for the step-0 weights
    model: str
    name: str  # the eval block it followed ("eval" when none)
    n: int
    reward: str
    data: str
    checkpoint: str | None = None
    stage: str | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)  # as OUT/samples.jsonl holds them (kind eval/NAME)
    left_out: str | None = None  # the prompts too long for the model, said (None: none)

    def summary(self) -> dict[str, Any]:
        """The `--json` object: every figure, `rows` and `step` (and `stage` for a pipeline)."""
        out: dict[str, Any] = {**self.metrics, "rows": self.rows, "step": self.step}
        if self.stage is not None:
            out["stage"] = self.stage
        return out


def evaluate(run_dir: str | Path, *, data: str | Path, reward: str | None = None, step: int | None = None,
             model: str | None = None, n: int | None = None, temperature: float | None = None,
             max_tokens: int | None = None, init: bool = False, samples: str | Path | None = None,
             device: str | None = None) -> Evaluated:
    """Evaluate `run_dir`'s `model` (default: the policy it evaluates or generates with) at checkpoint `step`
    (default: the last; `init`: the step-0 weights) on `data` (JSONL, parquet or a datasets directory), scored by
    `reward` (a registered name or `module.fn`); every sample with its reward to `samples` (JSONL) when given.
    `device`: default the run's (`run { device }`, `auto`: CUDA where there is one)."""
    for flag, value, least in (("--n", n, 1), ("--max-tokens", max_tokens, 1), ("--temperature", temperature, 0),
                               ("--step", step, 0)):
        if value is not None and value < least:
            raise FlowError(Diagnostic(f"eval: {flag} must be at least {least}, got {value}"))
    if device is not None and device_problem(device) is not None:
        problem = device_problem(device)
        assert problem is not None
        raise FlowError(Diagnostic(f"eval: --device: {problem[0]}", hint="auto, cpu, cuda or cuda:N"))
    where = _RunDir.open(Path(run_dir), model, 0 if init else step)
    g, decls, name = where.graph, where.models, where.model
    path = os.path.realpath(str(data))
    mine = [e for e in g.get("evals", []) if e["model"] == name]
    on_file = [e for e in mine if any(d["name"] == e["data"] and os.path.realpath(d["path"]) == path
                                      for d in g.get("data", []))]
    # several blocks of this data set (greedy and sampled): the one --n and --temperature describe, else the first
    matched = next((e for e in on_file if (n is None or int(e["n"]) == n)
                    and (temperature is None or float(e["temperature"]) == temperature)), next(iter(on_file), None))
    block = matched or next(iter(mine), None)  # the eval block of this data set, else the model's first
    decl = next((d for d in g.get("data", []) if matched is not None and d["name"] == matched["data"]), None)
    options: dict[str, Any] = dict(decl["options"]) if decl is not None else {}
    prompt_key = str(options.get("prompt_key", "prompt"))
    rows = _rows(Path(data), options)
    gen = next((x for x in g.get("nodes", []) if x["op"] == "generate" and x["model"] == name), None)
    spec = EvalSpec(
        block["name"] if block is not None else "eval",
        n if n is not None else int(block["n"]) if block is not None else 1,
        float(temperature if temperature is not None else block["temperature"] if block is not None else 0.0),
        max_tokens or (int(block["max_tokens"]) if block is not None else _gen_max_tokens(gen, where)),
        gen["attrs"].get("env") if gen is not None and isinstance(gen["attrs"].get("env"), Mapping) else None,
        int(gen["attrs"].get("max_total", 0) or 0) if gen is not None else 0,
    )
    folder = os.path.dirname(os.path.abspath(str(g.get("path") or "."))) if g.get("path") else "."
    with _importable(folder, g.get("imports", [])):  # a reward next to the flow, or one its imports register
        reward_decl = _reward(g, reward, block)
        scorer = make_scorer(reward_decl, imports=tuple(g.get("imports", [])), folder=folder)
    try:
        numbered, left_out = fitting(rows, prompt_key, next(m for m in decls if m.name == name), spec,
                                     spec.name if matched is not None else str(data))  # named as it is
        policy = PolicyEval(decls, name, seed=where.seed, device=device or where.device)
        policy.load(where.weights)
        got = policy.evaluate(numbered, spec, scorer, seed=where.seed, step=where.run_step, prompt_key=prompt_key,
                              reward_target=reward_decl.target if reward_decl.kind == "python" else "",
                              data=str(matched["data"]) if matched is not None else str(data))
    finally:
        scorer.close()
    records = with_kind(f"eval/{spec.name}", got.samples, where.step)
    if samples is not None:
        out = Path(samples)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("", encoding="utf-8")
        append_samples(out, records)
    return Evaluated(got.metrics, got.rows, where.step, name, spec.name, spec.n, reward_decl.target, str(data),
                     None if where.checkpoint is None else str(where.checkpoint), where.stage, records, left_out)


def reward_scorer(target: str) -> Scorer:
    """An inline scorer of reward `target` (a registered name or `module.fn`), for evaluating outside a run."""
    return make_scorer(_reward_decl(target, "--reward"))


# ---- the run directory ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunDir:
    """A run (or one stage of a pipeline's run) and the weights chosen in it."""

    dir: Path
    graph: dict[str, Any]
    models: list[ModelDecl]
    model: str
    seed: int
    weights: dict[str, torch.Tensor] | None  # None: the step-0 weights
    checkpoint: Path | None
    step: int  # as reported (pipeline-wide in a pipeline)
    run_step: int  # the stage's own step (what the stage's eval seeds were keyed by)
    stage: str | None = None
    device: str = "auto"  # the device the run ran on

    @staticmethod
    def open(path: Path, model: str | None, step: int | None) -> _RunDir:
        if not path.is_dir():
            raise FlowError(Diagnostic(f"eval: no run directory {path}", hint="pass the --out folder of a `flowrl run`"))
        if (path / "pipeline.json").is_file():
            return _RunDir._stage(path, model, step)
        g = _graph(path)
        name = _model(g, path, model if model is not None else _default_model([g], path))
        return _RunDir._at(path, g, name, step, offset=0, stage=None)

    @staticmethod
    def _stage(out: Path, model: str | None, step: int | None) -> _RunDir:
        """A pipeline's run: the stage holding pipeline-wide `step`, else the last stage whose step uses the model."""
        state = json.loads((out / "pipeline.json").read_text(encoding="utf-8"))
        stages, offset = [], 0
        for s in state.get("stages", []):
            sdir = out / str(s.get("dir", Path("stages") / s["name"]))
            if (sdir / "graph.json").is_file():
                stages.append((s["name"], sdir, offset, _graph(sdir)))
            offset += int(s["steps"])
        if not stages:
            raise FlowError(Diagnostic(f"eval: {out} holds a pipeline with no stage run yet"))
        name = model if model is not None else _default_model([x[3] for x in stages], out)
        using = [x for x in stages if any(n.get("model") == name for n in x[3].get("nodes", []))]
        if not using:
            raise FlowError(Diagnostic(f"eval: no stage of {out} uses model `{name}`",
                                       hint=f"stages: {', '.join(x[0] for x in stages)}"))
        chosen: tuple[str, Path, int, dict[str, Any]] | None = using[-1] if step is None else using[0]
        if step:
            chosen = next((x for x in using if x[2] < step <= x[2] + _steps(x[3])), None)
            if chosen is None:
                spans = ", ".join(f"{x[0]}: {x[2] + 1}..{x[2] + _steps(x[3])}" for x in using)
                raise FlowError(Diagnostic(f"eval: step {step} is in no stage that uses `{name}`",
                                           hint=f"pipeline-wide steps of the stages that do: {spans}"))
        assert chosen is not None
        stage, sdir, start, g = chosen
        _model(g, sdir, name)
        own = None if step is None else max(0, step - start)  # the stage's own step; 0: the step-0 weights
        return _RunDir._at(sdir, g, name, own, offset=start, stage=stage)

    @staticmethod
    def _at(path: Path, g: dict[str, Any], name: str, step: int | None, *, offset: int,
            stage: str | None) -> _RunDir:
        settings = json.loads((path / "run.json").read_text(encoding="utf-8")) if (path / "run.json").is_file() \
            else {}
        seed = int(settings.get("seed", g.get("run", {}).get("seed", 0)))
        device = str(settings.get("device", g.get("run", {}).get("device", "auto")))
        decls = model_decls(g)
        if step == 0:
            return _RunDir(path, g, decls, name, seed, None, None, 0, 0, stage, device)
        found = sorted((path / CKPT_DIR).glob("step_*.pt"))
        if not found:
            raise FlowError(Diagnostic(f"eval: {path} has no checkpoint",
                                       hint="evaluate its step-0 weights with --init, or run it to a checkpoint"))
        steps = [int(p.stem.removeprefix("step_")) for p in found]
        if step is not None and step not in steps:
            raise FlowError(Diagnostic(f"eval: no checkpoint at step {step + offset} in {path / CKPT_DIR}",
                                       hint=f"checkpoints at steps: {', '.join(str(s + offset) for s in steps)}"))
        ckpt = found[steps.index(step)] if step is not None else found[-1]
        weights = _trained_weights(ckpt, g, name)
        if weights is None:
            raise FlowError(Diagnostic(f"eval: {ckpt} holds no model `{name}`"))
        at = steps[found.index(ckpt)]
        return _RunDir(path, g, decls, name, seed, weights, ckpt, at + offset, at, stage, device)


def _trained_weights(ckpt: Path, g: Mapping[str, Any], name: str) -> dict[str, torch.Tensor] | None:
    """`name`'s weights in a checkpoint: the copy of the group that trains it (an asynchronous run's generation
    group holds an older version), else the one group holding it."""
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    held = {group: models[name]["module"] for group, models in state["groups"].items() if name in models}
    trains = next((n["worker_group"] for n in g.get("nodes", []) if n["op"] == "update" and n["model"] == name), None)
    module = held.get(str(trains)) if trains in held else next(iter(held.values()), None)
    return None if module is None else {k: v.detach().cpu() for k, v in module.items()}


def _steps(g: Mapping[str, Any]) -> int:
    return int(g.get("run", {}).get("steps", 0))


def _graph(path: Path) -> dict[str, Any]:
    file = path / "graph.json"
    if not file.is_file():
        raise FlowError(Diagnostic(f"eval: {path} has no graph.json (not a run directory)",
                                   hint="pass the --out folder of a `flowrl run`"))
    g: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
    return g


def _default_model(graphs: Sequence[Mapping[str, Any]], path: Path) -> str:
    """The model an eval block evaluates, else the one a generate uses, else the first policy (of any graph)."""
    for pick in (lambda g: [e["model"] for e in g.get("evals", [])],
                 lambda g: [n["model"] for n in g.get("nodes", []) if n["op"] == "generate"],
                 lambda g: [m["name"] for m in g.get("models", []) if m["role"] == "policy"]):
        found = [m for g in graphs for m in pick(g)]
        if found:
            return str(found[0])
    names = sorted({m["name"] for g in graphs for m in g.get("models", [])})
    raise FlowError(Diagnostic(f"eval: {path} has no policy to evaluate", hint=f"its models: {', '.join(names)}"))


def _model(g: Mapping[str, Any], path: Path, model: str) -> str:
    """`model`, checked: a policy of the graph."""
    roles = {m["name"]: m["role"] for m in g.get("models", [])}
    if model not in roles:
        raise FlowError(Diagnostic(f"eval: no model `{model}` in {path}",
                                   hint=f"its models: {', '.join(roles) or 'none'}"))
    if roles[model] != "policy":
        raise FlowError(Diagnostic(f"eval: `{model}` is a {roles[model]}; an evaluation generates with a policy",
                                   hint="policies: " + (", ".join(m for m, r in roles.items() if r == "policy")
                                                        or "none")))
    return model


def model_decls(g: Mapping[str, Any]) -> list[ModelDecl]:
    """The models of a graph.json, as lowering declared them (what `init_model` rebuilds step-0 weights from)."""
    names = {m["name"] for m in g.get("models", [])}
    out = []
    for m in g.get("models", []):
        source = str(m["source"])
        source_model = source if source in names else None
        out.append(ModelDecl(
            name=m["name"], role=m["role"], source=str(m.get("base_source", source)), loc=Loc(str(m.get("loc", "")), 1, 1),
            config=frozen(m.get("config", {})), source_model=source_model, trainable=bool(m.get("trainable")),
            lr=m.get("lr"), engine=str(m.get("engine", "torch")), options=frozen(m.get("options", {}))))
    return out


def _gen_max_tokens(gen: Mapping[str, Any] | None, where: _RunDir) -> int:
    if gen is None:
        raise FlowError(Diagnostic(f"eval: --max-tokens is needed: nothing in {where.dir} generates with "
                                   f"`{where.model}`"))
    return int(gen["attrs"]["max_tokens"])


# ---- data and reward ----------------------------------------------------------------------------------------------


def _rows(path: Path, options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of a data file, by its kind (a .parquet file, a `datasets` directory, else JSONL), read as the eval
    block's data declaration reads them (`options`: its `limit` and `columns`; none for another file)."""
    if not path.exists():
        raise DataError(Diagnostic(f"eval: data file not found: {path}"))
    kind = "datasets" if path.is_dir() else "parquet" if path.suffix == ".parquet" else "jsonl"
    decl = DataDecl("eval", kind, str(path), Loc(str(path), 1, 1), frozen(options))
    return data_rows(decl)


def _reward(g: Mapping[str, Any], reward: str | None, block: Mapping[str, Any] | None) -> RewardDecl:
    """`reward` (a registered name or `module.fn`), else the eval block's, the step's or the flow's only reward."""
    if reward is not None:
        return _reward_decl(reward, "--reward")
    declared = {r["name"]: r for r in g.get("rewards", [])}
    by_target = {r["target"]: r for r in g.get("rewards", [])}
    used = next((str(n["attrs"].get("fn")) for n in g.get("nodes", []) if n["op"] == "reward"), None)
    found = (declared.get(block["reward"]) if block is not None else None) or by_target.get(used or "") or (
        next(iter(declared.values())) if len(declared) == 1 else None)
    if found is None:
        raise FlowError(Diagnostic("eval: --reward is needed: the run's flow scores with no declared reward",
                                   hint="for example --reward flowrl.rewards.arith_exact"))
    return RewardDecl(found["name"], found["target"], Loc(str(g.get("path", "")), 1, 1), bool(found.get("batched")),
                      str(found.get("kind", "python")), frozen(found.get("options", {})))


def _reward_decl(target: str, where: str) -> RewardDecl:
    try:
        fn = registry.resolve_reward(target)
    except registry.ResolveError as e:
        raise FlowError(Diagnostic(f"{where}: cannot resolve reward \"{target}\": {e}",
                                   hint="a registered reward (arith_exact, math_equal, ...) or a dotted path "
                                        "to a Python function, `module.fn`")) from None
    return RewardDecl(target.rsplit(".", 1)[-1], target, Loc(where, 1, 1), fn.batched)


@contextlib.contextmanager
def _importable(folder: str, imports: Sequence[str]) -> Iterator[None]:
    """The flow's `import`s done (its folder on the path while they are), so its registered rewards resolve."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        for module in imports:
            try:
                registry.import_module(module)
            except registry.ResolveError as e:
                raise FlowError(Diagnostic(f"eval: the run's flow imports {module}: {e}")) from None
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
