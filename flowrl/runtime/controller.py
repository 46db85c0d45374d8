"""The single controller: walks the compiled graph once per step, sending each model call to its worker
group and running data, reward and step-function nodes itself. Every node is timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.data.jsonl import PromptLoader
from flowrl.data.tables import is_chat, prompt_plain
from flowrl.errors import Diagnostic, ExecutionError, FlowError, user_frame_hint
from flowrl.ir.graph import Graph, Node
from flowrl.runtime import interrupt
from flowrl.runtime.batch import Batch, training_batch
from flowrl.runtime.functions import call_function, trajectory_returns
from flowrl.runtime.fusion import StageRun, run_stage
from flowrl.runtime.lengths import LengthTracker
from flowrl.runtime.preference_update import EVAL_REF, held_out_forward
from flowrl.runtime.protocol import RankLostError, WorkerGroup
from flowrl.runtime.refill import is_filter, run_filter, starved
from flowrl.runtime.scoring import Scorer
from flowrl.runtime.shaping import response_metrics, shaped_scores

MAX_STAGE_RETRIES = 3  # a fused stage re-run after lost ranks: a rank that keeps dying is a bug, not bad luck


@dataclass(frozen=True)
class Span:
    """One node's execution, for trace.json and the timeline."""

    node: str
    op: str
    group: str
    step: int
    start: float  # seconds since the run started
    dur: float


@dataclass
class StepResult:
    metrics: dict[str, float]
    spans: list[Span] = field(default_factory=list)
    values: dict[str, Batch] = field(default_factory=dict)
    lengths: list[dict[str, Any]] = field(default_factory=list)  # the step's rows of lengths.jsonl


