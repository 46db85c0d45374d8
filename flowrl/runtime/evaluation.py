"""Held-out evaluation (flowrl.runtime): an `eval` block's prompts answered by the policy, scored by its reward and
summed up — between a run's steps (`Evaluations`, the runner's hook) and outside a run (`flowrl eval`,
flowrl.runtime.eval_run), through the same functions, so a step-0 evaluation and `flowrl eval --init` agree exactly.

What is reported, under `eval/NAME/` (and again under `eval/NAME/SOURCE/` for each value of a `data_source` column):
- `mean@K`: the mean reward of the K = `n` samples of each prompt, over the prompts;
- `pass@k` for k = 1, 2, 4, ... and K: the unbiased estimator of Chen et al. 2021 (flowrl.algos.pass_at_k), a sample
  being right when its reward is at least 1 (full marks: the shipped rewards give 1.0 to a right answer);
- `maj@K` (K >= 2, where the reward's answers can be read: flowrl.rewards.answers): the answer most samples give
  (responses without one don't vote; a tie goes to the answer given first), right when the first sample giving it
  is right;
- `response_len_mean`: response tokens per sample.
A generate with an environment is evaluated with it, and a sample's reward is then its return (the declared
reward plus the environment's), as the step trains on.

Sampling is seeded like training draws: the seed of (run seed, step, eval name) and each prompt's row in the data
set as its slot, which key every sample's random stream (flowrl.engines.sampling); so the numbers do not depend on
the backend, how the prompts are split, or anything training drew. Prompts are generated `MAX_SAMPLES_PER_CALL`
samples at a time. Evaluation reads its own rows (the data declaration's `columns` applied, prompts longer than
the model leaves them beside `max_tokens` left out and counted, as training's are) and scores with its own
scorers: no training state is touched. Every answer is a sample record (`row_id`: its prompt's place in the data
set, `sample`, `prompt`, `response`, `reward`, `response_tokens`, `data_source` and the vote's `answer` where
there are): the runner sends them to its sinks as kind `eval/NAME` (OUT/samples.jsonl, the trackers' tables).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowrl.algos.pass_at_k import majority, pass_at_k, report_ks
from flowrl.data.chat import render_chat
from flowrl.data.paths import columns_of, with_columns
from flowrl.data.tables import is_chat, prompt_plain, read_data
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import DataDecl, EvalDecl, Graph, ModelDecl, Node
from flowrl.registry import resolve_reward
from flowrl.rewards.answers import Extractor, extractor_of
from flowrl.runtime.batch import Batch
from flowrl.runtime.controller import Span
from flowrl.runtime.overlong import tokenizer_of
from flowrl.runtime.prompts import PromptEncoder
from flowrl.runtime.protocol import WorkerGroup
from flowrl.runtime.scoring import Scorer, make_scorer

MAX_SAMPLES_PER_CALL = 1024  # samples a generate call holds (prompts per call: this over n)
RIGHT = 1.0  # a sample whose reward is at least this counts as right (pass@k, maj@K)
SOURCE_KEY = "data_source"  # the column an evaluation's metrics are split by (verl's)
EVAL_OP = "eval"  # the op of eval spans in trace.json (flowrl timeline)

Generate = Callable[[Batch, dict[str, Any], int], Batch]  # (prompts, generate attrs, step seed) -> rollout
Rows = list[tuple[int, dict[str, Any]]]  # (the row's place in the data set, the row)


@dataclass(frozen=True)
class EvalSpec:
    """How an evaluation samples: `name` (part of its seed), samples per prompt, temperature, tokens per answer,
    and the environment spec of a generate that acts over turns (None: one completion)."""

    name: str
    n: int = 1
    temperature: float = 0.0
    max_tokens: int = 256
    env: Mapping[str, Any] | None = None
    max_total: int = 0

    @staticmethod
    def of(decl: EvalDecl, gen: Node | None = None) -> EvalSpec:
        spec = gen.attrs.get("env") if gen is not None else None
        total = gen.attrs.get("max_total", 0) if gen is not None else 0
        return EvalSpec(decl.name, decl.n, decl.temperature, decl.max_tokens,
                        dict(spec) if isinstance(spec, Mapping) else None, int(str(total or 0)))

    def attrs(self) -> dict[str, Any]:
        """The generate attributes (the worker's `GenerateAttrs`)."""
        out: dict[str, Any] = {"n": self.n, "max_tokens": self.max_tokens, "min_tokens": 0,
                               "temperature": self.temperature, "top_p": 1.0}
        if self.env is not None:
            out.update(env=dict(self.env), max_total=self.max_total)
        return out


def eval_seed(seed: int, step: int, name: str) -> int:
    """The sampling seed of evaluation `name` at `step`: Controller.step_seed's formula for a node `eval/NAME`."""
    return (seed * 7_919 + step * 104_729 + sum(map(ord, f"eval/{name}"))) % (2**31)


def data_rows(decl: DataDecl) -> list[dict[str, Any]]:
    """An eval data set's rows as training reads a data declaration (its reader, `prompt_key`, `limit`, `columns`);
    every row, a `held_out` column notwithstanding."""
    opts: dict[str, Any] = dict(decl.options)
    rows = read_data(decl.kind, decl.path, str(opts.get("prompt_key", "prompt")))
    limit = int(opts.get("limit", 0) or 0)
    return with_columns(rows[:limit] if limit else rows, columns_of(opts.get("columns")), decl.path)


def fitting(rows: Sequence[Mapping[str, Any]], prompt_key: str, decl: ModelDecl, spec: EvalSpec,
            name: str) -> tuple[Rows, str | None]:
    """The rows whose prompt fits `decl`'s context beside `spec.max_tokens` (as flowrl.runtime.overlong filters a
    step's), each with its place in the data set, and a line saying how many were left out (None: none). A generate
    in an environment budgets whole trajectories: nothing is left out. FlowError when no prompt fits."""
    numbered = [(i, dict(r)) for i, r in enumerate(rows)]
    if spec.env is not None:
        return numbered, None
    enc = PromptEncoder(tokenizer_of(decl), int(str(decl.config.get("context", 512) or 512)))
    room = enc.room(spec.max_tokens)
    lengths = [len(enc.tokens(render_chat(p, enc.tokenizer) if is_chat(p) else str(p)))
               for p in (r.get(prompt_key, "") for _, r in numbered)]
    kept = [x for x, length in zip(numbered, lengths, strict=True) if length <= room]
    if len(kept) == len(numbered):
        return kept, None
    said = (f"{len(numbered) - len(kept)} of {len(numbered)} prompts are longer than the {room} tokens model "
            f"`{decl.name}` leaves them (context {enc.context}, max_tokens {spec.max_tokens}; the longest has "
            f"{max(lengths)})")
    if not kept:
        raise FlowError(Diagnostic(f"eval `{name}`: every prompt is too long: {said}",
                                   hint="lower `max_tokens`, or use a model with more positions"))
    return kept, f"eval `{name}`: {said}; they are left out of the evaluation"


def prompt_batch(rows: Rows, prompt_key: str) -> Batch:
    """Numbered rows as a prompt batch (what a step's data node gives), each keyed by its place in the data set."""
    prompts = [row.get(prompt_key, "") for _, row in rows]
    ids = [i for i, _ in rows]
    meta: dict[str, list[Any]] = {"prompt": [prompt_plain(p) for p in prompts], "row": [row for _, row in rows],
                                  "prompt_id": ids, "prompt_slot": ids}
    if any(is_chat(p) for p in prompts):  # the generating worker renders these with its model's chat template
        meta["messages"] = [p if is_chat(p) else None for p in prompts]
    return Batch(len(rows), {}, meta)


def generate_all(generate: Generate, rows: Rows, prompt_key: str, spec: EvalSpec, seed: int) -> list[Batch]:
    """Every row's `spec.n` answers, a call per `MAX_SAMPLES_PER_CALL` samples (rollouts in row order)."""
    per_call = max(1, MAX_SAMPLES_PER_CALL // spec.n)
    return [generate(prompt_batch(rows[i:i + per_call], prompt_key), spec.attrs(), seed)
            for i in range(0, len(rows), per_call)]


@dataclass
class Outcome:
    """An evaluation's figures (keys without the `eval/NAME/` prefix) and every sample, scored."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]] = field(default_factory=list)
    rows: int = 0


def score_all(rollouts: Sequence[Batch], scorer: Scorer) -> list[float]:
    """Each sample's reward (plus its environment's return, where it acted in one), in sample order."""
    out: list[float] = []
    for r in rollouts:
        scores = scorer.score(r)["scores"].double()
        if "env_return" in r.tensors:
            scores = scores + r["env_return"].double()
        out.extend(float(v) for v in scores.tolist())
    return out


def outcome(rollouts: Sequence[Batch], rewards: Sequence[float], n: int, extractor: Extractor | None,
            data: str = "") -> Outcome:
    """The figures of scored rollouts (see the module docstring) and their samples' records."""
    samples: list[dict[str, Any]] = []
    seen: dict[int, int] = {}
    for r in rollouts:
        mask = r.tensors.get("loss_mask", r["response_mask"])
        lengths = mask.sum(1).tolist()
        for i in range(r.size):
            row_id = int(r.meta["prompt_id"][i])
            j = seen[row_id] = seen.get(row_id, -1) + 1
            row = r.meta["row"][i]
            rec: dict[str, Any] = {"data": data, "row_id": row_id, "sample": j, "prompt": r.meta["prompt"][i],
                                   "response": r.meta["response"][i], "reward": 0.0,
                                   "response_tokens": int(lengths[i])}
            if isinstance(row, Mapping) and SOURCE_KEY in row:
                rec[SOURCE_KEY] = str(row[SOURCE_KEY])
            if extractor is not None:
                rec["answer"] = extractor(str(r.meta["response"][i]))
            samples.append(rec)
    if len(samples) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards for {len(samples)} samples")
    for rec, value in zip(samples, rewards, strict=True):
        rec["reward"] = float(value)
    metrics = summarize(samples, n, extractor is not None)
    for source in sorted({str(s[SOURCE_KEY]) for s in samples if SOURCE_KEY in s}):
        part = summarize([s for s in samples if s.get(SOURCE_KEY) == source], n, extractor is not None)
        metrics.update({f"{source}/{k}": v for k, v in part.items()})
    return Outcome(metrics, samples, len(seen))


def summarize(samples: Sequence[Mapping[str, Any]], n: int, answers: bool) -> dict[str, float]:
    """mean@K, pass@k, maj@K and response_len_mean of scored sample records (each with row_id, reward,
    response_tokens, and with `answers` an extracted answer)."""
    by_row: dict[int, list[Mapping[str, Any]]] = {}
    for s in samples:
        by_row.setdefault(int(s["row_id"]), []).append(s)
    groups = list(by_row.values())
    if not groups:
        return {}
    rewards = [float(s["reward"]) for s in samples]
    out = {f"mean@{n}": sum(rewards) / len(rewards)}
    for k in report_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(len(g), sum(float(s["reward"]) >= RIGHT for s in g), min(k, len(g)))
                               for g in groups) / len(groups)
    if answers and n >= 2:
        votes = [majority([s.get("answer") for s in g]) for g in groups]
        out[f"maj@{n}"] = sum(float(g[v]["reward"]) >= RIGHT for g, v in zip(groups, votes, strict=True)
                              if v is not None) / len(groups)
    out["response_len_mean"] = sum(int(s["response_tokens"]) for s in samples) / len(samples)
    return out


