"""A serverless worker group: its calls run as instance tasks (backends/serverless/instance.py), as many at once
as the planned call has shards, each holding a device slot only while it runs.

Split calls (generation, forwards) spread over up to `world` instances, the pool's upper size; an update runs
on one instance (data-parallel training needs a process group, which tasks do not form; said in `notes`).
Generation assigns prompts by predicted length (flowrl.elastic): the step's prompts sorted by their past
response lengths, contiguous runs to instances, so instances holding short work finish and release their slot
early; the rollout is put back in the prompts' order. The group's weights are versions in the object store:
an update's new state becomes the current version; `after_update` / `load_snapshot` hand a version to the
other groups holding the model (a reference, no copy: an instance loads it when it next needs it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from flowrl.backends.serverless.instance import SLOT, Build, remote_serve
from flowrl.elastic.assign import ranked_runs
from flowrl.elastic.predict import LengthPredictor
from flowrl.elastic.scale import DecodeCurve, ScaleChoice, choose_instances
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.protocol import Future

# Without `placement`, a group's calls count in one elastic pool per stage kind.
STAGE_KINDS = {"generate": "generation", "logprobs": "inference", "values": "inference", "score": "inference",
               "update": "training", "update_fused": "training"}
VERSIONS = itertools.count(1)  # version numbers, unique across groups (0: the weights built from the seed)


@dataclass(frozen=True)
class Usage:
    """One instance task: which pool, when it held its slot (wall clock), and how that time went."""

    pool: str  # the placement pool, or the stage kind (generation, inference, training) without one
    group: str
    pid: int
    began: float  # time.time() when the task started
    start_s: float  # building the models (a cold start; 0 when warm)
    load_s: float  # loading newer weights from the object store
    run_s: float  # the method itself
    cold: bool

    @property
    def held_s(self) -> float:
        return self.start_s + self.load_s + self.run_s


class ServerlessFuture:
    def __init__(self, group: ServerlessGroup, plan: dispatch.Plan, refs: list[list[ray.ObjectRef]],
                 order: list[int] | None, choice: ScaleChoice | None = None):
        self.group, self.plan, self.refs, self.order, self.choice = group, plan, refs, order, choice
        self.sent = time.perf_counter()

    def result(self) -> Any:
        return self.group.finish(self.plan, self.refs, self.order, self.choice, self.sent)


class ServerlessGroup:
    inline = False
    per_rank = False
    why_not_per_rank = ("serverless instances are tasks, one call each: a fused stage's rank-by-rank streams need "
                        "long-lived ranks (the ray backend)")

    def __init__(self, name: str, pool: str | None, build: Build, world: int, run_id: str, *, cpus: float = 1.0,
                 crash_on_call: tuple[str, int, str] | None = None, cost_weight: float = 0.5):
        self.name, self.pool, self.build, self.world = name, pool, build, world
        self.models = tuple(m.name for m in build.models)
        self.key = (run_id, name)
        self.cpus = cpus
        self.state: dict[str, tuple[int, list[Any]]] = {m: (0, []) for m in self.models}
        self.pads: dict[str, int] = {}
        self.usage: list[Usage] = []
        self.lengths = LengthPredictor()  # per prompt id: what its samples' response lengths were
        self.crash_on_call = crash_on_call  # tests: (method, n, marker file): its n-th call loses an instance
        self.calls: dict[str, int] = {}
        self.cost_weight = cost_weight  # run { cost_weight }: 1 buys the fastest generation, 0 the fewest device-s
        self.decode: dict[int, float] = {}  # measured seconds per decode step, by the samples an instance decodes
        self.overhead_s = 0.0  # a generation task's time beyond decoding (starting, loading, returning)
        self.metrics: dict[str, float] = {}  # the scaling decisions since last taken

    def start(self) -> None:
        """One instance builds the models once (the pool's first cold start) and tells their pad ids."""
        self.pads = {m: int(self.call("pad_id", m, dispatch="rank0").result()) for m in self.models}

    # ---- the WorkerGroup protocol --------------------------------------------------------------------
    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        mode = dispatch
        return self._call(method, args, mode, kwargs)

    def _call(self, method: str, args: tuple[Any, ...], mode: str, kwargs: dict[str, Any]) -> Future:
        world = 1 if method in dispatch.UPDATES else self.world
        order, choice = None, None
        if method == "generate" and world > 1 and args and isinstance(args[1], Batch):
            choice = self._scale(args[1], args[2] if len(args) > 2 else {})
            world = choice.chosen.instances if choice is not None else world
            args, order = self._ranked(args, world)
        plan = dispatch.plan(method, args, kwargs, mode, world)
        new = next(VERSIONS) if method in dispatch.UPDATES else 0
        wanted = {m: self.state[m] for m in self.models}
        self.calls[method] = self.calls.get(method, 0) + 1
        crash = self.crash_on_call
        marker = crash[2] if crash is not None and (crash[0], crash[1]) == (method, self.calls[method]) else None
        refs: list[list[ray.ObjectRef]] = [
            list(remote_serve.options(num_cpus=self.cpus, resources={SLOT: 1}, num_returns=3).remote(
                self.key, self.build, wanted, method, c.args, c.kwargs, new, marker if c.rank == 0 else None))
            for c in plan.calls]
        if method in dispatch.UPDATES:
            trained = [args[0]] if isinstance(args[0], str) else list(args[0])
            for m in trained:  # the new version: the update's third result ({model: state}), kept in the store
                self.state[m] = (new, [refs[0][2], m])
        return ServerlessFuture(self, plan, refs, order, choice)

    def finish(self, plan: dispatch.Plan, refs: list[list[ray.ObjectRef]], order: list[int] | None,
               choice: ScaleChoice | None = None, sent: float = 0.0) -> Any:
        results = ray.get([r[0] for r in refs])
        used = [Usage(self.pool_of(plan.method), self.name, int(st["pid"]), float(st["began"]), float(st["start_s"]),
                      float(st["load_s"]), float(st["run_s"]), bool(st["cold"])) for st in ray.get([r[1] for r in refs])]
        self.usage.extend(used)
        if plan.method == "generate":
            self._measure(results, used, choice, time.perf_counter() - sent)
        model = plan.calls[0].args[0] if plan.calls[0].args else None
        merged = dispatch.merge(plan, results, self.pads.get(model, 0) if isinstance(model, str) else 0)
        if plan.method == "generate" and isinstance(merged, Batch):
            merged = self._learn_and_restore(merged, order)
        return merged

    def pool_of(self, method: str) -> str:
        """The pool a call's instances count in: the group's `placement` pool, else its stage kind."""
        if self.pool is not None:
            return self.pool
        return STAGE_KINDS.get(method, "setup")  # start-up (the first instance's build) and checkpoints

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(self.why_not_per_rank)

    def colocated(self, models: Sequence[str]) -> bool:
        return all(m in self.models for m in models)  # an instance builds all of its group's models

    def recover(self) -> None:
        pass  # nothing long-lived to bring back: the next task starts on any process

    def state_dict(self) -> dict[str, Any]:
        return dict(self.call("state_dict", dispatch="rank0").result())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for m, s in state.items():
            if m in self.state:
                self.state[m] = (next(VERSIONS), [ray.put(s)])

    # ---- cost-aware instance count ---------------------------------------------------------------------
    def _scale(self, prompts: Batch, attrs: Mapping[str, Any]) -> ScaleChoice | None:
        """How many instances generate this step: flowrl.elastic's argmin of cost_weight * T(N) / T_ref +
        (1 - cost_weight) * C(N) / C_ref over N = 1..world, from the prompts' predicted lengths and this run's
        measured seconds per decode step. None (all `world`) until a first generation was measured."""
        if not self.decode:
            return None
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        predicted = self.lengths.predict(ids, fallback=0.0)
        samples = int(str(attrs.get("n", 1))) if isinstance(attrs, Mapping) else 1
        return choose_instances(predicted, samples, range(1, self.world + 1), DecodeCurve(self.decode),
                                self.cost_weight, start_s=self.overhead_s,
                                profiles=self.lengths.predict_profiles(ids, samples, fallback=0.0))

    def _measure(self, results: Sequence[Any], used: Sequence[Usage], choice: ScaleChoice | None,
                 wall_s: float) -> None:
        """Learn seconds per decode step (by the samples an instance decoded) and the tasks' overhead from this
        generation; log the choice and its predicted vs measured time and device-seconds."""
        for out, u in zip(results, used, strict=True):
            if isinstance(out, Batch) and out.size and "response_mask" in out.tensors:
                steps = max(1, int(out["response_mask"].sum(1).max()))
                per_step = u.run_s / steps
                old = self.decode.get(out.size)
                self.decode[out.size] = per_step if old is None else 0.5 * old + 0.5 * per_step
        self.overhead_s = sum(u.held_s - u.run_s for u in used if not u.cold) / max(1, sum(not u.cold for u in used))
        g = f"scale/{self.name}/"
        self.metrics[g + "instances"] = float(len(used))
        self.metrics[g + "measured_T_s"] = wall_s
        self.metrics[g + "measured_C_s"] = sum(u.held_s for u in used)
        if choice is not None:
            self.metrics[g + "predicted_T_s"] = choice.chosen.time_s
            self.metrics[g + "predicted_C_s"] = choice.chosen.device_s
            for c in choice.candidates:
                self.metrics[f"{g}T_s@{c.instances}"] = c.time_s
                self.metrics[f"{g}C_s@{c.instances}"] = c.device_s

    def take_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out

    # ---- length-ranked assignment ----------------------------------------------------------------------
    def _ranked(self, args: tuple[Any, ...], instances: int) -> tuple[tuple[Any, ...], list[int]]:
        """The prompts reordered by predicted response length (shortest first), so each instance's contiguous
        shard holds prompts of similar length; `order[i]` is the original position of the i-th prompt."""
        prompts: Batch = args[1]
        ids = [int(i) for i in prompts.meta.get("prompt_id", range(prompts.size))]
        predicted = self.lengths.predict(ids, fallback=0.0)
        runs = ranked_runs(predicted, instances)
        order = [i for run in runs for i in run]
        return (args[0], prompts.select(order), *args[2:]), order

    def _learn_and_restore(self, rollout: Batch, order: list[int] | None) -> Batch:
        """The rollout in the prompts' own order (each sample's group id names its prompt there again), and the
        predictor taught this step's lengths."""
        if order is not None and "group_id" in rollout.tensors:
            original = torch.tensor(order)[rollout["group_id"].long()]
            rows = sorted(range(rollout.size), key=lambda i: (int(original[i]), i))
            rollout = rollout.select(rows)
            rollout.tensors["group_id"] = original[torch.tensor(rows)]
        ids = rollout.meta.get("prompt_id")
        if ids is not None:
            lengths = rollout["response_mask"].sum(1).tolist()
            self.lengths.observe([int(i) for i in ids], [float(x) for x in lengths])
        return rollout

    def take_usage(self) -> list[Usage]:
        out, self.usage = self.usage, []
        return out
