"""Scheduling policies the simulator runs a step under (flowrl.backends.sim), each a class with `step`; the
registry that makes one by name is registry.py.

- `serverful`: verl-like. Every model on every device (colocated); generation instances of `gen_tp` devices
  take contiguous runs of the batch in data order and the stage ends with its slowest instance; then each
  forward, then each update, over all devices. Everything is held the whole step.
- `rlhfuse`: the same devices with RLHFuse's two fusions. Inter-stage: once the unfinished samples fall to a
  fraction `rt` of the batch, the instances with the most work left keep the tail (as many as the tail needs
  slots), the others' unfinished samples migrate to them with their KV cache, and the freed devices start the
  forwards over finished samples. Intra-stage: an actor and a critic update train side by side in the fused
  pipeline schedule (flowrl.planner.fuse_schedule), their time scaled by its makespan over the two run apart.
- `rlhfless` (rlhfless.py, built on `Serverful` here): the serverless backend's decisions by its own flowrl.elastic calls: lengths
  predicted from history, the cost-weighted instance count on the measured decode curve, length-ranked runs,
  cut-and-migrate to the sink at `tau`, the deduplicated prefill and history-based pre-warming.
- `pipe-rlhf`: Pipe-RLHF as its abstract describes it: the devices split between a rollout pool and a train
  pool (the split searched per flow), generation pipelined across batches (modelled as bubble-free, i.e. the
  pool's instances at full throughput), and one-step-off asynchronous PPO: a step lasts the longer of the two
  pools' work. Its body was not available (seed_papers.md §3), so this is a reading of the abstract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from flowrl.backends.sim.costs import CostModel, Row
from flowrl.backends.sim.generation import Gen, GenResult, Instance, Seq
from flowrl.backends.sim.work import FlowWork
from flowrl.backends.sim.workload import Step
from flowrl.elastic import LATE_SHARE, migration_target
from flowrl.errors import Diagnostic, FlowError
from flowrl.planner.fuse_schedule import Problem, lower_bound, solve


@dataclass(frozen=True)
class Span:
    track: str
    name: str
    op: str
    start: float
    end: float


@dataclass
class PoolUse:
    devices: int
    held: float = 0.0  # device-seconds
    busy: float = 0.0
    starting: float = 0.0  # of held: instances starting or receiving weights


@dataclass
class StepResult:
    time: float
    pools: dict[str, PoolUse]
    spans: list[Span] = field(default_factory=list)
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def held(self) -> float:
        return sum(p.held for p in self.pools.values())


@dataclass(frozen=True)
class Options:
    gen_tp: int | None = None  # devices per generation instance (None: the fewest that hold the weights)
    cost_weight: float = 0.5  # rlhfless: weight of time against device-seconds
    tau: float = 0.7  # rlhfless: cut-and-migrate threshold
    rt: float = 0.2  # rlhfuse: migration when this fraction of samples is unfinished
    window: int = 4  # rlhfless: EWMA window of the length predictor
    prewarm: bool = True  # rlhfless: instances start before the stage (from the step history)
    margin_s: float = 0.05  # rlhfless: pre-warmed instances are ready this long before the stage's earliest start
    late: float = LATE_SHARE  # rlhfless: a fused stage's forward instances start this share of their slack late
    dedup: str = "auto"  # rlhfless: deduplicated prefill, auto | handover | local | off (as `run { dedup_prefill }`)
    rollout_devices: int | None = None  # pipe-rlhf: the rollout pool (None: searched)
    colocated_memory: float = 0.5  # serverful, rlhfuse: generation's share of a device training also holds
    # (verl's default rollout gpu_memory_utilization); dedicated generation devices use 0.9


def seqs_of(step: Step) -> list[Seq]:
    return [Seq(k, w.prompt_id, w.prompt_len, n) for k, (w, n) in
            enumerate((w, n) for w in step for n in w.responses)]


def gen_tp(cost: CostModel, work: FlowWork, opts: Options, share: float = 0.9) -> int:
    """Devices per generation instance: `--gen-tp`, else the fewest (within a node) whose weights take at most
    half of the memory generation may use, the rest for KV cache."""
    shape = work.shapes[work.generate.model]
    if opts.gen_tp:
        return opts.gen_tp
    tp = 1
    while shape.weight_bytes > share / 2 * tp * cost.dev.memory and tp < cost.cluster.per_node:
        tp *= 2
    return tp


def slots_of(cost: CostModel, work: FlowWork, tp: int, share: float = 0.9) -> int:
    shape = work.shapes[work.generate.model]
    slots = cost.slots(shape, tp, work.max_tokens + 256, share)
    if slots < 1:
        raise FlowError(Diagnostic(f"{shape.name} does not fit on {tp} x {cost.dev.name} (with {share:.0%} of memory "
                                   f"for generation)",
                                   hint="pass --gen-tp with more devices per instance, or a bigger device"))
    return slots


def check_training_fits(cost: CostModel, work: FlowWork, devices: int) -> None:
    for u in work.updates:
        need = cost.train_memory(work.shapes[u.model], devices)
        if need > 0.8 * cost.dev.memory:
            raise FlowError(Diagnostic(
                f"training {u.model} ({work.shapes[u.model].name}) needs {need / 1e9:.0f} GB a device sharded over "
                f"{devices} devices; {cost.dev.name} has {cost.dev.memory / 1e9:.0f} GB",
                hint="more devices (a bigger --cluster) or a smaller model"))


def lengths_of(seqs: list[Seq]) -> list[int]:
    return [s.prompt_len + s.length for s in seqs]


def rows_of(seqs: list[Seq]) -> list[Row]:
    return [(s.prompt, s.prompt_len, s.length) for s in seqs]


def contiguous(seqs: list[Seq], parts: int) -> list[list[Seq]]:
    size, extra = divmod(len(seqs), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(seqs[at:at + n])
        at += n
    return out


def gen_spans(track: str, node: str, gen: GenResult, tp: int) -> list[Span]:
    spans = [Span(track, node, "generate", min(i.start for i in gen.instances), gen.end)]
    for i in gen.instances:
        spans.append(Span(f"{track} instances", f"instance {i.iid}" + (f" ({tp} devices)" if tp > 1 else ""),
                          "instance", i.start, i.released if i.released is not None else i.start))
    return spans


def forwards_and_updates(cost: CostModel, work: FlowWork, seqs: list[Seq], devices: int, t: float,
                         track: str, fwd_track: str | None = None, train_scale: float = 1.0,
                         forwards: bool = True, updates: bool = True,
                         controller: bool = True) -> tuple[float, float, float, list[Span]]:
    """Run the controller's nodes, every forward, then every update (each part unless switched off) over
    `devices` from time t: (end of forwards, end, busy seconds, spans)."""
    rows, t_start = rows_of(seqs), t
    spans: list[Span] = []
    if work.controller_s and controller:  # rewards and functions, the controller's (measured) share of the step
        spans.append(Span("controller", ", ".join(work.controller), "reward", t, t + work.controller_s * len(seqs)))
        t = spans[-1].end
    for f in work.forwards if forwards else ():
        d = cost.forward_s(work.shapes[f.model], rows, devices, share_prefix=f.share_prefix)
        spans.append(Span(fwd_track or track, f.node, f.op, t, t + d))
        t += d
    fwd_end = t
    for call in work.update_calls() if updates else ():  # a fused group is one call, its models' work summed
        d = sum(cost.train_s(work.shapes[u.model], rows, devices, u.epochs, u.mini_batches,
                             share_prefix=u.share_prefix) for u in call)
        d *= train_scale
        spans += [Span(track, u.node, "update", t, t + d) for u in call]
        t += d
    return fwd_end, t, t - t_start, spans


class Serverful:
    name = "serverful"

    def __init__(self, cost: CostModel, work: FlowWork, opts: Options):
        self.cost, self.work, self.opts = cost, work, opts
        self.devices = cost.cluster.devices
        self.tp = gen_tp(cost, work, opts, self.memory_share())
        self.instances = max(1, self.devices // self.tp)
        self.slots = slots_of(cost, work, self.tp, self.memory_share())
        check_training_fits(cost, work, self.devices)

    def memory_share(self) -> float:
        return self.opts.colocated_memory

    def generation(self, seqs: list[Seq], t0: float) -> Gen:
        return Gen(self.cost, self.work.shapes[self.work.generate.model], self.tp, self.slots,
                   contiguous(seqs, self.instances), [t0] * self.instances)

    def sync_s(self) -> float:
        shape = self.work.shapes[self.work.generate.model]
        return self.cost.weight_sync_s(shape, self.devices, colocated=True) if self.work.updates else 0.0

    def step(self, step: Step) -> StepResult:
        seqs = seqs_of(step)
        t0 = self.sync_s()
        gen = self.generation(seqs, t0).run()
        _, end, busy, spans = forwards_and_updates(self.cost, self.work, seqs, self.devices, gen.end, "all")
        busy_dev = busy * self.devices + sum(i.busy for i in gen.instances) * self.tp
        return StepResult(end, {"all": PoolUse(self.devices, self.devices * end, busy_dev)},
                          [Span("all", "weight sync", "sync", 0.0, t0), *gen_spans("all", self.work.generate.node,
                                                                                    gen, self.tp), *spans],
                          {"gen_s": gen.end - t0, "after_gen_s": end - gen.end})


@lru_cache(maxsize=64)
def fused_training_ratio(a: int, b: int, micro: int, f0: float, f1: float) -> float:
    """Makespan of the fused actor/critic schedule over that of the two pipelines run one after the other."""
    copies = a // b
    apart = 3 * f0 * (micro + a - 1) + 3 * f1 * (micro // copies + b - 1)
    problem = Problem(a, b, (micro, micro), (f0, f1))
    fused = solve(problem, seed=0, iters=3000, restarts=8).makespan
    return max(lower_bound(problem), fused) / apart


class RLHFuse(Serverful):
    name = "rlhfuse"

    def keep(self, g: Gen, left: int) -> int:
        """How many instances keep the tail: the fewest whose batch of `left / m` sequences each fits their slots
        and decodes no slower (within 10%) than the fullest instance does now, so the tail's latency does not
        grow (RLHFuse's rule for m)."""
        shape, busiest = self.work.shapes[self.work.generate.model], max(g.inst, key=lambda i: len(i.running))
        ctx = sum(s.context for s in busiest.running) / max(1, len(busiest.running))
        now = self.cost.decode_iter(shape, len(busiest.running), ctx * len(busiest.running), self.tp)
        active = sum(1 for i in g.inst if i.active)
        for m in range(1, active + 1):
            per = math.ceil(left / m)
            if per <= self.slots and self.cost.decode_iter(shape, per, ctx * per, self.tp) <= 1.1 * now:
                return m
        return active

    def step(self, step: Step) -> StepResult:
        seqs = seqs_of(step)
        t0 = self.sync_s()
        gen = self.generation(seqs, t0)
        total, state = len(seqs), {"triggered": False}

        def hook(g: Gen, inst: Instance, now: float) -> None:
            left = total - sum(i.finished for i in g.inst)
            if state["triggered"] or left > self.opts.rt * total or left == 0:
                return
            state["triggered"] = True
            work = {i.iid: sum(s.left for s in i.running + i.queue) for i in g.inst if i.active}
            keep = sorted(work, key=lambda k: (-work[k], k))[:self.keep(g, left)]
            for src in [k for k in work if k not in keep]:
                need = len(g.inst[src].running) + len(g.inst[src].queue)
                target = migration_target({k: g.free_slots(g.inst[k]) for k in keep}, src, need)
                if target is not None or need == 0:
                    g.migrate(g.inst[src], g.inst[target if target is not None else keep[0]], now)

        gen.hook = hook
        res = gen.run()
        # inter-stage fusion: freed devices run forwards over samples already finished
        fwd_total = sum(self.cost.forward_s(self.work.shapes[f.model], rows_of(seqs), self.devices,
                                            share_prefix=f.share_prefix)
                        - self.cost.f.fwd_call_s for f in self.work.forwards) * self.devices
        done_tokens = sum(s.prompt_len + s.length for s in seqs if (s.finished_at or res.end) < res.end)
        share = done_tokens / max(1, sum(lengths_of(seqs)))
        free = sum((res.end - i.released) * self.tp for i in res.instances if i.released is not None)
        overlapped = min(free, fwd_total * share)
        after = (fwd_total - overlapped) / self.devices + self.cost.f.fwd_call_s * len(self.work.forwards)
        scale = 1.0
        trainers = self.work.updates
        if len(trainers) == 2:
            p0, p1 = (self.work.shapes[u.model].params for u in trainers)
            big, small = max(p0, p1), min(p0, p1)
            b = 8 if small * 1.5 >= big else 4
            scale = fused_training_ratio(8, b, 16, big / 8, small / b)
        t = res.end + after
        _, end, busy_u, spans = forwards_and_updates(self.cost, self.work, seqs, self.devices, t, "all",
                                                     train_scale=scale, forwards=False)
        busy = sum(i.busy for i in res.instances) * self.tp + fwd_total + busy_u * self.devices
        return StepResult(end, {"all": PoolUse(self.devices, self.devices * end, busy)},
                          [Span("all", "weight sync", "sync", 0.0, t0), *gen_spans("all", self.work.generate.node,
                                                                                    res, self.tp),
                           Span("all", "forwards (fused)", "logprobs", res.end, t), *spans],
                          {"gen_s": res.end - t0, "after_gen_s": end - res.end, "migrations": len(res.migrations),
                           "train_scale": scale})


class PipeRLHF(Serverful):
    name = "pipe-rlhf"

    def __init__(self, cost: CostModel, work: FlowWork, opts: Options):
        self.cost, self.work, self.opts = cost, work, opts
        self.tp = gen_tp(cost, work, opts)
        self.slots = slots_of(cost, work, self.tp)
        self.devices = cost.cluster.devices
        self.split = opts.rollout_devices

    def _run(self, step: Step, rollout: int) -> tuple[GenResult, float, float, list[Span]]:
        seqs = seqs_of(step)  # fresh: a generation consumes its sequences
        train = self.devices - rollout
        instances = max(1, rollout // self.tp)
        gen = Gen(self.cost, self.work.shapes[self.work.generate.model], self.tp, self.slots,
                  contiguous(seqs, instances), [0.0] * instances).run()
        _, end, busy, spans = forwards_and_updates(self.cost, self.work, seqs, train, 0.0, "train")
        return gen, end, busy, spans

    def step(self, step: Step) -> StepResult:
        if self.split is None:  # search the rollout pool's size on the first step's content
            options = [r for r in range(self.tp, self.devices, self.tp)
                       if self._fits(self.devices - r)]
            if not options:
                raise FlowError(Diagnostic(f"pipe-rlhf needs a train pool that holds training and a rollout pool; "
                                           f"{self.devices} devices are too few"))
            tried = {r: self._run(step, r) for r in options}
            self.split = min(options, key=lambda r: max(tried[r][0].end, tried[r][1]))
            gen, train_end, busy, spans = tried[self.split]
        else:
            gen, train_end, busy, spans = self._run(step, self.split)
        shape = self.work.shapes[self.work.generate.model]
        sync = self.cost.weight_sync_s(shape, self.devices - self.split, colocated=False)
        time = max(gen.end, train_end) + sync  # one step off: rollout of t+1 beside training of t
        rollout_busy = sum(i.busy for i in gen.instances) * self.tp
        pools = {"rollout": PoolUse(self.split, self.split * time, rollout_busy),
                 "train": PoolUse(self.devices - self.split, (self.devices - self.split) * time,
                                  busy * (self.devices - self.split))}
        return StepResult(time, pools, [*gen_spans("rollout", self.work.generate.node, gen, self.tp), *spans,
                                        Span("train", "weight sync", "sync", time - sync, time)],
                          {"gen_s": gen.end, "after_gen_s": train_end, "rollout_devices": self.split})

    def _fits(self, train: int) -> bool:
        try:
            check_training_fits(self.cost, self.work, train)
        except FlowError:
            return False
        return train >= 1
