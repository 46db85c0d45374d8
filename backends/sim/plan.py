"""`flowrl plan`: the best per-stage plans for a flow on a described cluster (flowrl.backends.sim).

The plan space, searched exhaustively (it is small once memory prunes it):
- devices used: the cluster's, or a half, a quarter, ... of it (fewer devices can cost less);
- placement: every model on every device (`colocated`: the stages take turns), or a rollout pool of R devices
  for generation and a train pool of the rest for forwards and updates (`split`, R in whole nodes or, within
  one node, powers of two);
- generation: devices per instance (tensor parallel 1, 2, 4, 8 within a node; instances hold the weights and
  at least a batch's share of KV cache);
- each trained model: tensor parallel (within a node), pipeline stages and micro-batches, data parallel the
  rest of its pool, under the device's memory (`CostModel.train_memory`);
- forwards run data parallel over their pool with the update's tp x pp.
Each plan is timed with the simulator's cost model on the workload's first step: generation by the analytic
decode of each instance's samples (flowrl.elastic's `decode_seconds` over the cost model's per-iteration
curve), forwards and updates by `CostModel`. A synchronous step: generation, then forwards, then updates, plus
the weight sync. `--objective cost` ranks by device-seconds (fixed pools: all devices the whole step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flowrl.backends.sim.costs import CostModel, Row
from flowrl.backends.sim.policies import rows_of, seqs_of
from flowrl.backends.sim.work import FlowWork
from flowrl.backends.sim.workload import Step
from flowrl.elastic import DecodeCurve
from flowrl.elastic.scale import decode_seconds
from flowrl.errors import Diagnostic, FlowError

TPS = (1, 2, 4, 8)
PPS = (1, 2, 4, 8, 16)
MICROS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class TrainPlan:
    model: str
    tp: int
    pp: int
    dp: int
    micro: int
    time_s: float


@dataclass(frozen=True)
class Plan:
    placement: str  # colocated | split
    devices: int  # used of the cluster's
    rollout: int  # devices generating
    train: int  # devices for forwards and updates
    gen_tp: int
    gen_s: float
    fwd_s: float
    train_s: float
    sync_s: float
    trains: tuple[TrainPlan, ...]
    device_s: float

    @property
    def time_s(self) -> float:
        return self.gen_s + self.fwd_s + self.train_s + self.sync_s

    def describe(self) -> str:
        pools = f"all {self.devices}" if self.placement == "colocated" else \
            f"rollout {self.rollout} + train {self.train}"
        trains = "; ".join(f"{t.model} tp{t.tp} pp{t.pp} dp{t.dp} mb{t.micro}" for t in self.trains)
        return f"{self.placement:<9} {pools:<22} gen tp{self.gen_tp:<3} {trains}"


def _gen_s(cost: CostModel, work: FlowWork, lens: list[list[int]], tp: int, devices: int, context: float) -> float:
    shape = work.shapes[work.generate.model]
    instances = devices // tp
    slots = cost.slots(shape, tp, work.max_tokens + 256)
    if instances < 1 or slots < 1:
        return float("inf")
    flat = [n for prompt in lens for n in prompt]
    per = -(-len(flat) // instances)
    if per > slots:  # more than an instance holds at once: it decodes in waves
        waves = -(-per // slots)
    else:
        waves = 1
    sizes = sorted({1, min(per, slots), max(1, min(per, slots) // 2)})
    curve = DecodeCurve({b: cost.decode_iter(shape, b, b * context, tp) for b in sizes})
    worst = 0.0
    for i in range(instances):
        mine = flat[i * per:(i + 1) * per]
        if mine:
            worst = max(worst, sum(decode_seconds(mine[w::waves], curve) for w in range(waves)))
    prompts = sum(1 for _ in lens)
    prefill = cost.prefill_s(shape, context * prompts / max(1, min(instances, prompts)), tp)
    return cost.f.gen_call_s + prefill + worst


def _best_train(cost: CostModel, work: FlowWork, rows: list[Row], devices: int) -> tuple[TrainPlan, ...] | None:
    out = []
    for u in work.updates:
        shape = work.shapes[u.model]
        best: TrainPlan | None = None
        for tp, pp, micro in itertools.product(TPS, PPS, MICROS):
            if tp > cost.cluster.per_node or devices % (tp * pp) or pp > shape.layers:
                continue
            dp = devices // (tp * pp)
            if micro < pp and pp > 1 or micro * dp * u.mini_batches > len(rows):
                continue
            tokens = cost.tokens(rows, u.share_prefix)
            mem = cost.train_memory(shape, devices, tp, pp, tokens / u.mini_batches / dp / micro)
            if mem > 0.9 * cost.dev.memory:
                continue
            t = cost.train_s(shape, rows, devices, u.epochs, u.mini_batches, tp, pp, micro, u.share_prefix)
            if best is None or t < best.time_s:
                best = TrainPlan(u.model, tp, pp, dp, micro, t)
        if best is None:
            return None
        out.append(best)
    return tuple(out)


def rollout_sizes(devices: int, per_node: int) -> list[int]:
    small = [2 ** k for k in range(0, 4) if 2 ** k < min(devices, per_node)]
    nodes = [per_node * k for k in range(1, devices // per_node)]
    return sorted(set(small + nodes) - {0, devices})


def sizes(devices: int) -> list[int]:
    """Device counts a plan may use: the whole cluster and each halving of it (fewer devices can cost less)."""
    out = []
    while devices >= 1:
        out.append(devices)
        if devices % 2:
            break
        devices //= 2
    return out


def plans(cost: CostModel, work: FlowWork, step: Step) -> list[Plan]:
    seqs = seqs_of(step)
    rows = rows_of(seqs)
    by_prompt = [list(w.responses) for w in step]
    context = sum(w.prompt_len for w in step) / len(step) + sum(s.length for s in seqs) / len(seqs) / 2
    gen_shape = work.shapes[work.generate.model]
    out: list[Plan] = []
    layouts = [(used, "colocated", used, used) for used in sizes(cost.cluster.devices)]
    layouts += [(used, "split", r, used - r) for used in sizes(cost.cluster.devices)
                for r in rollout_sizes(used, cost.cluster.per_node)]
    train_cache: dict[int, tuple[TrainPlan, ...] | None] = {}
    for devices, placement, rollout, train in layouts:
        if train not in train_cache:
            train_cache[train] = _best_train(cost, work, rows, train)
        trains = train_cache[train]
        if trains is None:
            continue
        fwd = sum(cost.forward_s(work.shapes[f.model], rows, train, share_prefix=f.share_prefix)
                  for f in work.forwards)
        train_s = sum(t.time_s for t in trains)
        sync = cost.weight_sync_s(gen_shape, train, colocated=placement == "colocated") if work.updates else 0.0
        for tp in TPS:
            if tp > cost.cluster.per_node or tp > rollout:
                continue
            gen = _gen_s(cost, work, by_prompt, tp, rollout, context)
            if gen == float("inf"):
                continue
            plan = Plan(placement, devices, rollout, train, tp, gen, fwd, train_s, sync, trains, 0.0)
            out.append(Plan(**{**plan.__dict__, "device_s": plan.time_s * devices}))
    if not out:
        raise FlowError(Diagnostic(f"no plan fits {work.describe()} on {cost.cluster.name} "
                                   f"({cost.cluster.devices} x {cost.dev.name})",
                                   hint="a bigger cluster or smaller models"))
    return out


def best(cost: CostModel, work: FlowWork, step: Step, objective: str = "time", top: int = 5) -> list[Plan]:
    if objective not in ("time", "cost"):
        raise FlowError(Diagnostic(f"--objective {objective!r}: expected time or cost"))
    found = plans(cost, work, step)
    key = (lambda p: (p.time_s, p.device_s)) if objective == "time" else (lambda p: (p.device_s, p.time_s))
    return sorted(found, key=key)[:top]
