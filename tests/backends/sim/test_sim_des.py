"""The simulator's discrete-event core and policies on cases worked out by hand (flowrl.backends.sim)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import flowrl.elastic
from flowrl.backends.sim import policies, registry, rlhfless
from flowrl.backends.sim.costs import CostModel, Factors
from flowrl.backends.sim.generation import Gen, Instance, Seq
from flowrl.backends.sim.hardware import load_cluster
from flowrl.backends.sim.shapes import ModelShape
from flowrl.backends.sim.work import Call, FlowWork
from flowrl.backends.sim.workload import PromptWork

SHAPE = ModelShape("toy", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100)


class ToyCost(CostModel):
    """Hand-computable costs: a decode iteration takes 10 ms plus 5 ms per sequence after the first; prefill,
    links and everything else are free unless a test says otherwise."""

    def __init__(self, devices: int = 8, **factors: float):
        cluster = replace(load_cluster("h100"), nodes=max(1, devices // 8), per_node=min(8, devices),
                          inter_bw=1e30, intra_bw=1e30)
        super().__init__(cluster, replace(Factors(gen_call_s=0.0, fwd_call_s=0.0, train_call_s=0.0,
                                                  prefill_mfu=1e30, forward_mfu=1e30, train_mfu=1e30,
                                                  act_bytes=0.0, cold_start_s=0.0, host_bw=1e30), **factors))

    def decode_iter(self, shape: ModelShape, batch: int, context: float, tp: int = 1) -> float:
        return 0.0 if batch <= 0 else 0.010 + 0.005 * (batch - 1)


def seqs(*lengths: int, prompt: int = 0) -> list[Seq]:
    return [Seq(i, prompt + i, 4, n) for i, n in enumerate(lengths)]


def test_one_instance_admits_queued_sequences_as_others_finish():
    # slots 2: A(2) and B(4) run at 15 ms an iteration; A ends at 30 ms and C(1) enters; C ends at 45 ms (B has
    # 1 token left); B alone at 10 ms an iteration ends at 55 ms.
    a, b, c = seqs(2, 4, 1)
    res = Gen(ToyCost(), SHAPE, 1, 2, [[a, b, c]]).run()
    assert [s.finished_at for s in (a, b, c)] == pytest.approx([0.030, 0.055, 0.045])
    assert res.end == pytest.approx(0.055)
    assert res.instances[0].released == pytest.approx(0.055)
    assert res.instances[0].busy == pytest.approx(0.055)


def test_instances_release_their_devices_at_their_own_last_finish():
    # a long tail: three instances with one short sequence each and one with a long one
    plan = [[s] for s in seqs(3, 2, 5, 40)]
    res = Gen(ToyCost(), SHAPE, 1, 4, plan, starts=[0.0, 0.0, 0.1, 0.0]).run()
    assert [i.released for i in res.instances] == pytest.approx([0.03, 0.02, 0.15, 0.40])
    assert res.end == pytest.approx(0.40)


def test_migration_moves_the_unfinished_sequences_with_their_progress():
    # instance 0 holds A(1) and B(10); instance 1 holds C(3). At 15 ms A ends on instance 0; the hook moves B (9
    # tokens left) to instance 1, which has run C for 1.5 tokens by then (15 ms / 10 ms). Together (15 ms an
    # iteration) C's last 1.5 tokens take 22.5 ms: C ends at 37.5 ms, B has 7.5 tokens left, alone at 10 ms
    # an iteration: B ends at 112.5 ms.
    a, b = seqs(1, 10)
    c = Seq(2, 9, 4, 3)

    def hook(g: Gen, inst: Instance, now: float) -> None:
        if inst.iid == 0 and inst.running:
            g.migrate(inst, g.inst[1], now)

    gen = Gen(ToyCost(), SHAPE, 1, 4, [[a, b], [c]], hook=hook)
    res = gen.run()
    assert res.migrations == [(pytest.approx(0.015), 0, 1, 1)]
    assert res.instances[0].released == pytest.approx(0.015)
    assert c.finished_at == pytest.approx(0.0375)
    assert b.finished_at == pytest.approx(0.1125)
    assert res.end == pytest.approx(0.1125)
    assert b.length == 10  # the same sample: only where it ran changed


def test_migrated_kv_cache_crosses_the_link_first():
    cost = ToyCost()
    cost.cluster = replace(cost.cluster, intra_bw=SHAPE.kv_bytes_per_token * 100.0)  # 100 tokens of KV a second
    a, b = seqs(1, 10)
    c = Seq(2, 9, 4, 20)

    def hook(g: Gen, inst: Instance, now: float) -> None:
        if inst.iid == 0 and inst.running:
            g.migrate(inst, g.inst[1], now)

    res = Gen(cost, SHAPE, 1, 4, [[a, b], [c]], hook=hook).run()
    # at 15 ms (one iteration of A and B) B has 1 token and a 4-token prompt: 5 tokens of KV take 50 ms,
    # arriving at 65 ms, when C (alone, 10 ms a token) has 13.5 tokens left. Together at 15 ms an iteration B's 9
    # end at 200 ms; C's last 4.5 alone at 245 ms.
    assert b.finished_at == pytest.approx(0.200)
    assert c.finished_at == pytest.approx(0.245)
    assert res.instances[1].released == pytest.approx(0.245)


def test_a_sink_idle_for_its_sources_word_takes_the_migrated_sequences():
    # instance 1 (the sink, waiting for instance 0) ends C(1) at 10 ms and waits; at 15 ms instance 0 ends A and
    # moves B (9 tokens left) to it and releases: the sink must not release with it (B is arriving). B alone, 10
    # ms an iteration, ends at 105 ms.
    a, b = seqs(1, 10)
    c = Seq(2, 9, 4, 1)

    def hook(g: Gen, inst: Instance, now: float) -> None:
        if inst.iid == 0 and inst.running:
            g.migrate(inst, g.inst[1], now)

    res = Gen(ToyCost(), SHAPE, 1, 4, [[a, b], [c]], hook=hook, sinks={1: {0}}).run()
    assert b.finished_at == pytest.approx(0.105) and b.done_on == 1
    assert res.instances[1].released == pytest.approx(0.105)


def test_migrating_to_an_instance_that_released_its_devices_is_refused():
    a, b = seqs(1, 10)

    def hook(g: Gen, inst: Instance, now: float) -> None:
        g.migrate(inst, g.inst[1], now)

    with pytest.raises(ValueError, match="released"):
        Gen(ToyCost(), SHAPE, 1, 4, [[a, b], []], hook=hook).run()


def work(forwards: int = 2, updates: int = 1) -> FlowWork:
    fwd = tuple(Call(f"f{i}", "logprobs", "actor") for i in range(forwards))
    ups = tuple(Call(f"u{i}", "update", "actor") for i in range(updates))
    return FlowWork("toy", {"actor": SHAPE}, Call("rollout", "generate", "actor"), fwd, ups, 4, 1, 8)


STEP = tuple(PromptWork(p, 4, (n,)) for p, n in enumerate([2, 3, 8, 1]))


def test_serverful_step_is_generation_then_forwards_then_updates_on_every_device():
    cost = ToyCost(devices=2, fwd_call_s=0.1, train_call_s=0.5)
    res = registry.make("serverful", cost, work(), policies.Options(gen_tp=1)).step(STEP)
    # two instances, data order: [2, 3] ends at 30 ms... (15 ms a step while both run: 2 -> 30 ms, then 3rd at
    # 10 ms: 40 ms); [8, 1]: 15 ms, then 7 more at 10 ms: 85 ms. Then two forwards (0.1 s) and an update (0.5 s).
    assert res.notes["gen_s"] == pytest.approx(0.085)
    assert res.time == pytest.approx(0.085 + 0.2 + 0.5)
    assert res.pools["all"].held == pytest.approx(2 * res.time)
    names = [s.name for s in res.spans if s.track == "all"]
    assert names.index("rollout") < names.index("f0") < names.index("f1") < names.index("u0")


def test_rlhfless_holds_generation_devices_only_while_instances_work():
    cost = ToyCost(devices=2, fwd_call_s=0.1, train_call_s=0.5)
    pol = registry.make("rlhfless", cost, work(), policies.Options(gen_tp=1, cost_weight=1.0, prewarm=False))
    res = pol.step(STEP)
    gen = res.pools["generation"]
    spans = [s for s in res.spans if s.track == "generation instances"]
    assert gen.held == pytest.approx(sum(s.end - s.start for s in spans) + gen.starting)
    assert res.pools["inference"].held == pytest.approx(2 * 0.2)
    assert res.pools["training"].held == pytest.approx(2 * 0.5)
    # cost-weight 1 buys the fastest step: both instances
    assert res.notes["instances"] == 2


def test_rlhfless_runs_the_serverless_backends_own_policy_functions():
    # imported from flowrl.elastic, not copied: the simulator and the serverless backend run one policy
    for name in ("plan_generation", "predictions", "learn_decode", "should_migrate", "prewarm_plan", "learn_start",
                 "share_prefixes", "decide_hand_over", "LengthPredictor"):
        assert getattr(rlhfless, name) is getattr(flowrl.elastic, name)


def test_rlhfless_uses_all_instances_until_it_measured_a_generation_then_the_cost_weighted_choice():
    cost = ToyCost(devices=4)
    pol = rlhfless.RLHFless(cost, work(), policies.Options(gen_tp=1, cost_weight=0.0, tau=1.0))
    first = pol.step(STEP)
    assert first.notes["instances"] == 4 and "predicted_T" not in first.notes  # no measured curve yet
    assert pol.decode  # the simulated instances' run times taught the curve, as the backend's do
    predicted = pol.predictor.predict([w.prompt_id for w in STEP], fallback=0.0)
    profiles = pol.predictor.predict_profiles([w.prompt_id for w in STEP], 1, fallback=0.0)
    expect = flowrl.elastic.choose_instances(predicted, 1, range(1, 5), flowrl.elastic.DecodeCurve(pol.decode),
                                             0.0, start_s=pol.overhead_s, profiles=profiles)
    res = pol.step(STEP)
    assert res.notes["instances"] == expect.chosen.instances
    assert res.notes["predicted_T"] == pytest.approx(expect.chosen.time_s)


def test_rlhfuse_moves_the_tail_and_overlaps_forwards_on_freed_devices():
    cost = ToyCost(devices=4, fwd_call_s=0.0)
    step = tuple(PromptWork(p, 4, (n,)) for p, n in enumerate([1, 1, 1, 1, 1, 1, 1, 30]))
    base = registry.make("serverful", cost, work(), policies.Options(gen_tp=1)).step(step)
    fused = registry.make("rlhfuse", cost, work(), policies.Options(gen_tp=1, rt=0.2)).step(step)
    assert fused.notes["migrations"] == 0  # the tail is one sequence already alone on its instance
    assert fused.time <= base.time + 1e-12


def test_pipe_rlhf_searches_the_rollout_pool_on_fresh_sequences():
    # every candidate split is timed on the step's own work (a generation consumes its sequences)
    cost = ToyCost(devices=8, fwd_call_s=0.05, train_call_s=0.2)
    step = tuple(PromptWork(p, 4, (n,)) for p, n in enumerate([30, 30, 30, 30, 30, 30, 30, 30]))
    pol = policies.PipeRLHF(cost, work(), policies.Options(gen_tp=1))
    res = pol.step(step)
    best = min(range(1, 8), key=lambda r: max(pol._run(step, r)[0].end, pol._run(step, r)[1]))
    assert res.notes["rollout_devices"] == best
    assert res.time == pytest.approx(max(pol._run(step, best)[0].end, pol._run(step, best)[1]))