class Controller:
    """Drives the iteration. It moves batches and futures between worker groups and never looks into
    model weights; all tensor math it does itself is the cheap per-sample kind (advantages, rewards)."""

    def __init__(self, graph: Graph, groups: Mapping[str, WorkerGroup], loaders: Mapping[str, PromptLoader],
                 rewards: Mapping[str, Scorer], *, seed: int, clock_start: float | None = None,
                 after_update: Callable[[str, str], float] | None = None):
        self.graph, self.groups, self.loaders, self.rewards = graph, dict(groups), dict(loaders), dict(rewards)
        self.seed = seed
        self.t0 = clock_start if clock_start is not None else time.perf_counter()
        self.after_update = after_update  # the backend's weight-sync hook (split placement), if it has one
        self.declined: dict[str, str] = {}  # fused stages this backend runs unfused: node id -> why
        self.lengths = LengthTracker(graph)  # how well response lengths were predicted (checkpointed)
        self.own_sync: set[str] = set()  # models whose weight sync the caller drives (an asynchronous run's)
        self.step_now = 0  # the step run_nodes runs (a held-out evaluation's `eval_every` counts it)
        self.last_step: int | None = None  # the run's last step, which evaluates held-out rows whatever `eval_every`
        self.held_out_ref: dict[str, torch.Tensor] = {}  # a frozen reference's log-probs of held-out rows, by node
        self.drawing = threading.local()  # `.round`: the refill draw the calling thread runs (flowrl.runtime.refill)

    def step_seed(self, step: int, node: Node) -> int:
        # A seed per (step, refill draw, node) makes a resumed run draw the same samples as an uninterrupted one.
        draw = getattr(self.drawing, "round", 0)
        return (self.seed * 7_919 + step * 104_729 + draw * 1_299_709 + sum(map(ord, node.id))) % (2**31)

    def run_round(self, nodes: Sequence[Node], step: int, round: int) -> tuple[dict[str, Batch], StepResult]:
        """Dynamic sampling's draw `round` (1, 2, ...) of step `step`: `nodes` (a filter's loop) run again on fresh
        values, with that draw's seeds; their values, spans and metrics (flowrl.runtime.refill)."""
        values: dict[str, Batch] = {}
        result = StepResult({})
        with self._drawing(round):
            self.run_nodes(nodes, values, step, result)
        return values, result

    @contextmanager
    def _drawing(self, round: int) -> Iterator[None]:
        self.drawing.round = round
        try:
            yield
        finally:
            self.drawing.round = 0

    def step(self, step: int) -> StepResult:
        values: dict[str, Batch] = {}
        result = StepResult({})
        self.run_nodes(self.graph.nodes, values, step, result)
        self.finish(step, values, result)
        return result

    def run_nodes(self, nodes: Sequence[Node], values: dict[str, Batch], step: int, result: StepResult) -> None:
        """Run `nodes` (in schedule order; a fused stage's members all run when its first is reached) on
        `values`, adding their outputs to it and their spans and metrics to `result`."""
        finished: set[str] = set()
        self.step_now = step
        for node in nodes:
            if node.id in finished:  # already ran as a member of a fused stage
                continue
            skipped = starved(self.graph, node, values)  # it reads no samples: a filter kept no group
            if skipped:
                finished.update(n.id for n in skipped)
                values.update({n.id: Batch(0) for n in skipped if n.op != "update"})
                continue
            start = time.perf_counter()
            try:
                if node.attrs.get("fusion"):  # a fused stage (passes fuse-*): all its members run now
                    ran = self._stage(node, values, step, result.metrics)
                elif is_filter(node):  # dynamic sampling: it may draw more prompts (flowrl.runtime.refill)
                    ran = [StageRun(node, run_filter(self, node, values, step, result), start, None)]
                else:
                    ran = [StageRun(node, self.run_node(node, values, step, result.metrics), start, None)]
            except FlowError as e:
                raise type(e)([_context(node, self.graph.path), *e.diagnostics]) from None
            except Exception as e:
                raise ExecutionError([_context(node, self.graph.path, e)]) from e
            end = time.perf_counter()
            for r in ran:
                finished.add(r.node.id)
                if r.out is not None:
                    values[r.node.id] = r.out
                dur = (r.end if r.end is not None else end) - r.start
                result.spans.append(Span(r.node.id, r.node.op, r.node.worker_group, step, r.start - self.t0, dur))
                result.metrics[f"time/{r.node.id}"] = dur
            self._sync_weights(ran, step, result)

    def finish(self, step: int, values: dict[str, Batch], result: StepResult, *, counts: bool = True) -> None:
        """The step's summary metrics and lengths trace, once all its nodes ran; `counts`: also what the rewards'
        `on_error = "zero"` absorbed since last taken (an asynchronous run takes them with each rollout)."""
        result.metrics.update(_summary(self.graph, values))
        lengths, result.lengths = self.lengths.record(values, step)
        result.metrics.update(lengths)
        if counts:
            result.metrics.update(self.reward_counts())
        result.values = values

    def reward_counts(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for scorer in self.rewards.values():
            if scorer.overlaps or scorer.on_error == "zero":  # what `on_error = "zero"` absorbed
                out.update(scorer.take_counts())
            else:  # an inline reward that fails the step on error: only the notes its values carry
                out.update(scorer.take_counts(notes_only=True))
        return out

    def _stage(self, node: Node, values: dict[str, Batch], step: int, metrics: dict[str, float]) -> list[StageRun]:
        """A fused stage; a rank lost during it (rank-by-rank calls are not re-sent by their group, as a plain
        call is) is brought back with the weights it held and the stage runs again from its start with the same
        seeds, so the step ends with the numbers it would have had (counted in `fault/stage_retries`)."""
        for attempt in range(MAX_STAGE_RETRIES + 1):
            try:
                return run_stage(self, node, values, step, metrics)
            except RankLostError as lost:
                interrupt.check()  # a rank Ctrl-C killed is not brought back
                if attempt == MAX_STAGE_RETRIES:
                    raise
                group = self.groups.get(str(lost.group))
                for g in [group] if group is not None else self.groups.values():
                    g.recover()
                metrics["fault/stage_retries"] = metrics.get("fault/stage_retries", 0.0) + 1.0
        raise AssertionError("unreachable")

    def decline(self, node: Node, reason: str) -> None:
        """A fused stage that runs unfused on this backend, and why (said once per run, in run.json's notes)."""
        self.declined.setdefault(node.id, reason)

    def _sync_weights(self, ran: list[StageRun], step: int, result: StepResult) -> None:
        """Split placement: after an update the backend sends the new weights to the other groups that hold the
        model (`after_update` returns the seconds taken, 0.0 when no other group does); timed as `sync.MODEL`."""
        if self.after_update is None:
            return
        for r in ran:
            if r.node.op != "update" or r.node.model is None or r.node.model in self.own_sync:
                continue
            start = time.perf_counter()
            try:
                took = self.after_update(r.node.model, r.node.worker_group)
            except FlowError as e:
                raise type(e)([_context(r.node, self.graph.path), *e.diagnostics]) from None
            except Exception as e:
                raise ExecutionError([_context(r.node, self.graph.path, e)]) from e
            if took > 0:
                name = f"sync.{r.node.model}"
                result.spans.append(Span(name, "sync", r.node.worker_group, step, start - self.t0,
                                         time.perf_counter() - start))
                result.metrics[f"time/{name}"] = took

    def run_node(self, node: Node, values: dict[str, Batch], step: int, metrics: dict[str, float]) -> Batch | None:
        """Run one node (not fused) and return its output (None for an update)."""
        inputs = {param: values[src] for param, src in node.inputs}
        attrs = dict(node.attrs)
        if node.op == "data":
            return _prompt_batch(self.loaders[node.id])
        if node.op == "reward":
            name = str(attrs["fn"])
            return shaped_scores(self.graph, node, inputs["rollout"], self.rewards[name].score(inputs["rollout"]))
        if node.op == "fn":
            return call_function(str(attrs["fn"]), inputs, attrs)
        group = self.groups[node.worker_group]
        if node.op == "generate":
            fut = group.call("generate", node.model, inputs["prompts"], attrs, dispatch=node.dispatch,
                             step_seed=self.step_seed(step, node))
            return fut.result()
        if node.op in ("logprobs", "values", "score"):
            return group.call(node.op, node.model, inputs["rollout"], attrs,
                              dispatch=node.dispatch).result()
        if node.op == "update":
            batch = training_batch(inputs, mask_truncated=bool(attrs.get("mask_truncated")))
            out = group.call("update", node.model, batch, attrs, dispatch=node.dispatch,
                             step_seed=self.step_seed(step, node)).result()
            self.record_update(node, out, metrics)
            return None
        raise ValueError(f"unknown op {node.op!r}")

    def held_out_metrics(self, node: Node) -> dict[str, float]:
        """A preference update on data with `held_out` rows, every `eval_every` steps and at the run's last step (a
        short run evaluates too): the model scores those rows after its step (the worker's `evaluate`; DPO against
        its reference's log-probs of them, computed once while the reference is frozen; SFT their responses' NLL).
        Its metrics, as the update's (`eval_accuracy`, `eval/...`, `eval/sft_loss`)."""
        loader = self.loaders.get(str(node.input("rollout")))
        every = int(str(node.attrs.get("eval_every", 1) or 0))
        due = every > 0 and (self.step_now % every == 0 or self.step_now == self.last_step)
        if loader is None or not loader.held_out or not due:
            return {}
        if node.attrs.get("loss") not in ("dpo", "bradley_terry", "sft"):
            return {}
        rows = _prompt_batch(PromptLoader(loader.held_out, len(loader.held_out), False, 0, loader.prompt_key))
        attrs: dict[str, Any] = dict(node.attrs)
        ref = node.input("ref_logp")
        if ref is not None and self.graph.has_node(ref):
            fwd = self.graph.node(ref)
            cached = self.held_out_ref.get(fwd.id)
            if cached is None:
                cached = self.groups[fwd.worker_group].call("logprobs", fwd.model, rows, held_out_forward(fwd.attrs),
                                                            dispatch=fwd.dispatch).result()["logp"]
                if not self.graph.model(str(fwd.model)).trainable:
                    self.held_out_ref[fwd.id] = cached
            attrs[EVAL_REF] = cached
        out: dict[str, float] = self.groups[node.worker_group].call("evaluate", node.model, rows, attrs,
                                                                    dispatch="rank0").result()
        return out

    def record_update(self, node: Node, out: Mapping[str, float], metrics: dict[str, float]) -> None:
        out = {**out, **self.held_out_metrics(node)}
        metrics.update({f"{node.model}/{k}": float(v) for k, v in out.items()})
        if self.graph.model(str(node.model)).role == "policy" and "loss" in out:
            metrics["loss"] = float(out["loss"])
        if "kl_mean" in out and "kl_mean" not in metrics:  # measured by the update (pass on-policy-logp)
            metrics["kl_mean"] = float(out["kl_mean"])


def _prompt_batch(loader: PromptLoader) -> Batch:
    picked = loader.next_batch()
    prompts = [row.get(loader.prompt_key, "") for _, row in picked]
    meta: dict[str, list[Any]] = {
        # chat prompts as text in the tiny template (what rewards and logs read)
        "prompt": [prompt_plain(p) for p in prompts],
        "row": [row for _, row in picked],
        "prompt_id": [i for i, _ in picked],
        "prompt_slot": list(range(len(picked))),  # what its samples' random streams are keyed by (worker.py)
    }
    if any(is_chat(p) for p in prompts):  # the generating worker renders these with its model's chat template
        meta["messages"] = [p if is_chat(p) else None for p in prompts]
    return Batch(len(picked), {}, meta)


def _summary(graph: Graph, values: Mapping[str, Batch]) -> dict[str, float]:
    """The per-step metrics every run reports (reward, lengths, KL to the reference). `reward_mean` (the headline
    the progress bar shows) is what the policy optimises: the first reward's score plus the environment's return
    (each part also as `reward/NAME` and `env/return_mean`)."""
    out: dict[str, float] = {}
    rollout = step_rollout(graph, values)
    if rollout is not None:
        # generated tokens: a rollout from an environment also holds observation tokens, which are not generated
        lens = rollout["loss_mask" if "loss_mask" in rollout.tensors else "response_mask"].sum(1).float()
        out["response_len_mean"] = float(lens.mean())
        out["gen_tokens"] = float(lens.sum())
        if "env_turns" in rollout.tensors:
            out.update(env_metrics(rollout))
        out.update(response_metrics(graph, rollout, values))  # response/clip_ratio, the overlong penalty
    for n in graph.nodes:
        if n.op in ("reward", "score") and n.id in values:
            out[f"reward/{n.id}"] = float(values[n.id]["scores"].mean())
    headline = step_returns(graph, values)
    if headline is not None:  # (B,)
        out["reward_mean"] = float(headline.mean())
        out["reward_std"] = float(headline.std()) if headline.numel() > 1 else 0.0
    for n in graph.nodes:
        old, ref = n.input("old_logp"), n.input("ref_logp")
        if n.op == "update" and old is not None and ref is not None and old in values and ref in values \
                and values[old].size:  # (a step that trained nothing: empty, flowrl.runtime.refill)
            trained = "loss_mask" if "loss_mask" in values[old].tensors else "response_mask"
            mask = values[old][trained].float()
            diff = (values[old].value("logp") - values[ref].value("logp")) * mask
            out["kl_mean"] = float(diff.sum() / mask.sum().clamp(min=1))
            break
    return out


def step_rollout(graph: Graph, values: Mapping[str, Batch]) -> Batch | None:
    """The step's rollout: the first generate node's output, if the step generated."""
    return next((values[n.id] for n in graph.nodes if n.op == "generate" and n.id in values), None)


def step_returns(graph: Graph, values: Mapping[str, Batch]) -> torch.Tensor | None:
    """What the policy optimises, per trajectory (B,): the first reward's score plus the environment's return where
    the rollout had one, as the advantages add them (`functions.trajectory_returns`); the environment's return
    alone when no reward was declared; None for a step that scored nothing. A reward model's scores may not carry
    `env_return`: the rollout's is the same samples' then."""
    rollout = step_rollout(graph, values)
    scores = next((values[n.id] for n in graph.nodes if n.op in ("reward", "score") and n.id in values), None)
    env = rollout.tensors.get("env_return") if rollout is not None else None
    if scores is None:
        return env.float() if env is not None else None
    if "env_return" not in scores.tensors and env is not None and env.shape[0] == scores.size:
        return scores["scores"].float() + env.float()
    return trajectory_returns(scores)


def env_metrics(rollout: Batch) -> dict[str, float]:
    """A rollout generated with an environment (issue 26's batch contract): turns, the environment's calls'
    seconds (p50, p99), errors and timeouts, tool calls per trajectory, return, prefilled tokens per trajectory,
    the fraction of the generation call spent with nothing to decode while environments were pending, and those
    seconds (device-seconds held waiting on environments: `cost/env_wait_held_s`)."""
    seconds = torch.tensor([s for row in rollout.meta.get("env_step_s", []) for s in row], dtype=torch.float64)
    wall = float(rollout["gen_wall_s"].sum())
    return {
        "env/turns_mean": float(rollout["env_turns"].float().mean()),
        "env/step_s_p50": float(seconds.quantile(0.5)) if seconds.numel() else 0.0,
        "env/step_s_p99": float(seconds.quantile(0.99)) if seconds.numel() else 0.0,
        "env/errors": float(rollout["env_errors"].sum()),
        "env/timeouts": float(rollout["env_timeouts"].sum()),
        "env/tool_calls_mean": float(rollout["env_calls"].float().mean()),
        "env/idle_frac": float(rollout["gen_idle_s"].sum()) / wall if wall > 0 else 0.0,
        # device-seconds held with nothing to do while environments were pending (each rank's loop counts its own)
        "cost/env_wait_held_s": float(rollout["gen_idle_s"].sum()),
        "env/return_mean": float(rollout["env_return"].float().mean()),
        "env/prefill_tokens_mean": float(rollout["prefill_tokens"].float().mean()),
    }


def _context(node: Node, flow_path: str, error: BaseException | None = None) -> Diagnostic:
    """'while executing old_logp = actor.logprobs(rollout)  # grpo.flow:14' plus the failing frame."""
    where = f"{node.loc.path}:{node.loc.line}"
    if node.via is not None:  # a template's line: also the user's line that used the template
        where += f", used at {node.via.path}:{node.via.line}"
    statement = " ".join((node.text or node.id).split())  # one line, alignment spaces folded
    message = f"while executing {statement}  # {where}"
    hint = None
    if error is not None:
        message += f": {type(error).__name__}: {error}"
        hint = user_frame_hint(error.__traceback__)  # the user's code that raised, never a flowrl path
    return Diagnostic(message, hint=hint)