def extractor_for(target: str, kind: str = "python") -> Extractor | None:
    """The answer reader of a reward declaration's function (None for an http reward or an unknown one)."""
    if kind != "python":
        return None
    return extractor_of(resolve_reward(target).fn)


def headline(row: Mapping[str, Any]) -> tuple[str, float] | None:
    """The first `eval/NAME/mean@K` of a metrics row as ("eval NAME", value), or None: the progress bar's."""
    for key, value in row.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith("mean@") and isinstance(value, float):
            return f"eval {parts[1]}", value
    return None


def eval_only(row: Mapping[str, Any]) -> bool:
    """A metrics row that holds a step-0 evaluation alone (no training step)."""
    return all(k.startswith("eval/") or k in ("step", "stage", "stage_step") or k.startswith("time/eval/")
               for k in row)


def eval_group(graph: Graph, model: str, asynchronous: bool = False) -> tuple[str, str]:
    """(worker group, dispatch) an evaluation of `model` generates on: the group of the step's generate of it,
    whose weights are synced after each update; in an asynchronous run the group that trains it (the generation
    group holds a version up to `max_staleness` updates old by design); in a step without a generate of it (SFT,
    DPO) the group that trains it, else any group holding it."""
    gen = next((n for n in graph.nodes if n.op == "generate" and n.model == model), None)
    upd = next((n for n in graph.nodes if n.op == "update" and n.model == model), None)
    dispatch = gen.dispatch if gen is not None else "split"
    if upd is not None and (asynchronous or gen is None):
        return upd.worker_group, dispatch
    if gen is not None:
        return gen.worker_group, dispatch
    return next(w.name for w in graph.worker_groups if model in w.models), dispatch


