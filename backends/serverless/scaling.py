"""A serverless pool's instance count and prompt assignment for a generation, and what it measures to decide.

A generation's decisions are flowrl.elastic's `plan_generation`, the call the simulator makes
(backends/sim/rlhfless.py): the cost-aware instance count (`choose_instances`) from the prompts' predicted
response lengths (`predictions`: flowrl.elastic.predict, taught every step's lengths) and this run's measured
seconds per decode step (`learn_decode`) and task overhead (`start_overhead`); the prompts go to instances by
predicted length (flowrl.elastic.assign: sorted shortest first, contiguous runs to instances, so instances
holding short work finish and release their slot early); the migration sink (`migration_sink`). The rollout is
put back in the prompts' order. A forward's instance count takes the same cost rule from its measured time per
row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.elastic.env_wait import MIN_HISTORY
from flowrl.elastic.late import LATE_SHARE
from flowrl.elastic.plan import GenerationPlan, learn_decode, plan_generation, predictions, start_overhead
from flowrl.elastic.predict import LengthPredictor
from flowrl.elastic.scale import DecodeCurve, ScaleChoice, choose_instances
from flowrl.runtime.batch import Batch
from flowrl.runtime.protocol import Usage


@dataclass(frozen=True)
class Policy:
    """A pool's elastic policy (`run { cost_weight, prewarm, prewarm_margin, migrate_at, dedup_prefill }`);
    `predict`, `assign` and `scale` switch mechanisms off one at a time for the ablation (bench/serverless.py)."""

    cost_weight: float = 0.5  # 1 buys the fastest generation, 0 the fewest device-seconds
    prewarm: bool = True
    margin_s: float = 0.05
    tau: float = 0.7  # cut-and-migrate once this fraction of an instance's sequences finished (1: never)
    predict: bool = True  # per-prompt length prediction (off: every prompt predicted at the last batch mean)
    assign: bool = True  # length-ranked assignment (off: prompts in their data order)
    scale: bool = True  # the cost-aware instance count (off: the pool's upper size)
    dedup: str = "auto"  # deduplicated prefill: auto | handover | local | off (backends/serverless/prefill.py)
    # a fused stage's forward instances start this share of their learned slack after the first chunk (0: with
    # it): what they would have spent waiting for chunks, slot held, while generation goes on (group.stream_stage)
    late: float = LATE_SHARE  # flowrl.elastic.late
    # a multi-turn generation's instance gives its device back while every live trajectory waits on environments
    # predicted to answer later than releasing and re-acquiring costs (env_release.py; flowrl.elastic.env_wait):
    # that cost in seconds (None: the pool's measured warm-task overhead), and the latencies seen before any release
    env_release: bool = True
    env_release_s: float | None = None
    env_min_history: int = MIN_HISTORY


def in_order(out: Batch, rows: list[int] | None, order: list[int] | None) -> Batch:
    """A forward's output over a ranked rollout, in the prompts' own order (as the rollout is put back)."""
    if rows is None or order is None:
        return out
    back = out.select(rows)
    if "group_id" in back.tensors:
        back.tensors["group_id"] = torch.tensor(order)[back["group_id"].long()]
    return back


class Scaler:
    """One pool's generation scaling: its length history, its measured decode curve and task overhead."""

    def __init__(self, name: str, world: int, policy: Policy):
        self.name, self.world, self.policy = name, world, policy
        self.lengths = LengthPredictor()  # per prompt id: what its samples' response lengths were
        self.decode: dict[int, float] = {}  # measured seconds per decode step, by the samples an instance decodes
        self.overhead_s = 0.0  # a generation task's time beyond decoding (starting, loading, returning)
        self.per_row: dict[str, float] = {}  # a forward method's measured seconds per row (sample)
        self.call_overhead: dict[str, float] = {}  # its tasks' time beyond the method (warm starts)

    def shards(self, args: tuple[Any, ...], limit: int | None = None
               ) -> tuple[tuple[Any, ...], int, list[int] | None, GenerationPlan]:
        """A generation's (model, prompts, attrs) over this pool, as flowrl.elastic's `plan_generation` decides
        it (the simulator's call) among 1..min(world, limit) instances (`limit`: the instances that can run at once
        when they wait on one another) -> (args with the prompts in the plan's order, the instance count, the
        ranked order or None, the plan: its cost-aware choice and migration sink). `order[i]` is the original
        position of the i-th prompt; each instance's contiguous shard (`dispatch.plan`) is one of the plan's runs."""
        world = self.world if limit is None else max(1, min(self.world, limit))
        prompts: Batch = args[1]
        attrs = args[2] if len(args) > 2 else {}
        samples = int(str(attrs.get("n", 1))) if isinstance(attrs, Mapping) else 1
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        predicted, profiles = predictions(self.lengths, ids, samples, self.policy.predict)
        p = self.policy
        plan = plan_generation(predicted, samples, world, self.decode, self.overhead_s, p.cost_weight, p.tau,
                               profiles, assign=p.assign, scale=p.scale)
        order = None
        if plan.ranked:
            order = [i for run in plan.runs for i in run]
            args = (args[0], prompts.select(order), *args[2:])
        return args, max(1, plan.instances), order, plan

    def measure(self, results: Sequence[Any], used: Sequence[Usage], choice: ScaleChoice | None,
                wall_s: float) -> dict[str, float]:
        """Learn seconds per decode step (by the samples an instance decoded) and the tasks' overhead from this
        generation -> the metrics: the choice and its predicted vs measured time and device-seconds."""
        self.decode = learn_decode(self.decode, [
            (out.size, int(out["response_mask"].sum(1).max()), u.run_s) for out, u in zip(results, used, strict=True)
            if isinstance(out, Batch) and out.size and "response_mask" in out.tensors])
        self.overhead_s = start_overhead([(u.held_s - u.run_s, u.cold) for u in used])
        g = f"scale/{self.name}/"
        metrics = {g + "instances": float(len(used)), g + "measured_T_s": wall_s,
                   g + "measured_C_s": sum(u.held_s for u in used)}
        if choice is not None:
            metrics[g + "predicted_T_s"] = choice.chosen.time_s
            metrics[g + "predicted_C_s"] = choice.chosen.device_s
            for c in choice.candidates:
                metrics[f"{g}T_s@{c.instances}"] = c.time_s
                metrics[f"{g}C_s@{c.instances}"] = c.device_s
        return metrics

    def forward(self, method: str, rows: int, limit: int | None = None) -> tuple[int, ScaleChoice | None]:
        """A split call that is not a generation (a forward over a rollout): its instance count by the same cost
        rule, from this method's measured seconds per row (an instance's time is its rows times that, plus the
        tasks' measured overhead) -> (instances, the choice); 1 until the method was measured, never more than
        the pool's upper size or the rows."""
        top = min(self.world if limit is None else max(1, min(self.world, limit)), max(1, rows))
        per = self.per_row.get(method)
        if not self.policy.scale or top < 2:  # the count switched off (ablation): the upper size, as it was
            return top, None
        if per is None:
            return 1, None
        curve = DecodeCurve({1: per, 2: 2 * per})  # rows run together cost each row's time: linear
        choice = choose_instances([1.0] * rows, 1, range(1, top + 1), curve, self.policy.cost_weight,
                                  start_s=self.call_overhead.get(method, 0.0))
        return choice.chosen.instances, choice

    def learn_forward(self, method: str, rows: Sequence[int], used: Sequence[Usage]) -> dict[str, float]:
        """What a forward's instances measured (seconds per row, overhead) -> its metrics."""
        ran = sum(u.run_s for u in used)
        if sum(rows) and ran > 0:
            per = ran / sum(rows)
            old = self.per_row.get(method)
            self.per_row[method] = per if old is None else 0.5 * old + 0.5 * per
        warm = [u.held_s - u.run_s for u in used if not u.cold]
        if warm:
            self.call_overhead[method] = sum(warm) / len(warm)
        return {f"scale/{self.name}/{method}_instances": float(len(used))}

    def restore_rows(self, rollout: Batch, order: list[int] | None) -> list[int] | None:
        """The row order `learn_and_restore` puts a ranked rollout back in (None: not ranked)."""
        if order is None or "group_id" not in rollout.tensors:
            return None
        original = torch.tensor(order)[rollout["group_id"].long()]
        return sorted(range(rollout.size), key=lambda i: (int(original[i]), i))

    def learn_and_restore(self, rollout: Batch, order: list[int] | None) -> Batch:
        """The rollout in the prompts' own order (each sample's group id names its prompt there again), and the
        predictor taught this step's lengths."""
        rollout = in_order(rollout, self.restore_rows(rollout, order), order)
        ids = rollout.meta.get("prompt_id")
        if ids is not None:
            lengths = rollout["response_mask"].sum(1).tolist()
            self.lengths.observe([int(i) for i in ids], [float(x) for x in lengths])
        return rollout
