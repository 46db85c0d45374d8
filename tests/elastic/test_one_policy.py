"""One recorded run fed to the serverless backend's decision code and to the simulator's: the same decisions.

Three recorded steps of seven prompts, two samples each (prompt lengths, response lengths, and the measured
seconds per decode step at each instance batch; the first step's instances cold). Each step both sides decide
the generation's instance count, each instance's prompts, the migration sink and the pre-warm plan, then
learn from what the recorded step measured on the instances they chose. The backend's side is its own code,
without Ray (backends/serverless: `Scaler.shards` and `dispatch.plan` cutting its shards, `ServerlessGroup.role`
for the sink, `Prewarmer.plan`, then `Scaler.measure`, `Scaler.learn_and_restore` and `Prewarmer.learn`); the
simulator's is `backends/sim/rlhfless.py`. Both sides call the same flowrl.elastic functions; this checks that
each passes them the same state and reads the same decisions back. The deduplicated prefill is decided alike
too: from prompt texts on the backend's side, from the workload's prefix lengths on the simulator's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrl.backends.serverless.group import ServerlessGroup
from flowrl.backends.serverless.instance import Build
from flowrl.backends.serverless.scaling import Policy
from flowrl.backends.sim import policies
from flowrl.backends.sim.costs import CostModel, Factors
from flowrl.backends.sim.hardware import load_cluster
from flowrl.backends.sim.rlhfless import RLHFless
from flowrl.backends.sim.shapes import ModelShape
from flowrl.backends.sim.work import Call, FlowWork
from flowrl.backends.sim.workload import PromptWork, Step
from flowrl.elastic import ScaleChoice
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.protocol import Usage

IDS = (10, 11, 12, 13, 14, 15, 16)
PROMPT_LEN = (24, 23, 25, 24, 22, 24, 23)
RESPONSES = (  # per step, per prompt: its two samples' response lengths
    ((3, 5), (30, 12), (8, 8), (40, 38), (2, 1), (16, 20), (6, 4)),
    ((4, 6), (28, 14), (7, 9), (44, 36), (1, 2), (18, 22), (5, 5)),
    ((3, 4), (31, 10), (9, 8), (40, 40), (2, 2), (15, 19), (6, 3)),
)
# measured seconds a decode step, by an instance's batch (rows decoded together)
DECODE_S = {2: 0.010, 4: 0.012, 6: 0.020, 8: 0.030, 10: 0.040, 12: 0.050, 14: 0.060}
# a cold instance's build, every instance's load, and the step's start to its first generation call (seconds)
COLD_START_S, LOAD_S, OFFSET_S = 2.0, 0.25, 2.5
WORLD, SAMPLES = 3, 2


def recorded(step: int) -> Step:
    return tuple(PromptWork(p, n, r) for p, n, r in zip(IDS, PROMPT_LEN, RESPONSES[step], strict=True))


def instance_runs(step: int, runs: list[list[int]]) -> list[tuple[int, int, float, float, bool]]:
    """What the recorded step measured on the instances holding `runs` (prompt positions): per instance
    (samples, longest response, run seconds, held - run seconds, cold)."""
    out = []
    for run in runs:
        lengths = [n for p in run for n in RESPONSES[step][p]]
        longest = max(lengths)
        cold = step == 0
        out.append((len(lengths), longest, longest * DECODE_S[len(lengths)],
                    LOAD_S + (COLD_START_S if cold else 0.0), cold))
    return out


def scores(choice: ScaleChoice | None) -> tuple[float, ...] | None:
    """A cost-aware choice as numbers: the count chosen, its predicted T and C, every candidate's score."""
    if choice is None:
        return None
    return (choice.chosen.instances, choice.chosen.time_s, choice.chosen.device_s,
            *(c.score for c in choice.candidates))


