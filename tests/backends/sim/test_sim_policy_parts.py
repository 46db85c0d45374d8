"""The simulator's lengths from a flow, and the serverless policy's parts it models on hand-worked cases:
the deduplicated prefill, the migration sink's wait and history-based pre-warming (flowrl.backends.sim)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from flowrl.backends.sim import policies, rlhfless
from flowrl.backends.sim.costs import CostModel, Factors
from flowrl.backends.sim.generation import Gen, PrefixPart, Seq
from flowrl.backends.sim.hardware import load_cluster
from flowrl.backends.sim.shapes import ModelShape
from flowrl.backends.sim.work import Call, FlowWork
from flowrl.backends.sim.workload import (
    Lengths,
    PromptWork,
    data_prompts,
    from_flow,
    parse_lengths,
    prefix_tokens,
)
from flowrl.compiler import compile_file
from flowrl.errors import FlowError
from flowrl.ir.printer import to_json

ROOT = Path(__file__).resolve().parents[3]
SHAPE = ModelShape("toy", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100)


class Flat(CostModel):
    """A decode iteration 10 ms whatever the batch; prefill 1 ms a token; a KV transfer `link_s` whatever its
    size; nothing else costs."""

    def __init__(self, link_s: float = 0.0):
        cluster = replace(load_cluster("h100"), nodes=1, per_node=4)
        super().__init__(cluster, Factors(gen_call_s=0.0, fwd_call_s=0.0, train_call_s=0.0, cold_start_s=0.0,
                                          host_bw=1e30, act_bytes=0.0, forward_mfu=1e30, train_mfu=1e30))
        self.link_s = link_s

    def decode_iter(self, shape: ModelShape, batch: int, context: float, tp: int = 1) -> float:
        return 0.010 if batch > 0 else 0.0

    def prefill_s(self, shape: ModelShape, tokens: float, tp: int = 1, context: float = 0.0) -> float:
        return 0.001 * tokens

    def transfer_s(self, nbytes: float, devices: int, across_nodes: bool = True) -> float:
        return self.link_s


def test_lengths_from_the_flow_cap_and_a_given_distribution():
    graph = to_json(compile_file(str(ROOT / "examples/longtail_grpo.flow")))
    texts = data_prompts(graph)
    assert texts and texts[0].startswith("12+34+56+78+90=")
    assert prefix_tokens(texts) == 16  # "12+34+56+78+90=" and the start token
    assert prefix_tokens(texts, min_prefix=17) == 0  # shorter than the pass's prefix_min_len
    steps = from_flow(Lengths(), 4, 3, 64, 2, texts, 16)
    assert all(w.responses == (64, 64, 64) and w.prefix_len == 16 and w.prompt_len == len(texts[w.prompt_id]) + 1
               for s in steps for w in s)  # without a distribution: every response at the flow's cap
    fixed = from_flow(parse_lengths("fixed:80"), 4, 2, 64, 1)[0]
    assert {n for w in fixed for n in w.responses} == {64} and {w.prompt_len for w in fixed} == {256}
    uniform = [n for s in from_flow(parse_lengths("uniform:3:9"), 32, 4, 64, 3, seed=1) for w in s
               for n in w.responses]
    assert min(uniform) >= 3 and max(uniform) <= 9 and len(set(uniform)) == 7
    geo = [n for s in from_flow(parse_lengths("geometric:10"), 64, 8, 1000, 4, seed=2) for w in s
           for n in w.responses]
    assert sum(geo) / len(geo) == pytest.approx(10, rel=0.15)  # mean 1 / p
    tail = [n for s in from_flow(parse_lengths("lognormal:20:0.5:0.3"), 64, 8, 4000, 4, seed=3) for w in s
            for n in w.responses]
    assert sorted(tail)[len(tail) // 2] == pytest.approx(20, rel=0.2) and max(tail) > 3 * 20
    assert from_flow(parse_lengths("geometric:10"), 8, 2, 64, 3, seed=5) == \
        from_flow(parse_lengths("geometric:10"), 8, 2, 64, 3, seed=5)


@pytest.mark.parametrize(("spec", "message"), [
    ("zipf:3", "--lengths 'zipf:3': unknown distribution 'zipf'"),
    ("uniform:9:3", "--lengths 'uniform:9:3': uniform takes 2 positive numbers (LO <= HI)"),
    ("fixed:x", "--lengths 'fixed:x': its parameters must be numbers"),
    ("lognormal", "--lengths 'lognormal': lognormal takes 1 to 3 positive numbers"),
])
def test_a_bad_length_distribution_is_named(spec: str, message: str):
    with pytest.raises(FlowError) as e:
        parse_lengths(spec)
    assert str(e.value).splitlines()[0].endswith(message)


def prompt_seqs(prompts: int, prefix: int) -> list[Seq]:
    return [Seq(p, p, 10, 5, skip=prefix) for p in range(prompts)]


def test_deduplicated_prefill_one_owner_computes_the_takers_wait_for_its_keys_and_values():
    # two instances, two prompts each of 10 tokens opening with a 6-token prefix; each prompt prefills its 4-token
    # rest (4 ms); the owner computes the prefix (6 ms), the taker receives it 6 ms + 2 ms (the link) in
    seqs = prompt_seqs(4, 6)
    parts = [PrefixPart(compute=6), PrefixPart(take=((0, 6),))]
    res = Gen(Flat(link_s=0.002), SHAPE, 1, 8, [seqs[:2], seqs[2:]], prefixes=parts).run()
    assert res.instances[0].released == pytest.approx(0.006 + 0.008 + 0.050)
    assert res.instances[1].released == pytest.approx(0.008 + 0.008 + 0.050)
    assert res.prefill[0]["prefill_tokens"] == 6 and res.prefill[1]["handover_tokens"] == 6
    assert res.prefill[1]["handover_s"] == pytest.approx(0.008)
    # past its patience (5 ms) the taker computes the prefix itself after waiting that long
    impatient = [PrefixPart(compute=6), PrefixPart(take=((0, 6),), patience_s=0.005)]
    fresh = prompt_seqs(4, 6)
    res = Gen(Flat(link_s=0.002), SHAPE, 1, 8, [fresh[:2], fresh[2:]], prefixes=impatient).run()
    assert res.instances[1].released == pytest.approx(0.005 + 0.006 + 0.008 + 0.050)
    assert res.prefill[1]["handover_missed"] == 1 and res.prefill[1]["prefill_tokens"] == 6


def test_a_migration_sink_holds_its_device_until_every_source_has_released():
    # the sink (instance 1) finishes its one short sequence at 20 ms but waits for instance 0 (50 ms)
    a, b = Seq(0, 0, 0, 5), Seq(1, 1, 0, 2)
    res = Gen(Flat(), SHAPE, 1, 8, [[a], [b]], sinks={1: {0}}).run()
    assert res.instances[1].released == pytest.approx(0.050) and res.instances[0].released == pytest.approx(0.050)
    assert res.instances[1].busy == pytest.approx(0.020)  # idle while waiting: held, not busy


def work(samples: int = 1) -> FlowWork:
    return FlowWork("toy", {"actor": SHAPE}, Call("gen", "generate", "actor", share_prefix=True),
                    (Call("ref", "logprobs", "actor"),), (Call("up", "update", "actor"),), 4, samples, 64)


def test_prewarm_from_the_step_history_starts_a_pool_ahead_of_its_earliest_call():
    cost = Flat()
    cost.f = replace(cost.f, cold_start_s=0.1)
    pol = rlhfless.RLHFless(cost, work(), policies.Options(gen_tp=1, tau=1.0, margin_s=0.05))
    step = tuple(PromptWork(p, 10, (30,)) for p in range(4))
    first = pol.step(step)
    # step 1: no history; every pool's instances start cold when their call comes (generation at 0, the
    # forwards when generation ends: 10 ms prefill + 30 x 10 ms decoding)
    assert first.notes["start_wait_s"] == pytest.approx(0.1) and first.notes["fwd_start_wait_s"] == pytest.approx(0.1)
    fwd = pol.pools["inference"]
    assert fwd.offsets == pytest.approx([0.1 + 0.31]) and (fwd.ready_s, fwd.needed) == (pytest.approx(0.1), 4)
    # step 2: start the forward pool's 4 instances 0.41 - 0.05 - 0.1 s into the step; generation's call comes
    # at the step's start, so its 4 start then (less time than a start takes)
    assert fwd.plan(0.05, True) == (pytest.approx(0.26), 4)
    assert pol.pools["generation"].plan(0.05, True) == (0.0, 4)
    second = pol.step(step)
    assert second.notes["fwd_start_wait_s"] == 0.0 and second.notes["cold_starts"] == 0
    # held from their early start to the call: generation on one instance now (the flat decode curve measured
    # says more instances buy no time) ends at 4 x 10 ms prefill + 0.3 s, so 4 x (0.34 - 0.26) device-seconds
    assert second.notes["instances"] == 1
    assert second.pools["inference"].starting == pytest.approx(4 * (0.34 - 0.26))
    # step 3: the second step's calls found their instances warm: nothing to pre-warm
    assert fwd.plan(0.05, True) is None and pol.pools["generation"].plan(0.05, True) is None


def test_rlhfless_plans_the_deduplicated_prefill_by_the_backends_rule():
    # 4 prompts sharing a 6-token prefix on 4 instances: step 1 hands over (nothing measured yet), and learns
    # the rates; the link (50 ms) costs more than recomputing 6 tokens (6 ms): from then on each computes it
    cost = Flat(link_s=0.050)
    pol = rlhfless.RLHFless(cost, work(), policies.Options(gen_tp=1, tau=1.0, cost_weight=1.0))
    step = tuple(PromptWork(p, 10, (30,), prefix_len=6) for p in range(4))
    first = pol.step(step)
    assert first.notes["prefill_handover"] == 1.0
    # a handover measured from asking to holding: the owner computing (6 ms) and the link (50 ms)
    assert pol.rates.rate_s == pytest.approx(0.001) and pol.rates.handover_s == pytest.approx(0.056)
    parts = pol._prefixes(step, ((0,), (1,), (2,), (3,)), policies.seqs_of(step))
    assert parts == [PrefixPart(compute=6, patience_s=pytest.approx(0.006))] * 4
    off = rlhfless.RLHFless(cost, work(), policies.Options(gen_tp=1, tau=1.0, dedup="off"))
    assert "prefill_handover" not in off.step(step).notes


def test_simulate_takes_a_length_distribution_and_names_a_bad_one(capsys: pytest.CaptureFixture[str]):
    from flowrl.cli import main

    flow = str(ROOT / "examples/longtail_grpo.flow")
    args = ["simulate", flow, "--cluster", "l40s:1", "--model", "actor=qwen2.5-0.5b", "--steps", "3", "--json",
            "--policy", "rlhfless"]
    assert main([*args, "--lengths", "uniform:8:32", "--dedup", "handover"]) == 0
    summary = json.loads(capsys.readouterr().out)[0]
    assert summary["policy"] == "rlhfless" and summary["notes"]["prefill_handover"] >= 0.0  # the data's prefix
    assert main([*args, "--lengths", "zipf:2"]) != 0
    assert "--lengths 'zipf:2': unknown distribution 'zipf'" in capsys.readouterr().err


def test_a_call_that_comes_before_the_prewarm_time_starts_its_own_instances():
    # history: the call came 5 s into the step, a start takes 1 s: pre-warm 3.95 s in (margin 0.05 s)
    def pool() -> rlhfless.Pool:
        return rlhfless.Pool(offsets=[5.0], ready_s=1.0, needed=2, warm=2)

    # this step the call comes at 1 s, before the timer: the backend cancels it, the call starts the instances
    ready, held_from, unused = pool().start(1.0, 2, 0.1, 1.0, 0.05, True)
    assert (ready, held_from, unused) == ([pytest.approx(1.1)] * 2, [1.0, 1.0], (0, 0.0))
    # at 4 s: started at 3.95 s (held from then), ready at 4.05 s; a third pre-warmed one the call did not take
    p = rlhfless.Pool(offsets=[5.0], ready_s=1.0, needed=3, warm=3)
    ready, held_from, unused = p.start(4.0, 2, 0.1, 1.0, 0.05, True)
    assert ready == [pytest.approx(4.05)] * 2 and held_from == [pytest.approx(3.95)] * 2
    assert unused == (1, pytest.approx(3.95))