@dataclass
class EvalStep:
    """What a step's evaluations add: metrics (`eval/NAME/...`, `time/eval/NAME`), spans, and each evaluation's
    sample records by its name (what the runner hands its sinks as kind `eval/NAME`)."""

    metrics: dict[str, float] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class _Eval:
    decl: EvalDecl
    spec: EvalSpec
    rows: Rows
    prompt_key: str
    scorer: Scorer
    extractor: Extractor | None
    group: str
    dispatch: str


class Evaluations:
    """A run's `eval` blocks (the runner's hook): `run(step)` evaluates those due at `step` (0: the ones with
    `at_start`; a multiple of `every`; the run's last step, `last`) on the workers, between steps."""

    def __init__(self, graph: Graph, groups: Mapping[str, WorkerGroup], *, seed: int, last: int,
                 clock_start: float, asynchronous: bool = False) -> None:
        self.groups, self.seed, self.last, self.t0 = groups, seed, last, clock_start
        folder = os.path.dirname(os.path.abspath(graph.path)) if graph.path else "."
        data = {d.name: d for d in graph.data}
        rewards = {r.name: r for r in graph.rewards}
        self.items: list[_Eval] = []
        try:
            for e in graph.evals:
                gen = next((n for n in graph.nodes if n.op == "generate" and n.model == e.model), None)
                reward, spec = rewards[e.reward], EvalSpec.of(e, gen)
                group, dispatch = eval_group(graph, e.model, asynchronous)
                key = str(data[e.data].options.get("prompt_key", "prompt"))
                rows, dropped = fitting(data_rows(data[e.data]), key, graph.model(e.model), spec, e.name)
                if dropped is not None:  # said now, as training's overlong prompts are
                    print(f"warning: {dropped}", file=sys.stderr, flush=True)
                # scorers of its own: an evaluation never shares a training reward's workers or error counts
                self.items.append(_Eval(e, spec, rows, key, make_scorer(reward, imports=graph.imports, folder=folder),
                                        extractor_for(reward.target, reward.kind), group, dispatch))
        except BaseException:
            self.close()
            raise

    def due(self, step: int) -> list[_Eval]:
        if step == 0:
            return [e for e in self.items if e.decl.at_start]
        return [e for e in self.items if (e.decl.every and step % e.decl.every == 0) or step == self.last]

    def run(self, step: int) -> EvalStep:
        out = EvalStep()
        for e in self.due(step):
            group = self.groups[e.group]

            def generate(prompts: Batch, attrs: dict[str, Any], seed: int, e: _Eval = e,
                         group: WorkerGroup = group) -> Batch:
                rollout: Batch = group.call("generate", e.decl.model, prompts, attrs, dispatch=e.dispatch,
                                            step_seed=seed).result()
                return rollout

            g0 = time.perf_counter()
            rollouts = generate_all(generate, e.rows, e.prompt_key, e.spec, eval_seed(self.seed, step, e.decl.name))
            s0 = time.perf_counter()
            got = outcome(rollouts, score_all(rollouts, e.scorer), e.decl.n, e.extractor, e.decl.data)
            s1 = time.perf_counter()
            name = f"eval/{e.decl.name}"
            out.metrics.update({f"{name}/{k}": v for k, v in got.metrics.items()})
            out.metrics[f"time/{name}"] = s1 - g0
            out.spans += [Span(name, EVAL_OP, e.group, step, g0 - self.t0, s0 - g0),
                          Span(f"{name}.score", EVAL_OP, "controller", step, s0 - self.t0, s1 - s0)]
            out.samples[e.decl.name] = got.samples
        return out

    def close(self) -> None:
        for e in self.items:
            e.scorer.close()