def backend_step(group: ServerlessGroup, step: int) -> dict[str, object]:
    """The backend's decisions for one step, then what it learns from the recorded measurements."""
    prompts = Batch(len(IDS), {"prompt_ids": torch.arange(len(IDS))[:, None]}, {"prompt_id": list(IDS)})
    args, world, order, plan = group.scaler.shards(("actor", prompts, {"n": SAMPLES}))
    choice = plan.choice
    positions = order if order is not None else list(range(len(IDS)))
    calls = dispatch.plan("generate", args, {"step_seed": step}, "split", world).calls  # what each instance gets
    runs, at = [], 0
    for c in calls:
        runs.append(positions[at:at + c.args[1].size])
        at += c.args[1].size
    roles = [group.role(c.rank, len(calls), "box", plan.sink) for c in calls]
    sinks = [rank for rank, r in enumerate(roles) if r is not None and r.sources]
    decided = {"instances": len(runs), "runs": runs, "sink": sinks[0] if sinks else None,
               "choice": scores(choice),
               "prewarm": group.prewarm.plan()}
    measured = instance_runs(step, runs)
    results, used = [], []
    for run, (k, _, run_s, _, cold) in zip(runs, measured, strict=True):
        lengths = [n for p in run for n in RESPONSES[step][p]]
        mask = torch.tensor([[1] * n + [0] * (64 - n) for n in lengths])  # (k, 64)
        results.append(Batch(k, {"response_mask": mask}))
        used.append(Usage("generation", "actor", 1, 0.0, COLD_START_S if cold else 0.0, LOAD_S, run_s, cold))
    group.scaler.measure(results, used, choice, max(u.held_s for u in used))
    ranked = [p for run in runs for p in run]
    lengths = [n for p in ranked for n in RESPONSES[step][p]]
    rollout = Batch(len(lengths), {"response_mask": torch.tensor([[1] * n + [0] * (64 - n) for n in lengths]),
                                   "group_id": torch.tensor([g for g in range(len(ranked)) for _ in range(SAMPLES)])},
                    {"prompt_id": [IDS[p] for p in ranked for _ in range(SAMPLES)]})
    group.scaler.learn_and_restore(rollout, order)
    group.prewarm.offsets.append(OFFSET_S)  # what `arrived` records when the step's first call comes
    group.prewarm.learn(used, first=True)
    return decided


def sim_step(pol: RLHFless, step: int) -> dict[str, object]:
    """The simulator's decisions for one step, then what it learns from the same recorded measurements."""
    plan = pol.decide(recorded(step))
    pool = pol.pools["generation"]
    decided = {"instances": plan.instances, "runs": [list(r) for r in plan.runs], "sink": plan.sink,
               "choice": scores(plan.choice),
               "prewarm": pool.plan(pol.opts.margin_s, pol.opts.prewarm)}
    measured = instance_runs(step, [list(r) for r in plan.runs])
    pol.learn(recorded(step), measured)
    pool.learn(OFFSET_S, [over for _, _, _, over, cold in measured if cold], plan.instances)
    return decided


def simulator(dedup: str = Policy().dedup) -> RLHFless:
    shape = ModelShape("toy", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100)
    gen = Call("gen", "generate", "actor", share_prefix=True)
    work = FlowWork("recorded", {"actor": shape}, gen, (), (), len(IDS), SAMPLES, 64)
    cluster = replace(load_cluster("h100"), nodes=1, per_node=WORLD)
    opts = policies.Options(gen_tp=1, cost_weight=Policy().cost_weight, tau=Policy().tau,
                            margin_s=Policy().margin_s, prewarm=Policy().prewarm, dedup=dedup)
    return RLHFless(CostModel(cluster, Factors()), work, opts)


