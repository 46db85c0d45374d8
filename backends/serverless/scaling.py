"""A serverless pool's instance count and prompt assignment for a generation, and what it measures to decide.

How many instances generate a step is flowrl.elastic's cost-aware choice (`choose_instances`), from the
prompts' predicted response lengths (flowrl.elastic.predict, taught every step's lengths) and this run's
measured seconds per decode step; the prompts go to instances by predicted length (flowrl.elastic.assign):
sorted shortest first, contiguous runs to instances, so instances holding short work finish and release their
slot early. The rollout is put back in the prompts' order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.elastic.assign import ranked_runs
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

    def shards(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], int, list[int] | None, ScaleChoice | None]:
        """A generation's (model, prompts, attrs) over this pool: the instance count (the cost-aware choice),
        the prompts in length-ranked order -> (args, instances, the ranked order or None, the choice or None)."""
        world, order, choice = self.world, None, None
        if world > 1:
            choice = self.scale(args[1], args[2] if len(args) > 2 else {})
            world = choice.chosen.instances if choice is not None else world
            if self.policy.assign:
                args, order = self.ranked(args, world)
        return args, world, order, choice

    def scale(self, prompts: Batch, attrs: Mapping[str, Any]) -> ScaleChoice | None:
        """How many instances generate this step: flowrl.elastic's argmin of cost_weight * T(N) / T_ref +
        (1 - cost_weight) * C(N) / C_ref over N = 1..world, from the prompts' predicted lengths and this run's
        measured seconds per decode step. None (all `world`) until a first generation was measured."""
        if not self.decode or not self.policy.scale:
            return None
        predicted = self.predicted(prompts)
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        samples = int(str(attrs.get("n", 1))) if isinstance(attrs, Mapping) else 1
        return choose_instances(predicted, samples, range(1, self.world + 1), DecodeCurve(self.decode),
                                self.policy.cost_weight, start_s=self.overhead_s,
                                profiles=self.lengths.predict_profiles(ids, samples, fallback=0.0)
                                if self.policy.predict else None)

    def measure(self, results: Sequence[Any], used: Sequence[Usage], choice: ScaleChoice | None,
                wall_s: float) -> dict[str, float]:
        """Learn seconds per decode step (by the samples an instance decoded) and the tasks' overhead from this
        generation -> the metrics: the choice and its predicted vs measured time and device-seconds."""
        for out, u in zip(results, used, strict=True):
            if isinstance(out, Batch) and out.size and "response_mask" in out.tensors:
                steps = max(1, int(out["response_mask"].sum(1).max()))
                per_step = u.run_s / steps
                old = self.decode.get(out.size)
                self.decode[out.size] = per_step if old is None else 0.5 * old + 0.5 * per_step
        self.overhead_s = sum(u.held_s - u.run_s for u in used if not u.cold) / max(1, sum(not u.cold for u in used))
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

    def ranked(self, args: tuple[Any, ...], instances: int) -> tuple[tuple[Any, ...], list[int]]:
        """The prompts reordered by predicted response length (shortest first), so each instance's contiguous
        shard holds prompts of similar length; `order[i]` is the original position of the i-th prompt."""
        prompts: Batch = args[1]
        runs = ranked_runs(self.predicted(prompts), instances)
        order = [i for run in runs for i in run]
        return (args[0], prompts.select(order), *args[2:]), order

    def predicted(self, prompts: Batch) -> list[float]:
        """Each prompt's predicted response length (without prediction: the last batch's mean for all)."""
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        if not self.policy.predict:
            return [self.lengths.mean] * len(ids)
        return self.lengths.predict(ids, fallback=0.0)

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
