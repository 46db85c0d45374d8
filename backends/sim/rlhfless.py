"""The `rlhfless` policy of the simulator (flowrl.backends.sim): the serverless backend's decisions, taken by the
same flowrl.elastic calls, on a simulated cluster.

Per step, as the backend's pools take them:
- generation: the prompts' lengths predicted from their history (`predictions`), the instance count, the
  length-ranked runs and the migration sink (`plan_generation`: all instances until a generation was measured,
  then the cost-weighted choice on the decode curve *measured* from the simulated instances, `learn_decode`, and
  their start overhead; an instance decodes at most its KV-cache slots at once, `slots`, which the backend's
  torch engine does not limit); sources cut at `tau` (`should_migrate`) and hand their tails to the sink, which waits
  for every source's word;
- deduplicated prefill, where the workload says how long the prompts' shared prefix is (`PromptWork.prefix_len`):
  the owner of each prefix computes it once, the others take it or compute it themselves as the measured rates
  say (`share_prefixes`, `decide_hand_over`, `PrefillRates`; `Options.dedup`);
- pre-warming per pool from the step history (`prewarm_plan`, `learn_start`): instances are started that many
  seconds after the step's start, as many as the last first call used when it had a cold start; a pool's first
  call comes at its offset in the step (generation at 0, the forwards at generation's end, the updates at the
  forwards' end). An instance costs its start before it can work: loading its models' weights from host memory
  (a forward or training device its shard; training also the optimizer state's, 8 bytes a parameter) and, in a
  process that never ran the pool,
  `cold_start_s` first. A pre-warmed instance is held from its start; one the call did not take stays held to
  the step's end (the backend releases it at the next step).
Forwards and updates run on all devices, each device an instance, held from their start to their stage's end.
A fused generation+forwards stage (pass fuse-gen-inference) streams: its forwards' instances are called at the
first finished sample, `late_start` (flowrl.elastic.late) of their learned slack after it, as the backend's, and
take each sample as it finishes; what they wait for samples is held, not busy, and updates the slack
(`update_slack`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.generation import Gen, Instance, PrefixPart, Seq
from flowrl.backends.sim.policies import (
    Options,
    PoolUse,
    Serverful,
    Span,
    StepResult,
    forwards_and_updates,
    gen_spans,
    rows_of,
    seqs_of,
)
from flowrl.backends.sim.work import Call, FlowWork
from flowrl.backends.sim.workload import Step
from flowrl.elastic import (
    GenerationPlan,
    LengthPredictor,
    PrefillRates,
    decide_hand_over,
    decode_steps,
    late_start,
    learn_decode,
    learn_start,
    plan_generation,
    predictions,
    prewarm_plan,
    share_prefixes,
    should_migrate,
    start_overhead,
    update_slack,
)

OPTIMIZER_BYTES = 8  # per parameter: Adam's two fp32 moments, loaded by a training instance with the weights


@dataclass
class Pool:
    """One elastic pool's start-up history (the backend's `Prewarmer` state) and its warm processes."""

    offsets: list[float] = field(default_factory=list)
    ready_s: float = 0.0
    needed: int = 0
    warm: int = 0  # processes that have run the pool: their next start is not cold

    def plan(self, margin_s: float, enabled: bool) -> tuple[float, int] | None:
        """(seconds after the step's start, instances) to pre-warm, as the backend's `Prewarmer` decides."""
        return prewarm_plan(self.offsets, self.ready_s, self.needed, margin_s, enabled)

    def learn(self, at: float, cold_ready_s: list[float], n: int) -> None:
        """The step's first call came at `at` and used `n` instances, those cold taking `cold_ready_s` to be
        ready (their build and load)."""
        self.offsets.append(at)
        self.ready_s, self.needed = learn_start(self.ready_s, self.needed, cold_ready_s, n, first=True)
        self.warm = max(self.warm, n)

    def start(self, at: float, n: int, load_s: float, cold_s: float, margin_s: float,
              prewarm: bool) -> tuple[list[float], list[float], tuple[int, float]]:
        """The pool's first call of the step comes at `at` wanting `n` instances -> (when each is ready to
        work, when each started holding its device, (pre-warmed instances the call did not take, when they
        started): they are held to the step's end)."""
        plan = self.plan(margin_s, prewarm)
        if plan is not None and plan[0] > at:  # the call came first: the timer is cancelled, nothing pre-warmed
            plan = None
        ready, held_from, cold = [], [], []
        for i in range(n):
            cost = load_s + (cold_s if i >= self.warm else 0.0)
            if i >= self.warm:
                cold.append(cost)
            began = plan[0] if plan is not None and i < plan[1] else at
            held_from.append(began)
            ready.append(max(at, began + cost))
        unused = (plan[1] - n, plan[0]) if plan is not None and plan[1] > n else (0, 0.0)
        self.learn(at, cold, n)
        return ready, held_from, unused


class RLHFless(Serverful):
    name = "rlhfless"

    def memory_share(self) -> float:
        return 0.9  # instances hold their devices alone

    def __init__(self, cost: CostModel, work: FlowWork, opts: Options):
        super().__init__(cost, work, opts)
        self.predictor = LengthPredictor(window=opts.window)
        self.decode: dict[int, float] = {}  # measured seconds per decode step by an instance's samples
        self.overhead_s = 0.0  # a generation instance's start beyond decoding, as measured
        self.rates = PrefillRates()
        self.pools = {"generation": Pool(), "inference": Pool(), "training": Pool()}
        self.slack_s: float | None = None  # a fused stage's learned slack (flowrl.elastic.late)

    def _load(self, models: list[str], training: bool = False) -> float:
        """Seconds for one of the pool's devices to load its shard of the models (sharded over every device,
        as the forwards and updates run: FSDP/ZeRO-3) from host memory."""
        nbytes = sum(self.work.shapes[m].weight_bytes + (OPTIMIZER_BYTES * self.work.shapes[m].params
                                                         if training else 0) for m in models)
        return nbytes / self.devices / self.cost.f.host_bw

    def _prefixes(self, step: Step, runs: tuple[tuple[int, ...], ...], seqs: list[Seq]) -> list[PrefixPart] | None:
        """The step's deduplicated prefill (None: no shared prefix in the workload, or `dedup` off)."""
        if self.opts.dedup == "off" or not self.work.generate.share_prefix:
            return None
        lengths = sorted({w.prefix_len for w in step if w.prefix_len > 0})
        if not lengths:
            return None
        groups = [[p for p, w in enumerate(step) if w.prefix_len == n] for n in lengths]
        instance_of = [0] * len(step)
        for k, run in enumerate(runs):
            for p in run:
                instance_of[p] = k
        taken = [n for n, g in zip(lengths, groups, strict=True) for _ in range(len({instance_of[p] for p in g}) - 1)]
        how = decide_hand_over(self.opts.dedup, self.rates.rate_s, self.rates.handover_s, taken)
        shares = share_prefixes(groups, instance_of, len(runs), how.handing)
        skip = {w.prompt_id: w.prefix_len for w in step}
        for s in seqs:
            s.skip = skip[s.prompt]
        return [PrefixPart(sum(lengths[g] for g in sh.compute),
                           tuple((owner, sum(lengths[g] for g, o in sh.take if o == owner))
                                 for owner in sorted({o for _, o in sh.take})), how.patience_s) for sh in shares]

    def late_s(self) -> float:
        """How long after the first chunk a fused stage's forward instances start (flowrl.elastic.late, as the
        backend's `ServerlessGroup.late_s`)."""
        return late_start(self.slack_s, self.opts.late)

    def learn_slack(self, waits: list[float], late: float) -> None:
        """What each forward instance waited for chunks this step, started `late` after the first chunk: the
        slack into the moving mean (the backend's `ServerlessGroup.learn_slack`)."""
        self.slack_s = update_slack(self.slack_s, waits, late)

    def _stream(self, streamed: list[Call], seqs: list[Seq], start: float) -> tuple[float, float, list[Span]]:
        """A fused stage's forwards on every device from `start`, each sample's share once it finished (the
        backend's consumer takes the chunks as they come) -> (their end, the seconds each device waited for
        chunks, spans)."""
        rows = rows_of(seqs)
        per = sum(self.cost.forward_s(self.work.shapes[f.model], rows, self.devices, share_prefix=f.share_prefix)
                  for f in streamed) / len(seqs)
        t = start
        for s in sorted(seqs, key=lambda s: s.finished_at or 0.0):
            t = max(t, s.finished_at or 0.0) + per
        return t, max(0.0, t - start - per * len(seqs)), [Span("inference", f.node, f.op, start, t) for f in streamed]

    def decide(self, step: Step) -> GenerationPlan:
        """The step's generation plan from what the pool has learned (the backend's `Scaler.shards`)."""
        predicted, profiles = predictions(self.predictor, [w.prompt_id for w in step], self.work.samples)
        return plan_generation(predicted, self.work.samples, self.instances, self.decode, self.overhead_s,
                               self.opts.cost_weight, self.opts.tau, profiles, slots=self.slots)

    def learn(self, step: Step, instances: list[tuple[int, int, float, float, bool]]) -> None:
        """What a finished generation teaches (the backend's `Scaler.measure` and `learn_and_restore`): each
        prompt's sample lengths, and per instance (samples it returned, its longest response, run seconds,
        held - run seconds, cold) the decode curve and the start overhead."""
        self.decode = learn_decode(self.decode, [(k, n, run) for k, n, run, _, _ in instances])
        self.overhead_s = start_overhead([(over, cold) for _, _, _, over, cold in instances])
        self.predictor.observe([w.prompt_id for w in step for _ in w.responses],
                               [n for w in step for n in w.responses])

    def step(self, step: Step) -> StepResult:
        shape = self.work.shapes[self.work.generate.model]
        seqs = seqs_of(step)
        ids = [w.prompt_id for w in step]
        plan = self.decide(step)
        by_prompt: dict[int, list[Seq]] = {}
        for s in seqs:
            by_prompt.setdefault(s.prompt, []).append(s)
        runs = [[s for i in run for s in by_prompt[ids[i]]] for run in plan.runs]
        prefixes = self._prefixes(step, plan.runs, seqs)
        # an instance loads the newest weights from the learner and moves them into its device
        load = self.cost.weight_sync_s(shape, 1, colocated=False) + shape.weight_bytes / self.tp / \
            self.cost.f.host_bw
        cold = self.cost.f.cold_start_s
        gen_pool = self.pools["generation"]
        colds = max(0, plan.instances - gen_pool.warm)
        ready, gen_from, gen_unused = gen_pool.start(0.0, plan.instances, load, cold, self.opts.margin_s,
                                                     self.opts.prewarm)
        sinks = {plan.sink: {k for k in range(plan.instances) if k != plan.sink}} if plan.sink is not None else {}
        gen = Gen(self.cost, shape, self.tp, self.slots, runs, ready, sinks=sinks, prefixes=prefixes)

        def hook(g: Gen, inst: Instance, now: float) -> None:
            unfinished = len(inst.running) + len(inst.queue)
            if plan.sink is None or inst.iid == plan.sink or inst.migrated_out or \
                    not should_migrate(inst.finished, inst.finished + unfinished, self.opts.tau):
                return
            g.migrate(inst, g.inst[plan.sink], now)

        gen.hook = hook
        res = gen.run()
        # the forwards' and updates' instances: every device, pre-warmed from their pool's history
        forward_models = sorted({f.model for f in self.work.forwards})
        train_models = sorted({u.model for u in self.work.updates})
        # a fused stage's forwards (`stream`) are called `late` after the first chunk (or the first generation
        # instance's return), sooner only once every generation instance returned, as the backend's `stream_stage`
        # calls them; the others at generation's end
        streamed = [f for f in self.work.forwards if f.stream]
        late = self.late_s() if streamed else 0.0
        first = min(min(s.finished_at or res.end for s in seqs), min(i.released or res.end for i in res.instances))
        fwd_at = min(first + late, max(i.released or res.end for i in res.instances)) if streamed else res.end
        fwd_ready, fwd_from, fwd_unused = self.pools["inference"].start(
            fwd_at, self.devices, self._load(forward_models), cold, self.opts.margin_s, self.opts.prewarm) \
            if forward_models else ([res.end], [res.end], (0, 0.0))
        fwd_start = max(fwd_ready)
        stream_end, chunk_wait, spans = self._stream(streamed, seqs, fwd_start) if streamed else (fwd_start, 0.0, [])
        if streamed:
            self.learn_slack([chunk_wait], late)
        fwd_end, t, _, rest = forwards_and_updates(self.cost, replace(self.work, forwards=tuple(
            f for f in self.work.forwards if not f.stream)), seqs, self.devices, max(stream_end, res.end),
            "training", fwd_track="inference", updates=False)
        spans += rest
        chunk_wait += max(0.0, res.end - stream_end)  # the unstreamed forwards wait for generation's end
        train_ready, train_from, train_unused = self.pools["training"].start(
            fwd_end, self.devices, self._load(train_models, training=True), cold, self.opts.margin_s,
            self.opts.prewarm) if train_models else ([fwd_end], [fwd_end], (0, 0.0))
        train_start = max(train_ready)
        _, end, _, train_spans = forwards_and_updates(self.cost, self.work, seqs, self.devices, train_start,
                                                      "training", forwards=False, controller=False)
        idle = {name: k * (end - began) for name, (k, began) in
                (("generation", gen_unused), ("inference", fwd_unused), ("training", train_unused))}
        starting = sum((i.start - f) * self.tp for i, f in zip(res.instances, gen_from, strict=True)) \
            + idle["generation"] * self.tp
        gen_held = sum(((i.released if i.released is not None else i.start) - i.start) * self.tp
                       for i in res.instances) + starting
        fwd_wait = sum(fwd_start - f for f in fwd_from) + idle["inference"] if forward_models else 0.0
        train_wait = sum(train_start - f for f in train_from) + idle["training"] if train_models else 0.0
        pools = {"generation": PoolUse(self.instances * self.tp, gen_held,
                                       sum(i.busy for i in res.instances) * self.tp, starting),
                 "inference": PoolUse(self.devices, (fwd_end - fwd_start) * self.devices + fwd_wait,
                                      (fwd_end - fwd_start - chunk_wait) * self.devices, fwd_wait),
                 "training": PoolUse(self.devices, (end - train_start) * self.devices + train_wait,
                                     (end - train_start) * self.devices, train_wait)}
        on: dict[int, list[Seq]] = {i.iid: [] for i in res.instances}
        for s in seqs:
            on[s.done_on].append(s)
        # per instance, as the backend measures it: the samples decoded at once (at most its slots), its decode
        # steps, its run time, its time beyond the run, whether it was cold
        self.learn(step, [(min(len(done), self.slots), decode_steps([s.length for s in done], self.slots),
                           (i.released or i.start) - i.start, i.start - f, i.iid >= len(ready) - colds)
                          for i, f in zip(res.instances, gen_from, strict=True) if (done := on[i.iid])])
        if prefixes is not None:
            self.rates.learn(res.prefill)
        t0 = min(ready)
        notes = {"gen_s": res.end - t0, "after_gen_s": end - res.end, "instances": plan.instances,
                 "migrations": len(res.migrations), "cold_starts": colds, "start_wait_s": t0,
                 "fwd_start_wait_s": fwd_start - res.end, "train_start_wait_s": train_start - fwd_end}
        if streamed:  # as the backend's fusion/late_s, and what the forward instances waited for chunks
            notes.update(late_s=late, chunk_wait_s=chunk_wait)
        if plan.choice is not None:
            notes.update(predicted_T=plan.choice.chosen.time_s, predicted_C=plan.choice.chosen.device_s)
        if prefixes is not None:
            notes["prefill_handover"] = float(any(p.take for p in prefixes))
        return StepResult(end, pools, [*gen_spans("generation", self.work.generate.node, res, self.tp), *spans,
                                       *train_spans], notes)