def test_one_recorded_run_gives_the_backend_and_the_simulator_the_same_decisions() -> None:
    build = Build(models=(), all_models=(), seed=0, device="cpu")
    group = ServerlessGroup("actor", None, build, WORLD, "recorded", policy=Policy())
    pol = simulator()
    assert pol.instances == WORLD
    steps = []
    for step in range(len(RESPONSES)):
        theirs, ours = backend_step(group, step), sim_step(pol, step)
        assert ours["instances"] == theirs["instances"], f"step {step}"
        assert ours["runs"] == theirs["runs"], f"step {step}"
        assert ours["sink"] == theirs["sink"], f"step {step}"
        assert ours["prewarm"] == theirs["prewarm"], f"step {step}"
        if theirs["choice"] is None:
            assert ours["choice"] is None
        else:
            assert ours["choice"] == pytest.approx(theirs["choice"]), f"step {step}"
        steps.append(ours)
    # the run exercised every decision: all instances while nothing was measured, then the cost-weighted
    # choice, a sink, and pre-warming once the history said the first call had cold starts
    assert steps[0]["choice"] is None and steps[0]["instances"] == WORLD and steps[0]["prewarm"] is None
    assert steps[1]["choice"] is not None and steps[1]["sink"] is not None
    # 2.5 s to the first call, less a cold start's 2.25 s and the 0.05 s margin: start all three 0.2 s in
    assert steps[1]["prewarm"] == pytest.approx((0.2, WORLD))
    assert steps[2]["prewarm"] is None  # the second step's first call found its instances warm
    assert sorted(p for run in steps[1]["runs"] for p in run) == list(range(len(IDS)))  # type: ignore[union-attr]


PREAMBLE = "12+34+56+78+90="  # with the tokenizer's BOS, 16 prompt tokens shared (prefix_min_len 16)
OPENINGS = ("1+1=", "7=", "2+2=", "3+3=", "8=", "4+4=", "9+")  # the preamble opens prompts 0, 2, 3 and 5
RUNS = ((4, 0, 6), (2, 5), (1, 3))  # each instance's prompts (positions), as a plan ran them


@pytest.mark.parametrize("mode, rates, handing", [
    ("auto", (None, None), True),  # unmeasured: hand over, which measures it
    ("auto", (0.001, 0.004), True),  # recomputing 16 tokens (16 ms) costs more than a handover (4 ms)
    ("auto", (0.001, 0.032), False),  # ... less than one: each computes it
    ("handover", (0.001, 0.032), True), ("local", (None, None), False)])
def test_the_deduplicated_prefill_is_decided_alike(mode: str, rates: tuple[float | None, float | None],
                                                   handing: bool) -> None:
    """One step's prompts on three instances, a preamble on prompts held by all three: the backend's
    `prefill.plan_shares` (tokenizing the prompts) and the simulator's (the workload's prefix lengths) name the
    same owner, the same takers, the same hand-over decision and patience, from the same learned rates."""
    from flowrl.backends.serverless import prefill
    from flowrl.backends.sim.policies import seqs_of
    from flowrl.elastic import PrefillRates
    from flowrl.models.tokenizer import CharTokenizer
    from flowrl.runtime.worker import PromptEncoder

    texts = [(PREAMBLE if o[0] in "1234" else "") + o for o in OPENINGS]
    encoder = PromptEncoder(CharTokenizer("0123456789+="), 512)
    shares, decided = prefill.plan_shares(encoder, [texts[p] for run in RUNS for p in run], 8, 16,
                                          [len(run) for run in RUNS], mode, PrefillRates(*rates), "b", None)
    theirs = [(sum(len(t) for t in s.compute), tuple((o, sum(len(t) for t in ts)) for o, ts in s.take), s.patience_s)
              for s in shares]
    pol = simulator(dedup=mode)
    pol.rates = PrefillRates(*rates)
    step = tuple(PromptWork(i, len(t) + 1, (4, 4), 16 if t.startswith(PREAMBLE) else 0)
                 for i, t in zip(IDS, texts, strict=True))
    parts = pol._prefixes(step, RUNS, seqs_of(step))
    assert parts is not None
    ours = [(p.compute, p.take, p.patience_s) for p in parts]
    assert ours == theirs
    assert decided["handover"] == float(handing)
    # the owner is the first instance holding the preamble's prompts (instance 0 holds prompt 0)
    assert ours[0][0] == 16 and [bool(t) for _, t, _ in ours] == [False, handing, handing]
