"""The late start of a fused stage's forward instances (flowrl.elastic.late): the pure functions on worked
values, one recorded sequence of chunk waits fed to the serverless backend's group and to the simulator's
policy (the same late starts), and the simulator's streamed stage taking it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flowrl.backends.serverless.group import ServerlessGroup
from flowrl.backends.serverless.instance import Build
from flowrl.backends.serverless.scaling import Policy
from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.rlhfless import RLHFless
from flowrl.backends.sim.work import Call
from flowrl.elastic import LATE_SHARE, SLACK_MEAN, late_start, update_slack
from tests.elastic.test_one_policy import RESPONSES, WORLD, recorded, simulator

# per step, what each forward instance waited for chunks with its slot held (seconds; the fourth step ran none)
WAITS: tuple[tuple[float, ...], ...] = ((4.0, 5.0), (1.0,), (0.2, 0.3), (), (0.5,))
# worked from the formulas, share 0.8, mean 0.5: slack 4.0 (4.0 + 0); 0.5*4.0 + 0.5*(1.0 + 3.2) = 4.1;
# 0.5*4.1 + 0.5*(0.2 + 3.28) = 3.79; unchanged; 0.5*3.79 + 0.5*(0.5 + 3.032) = 3.661
LATES = (0.0, 3.2, 3.28, 3.032, 3.032)
SLACKS = (4.0, 4.1, 3.79, 3.79, 3.661)


def test_late_start_is_the_share_of_the_learned_slack() -> None:
    assert (LATE_SHARE, SLACK_MEAN) == (0.8, 0.5) and Policy().late == LATE_SHARE
    assert late_start(None) == 0.0  # nothing measured yet: with the first chunk
    assert late_start(2.0) == pytest.approx(1.6)
    assert late_start(2.0, 0.5) == pytest.approx(1.0)
    assert late_start(2.0, 0.0) == 0.0  # ablated ("late")


def test_update_slack_is_a_moving_mean_of_the_least_wait_plus_the_late_start() -> None:
    assert update_slack(None, [], 0.0) is None  # no forward instance ran
    assert update_slack(1.5, [], 1.2) == 1.5
    assert update_slack(None, [3.0, 1.0], 0.0) == 1.0  # the first measure is taken whole
    assert update_slack(1.0, [0.5, 0.9], 1.6) == pytest.approx(0.5 * 1.0 + 0.5 * (0.5 + 1.6))  # 1.55
    assert update_slack(1.0, [0.5], 1.6, mean=0.25) == pytest.approx(0.25 * 1.0 + 0.75 * 2.1)


def _group(policy: Policy) -> ServerlessGroup:
    return ServerlessGroup("actor", None, Build(models=(), all_models=(), seed=0, device="cpu"), WORLD, "recorded",
                           policy=policy)


@pytest.mark.parametrize("share", [LATE_SHARE, 0.0])
def test_one_recorded_sequence_of_waits_gives_the_backend_and_the_simulator_the_same_late_starts(
        share: float) -> None:
    group = _group(replace(Policy(), late=share))
    sim = simulator()
    sim.opts = replace(sim.opts, late=share)
    theirs, ours = [], []
    for waits in WAITS:
        for side, lates in ((group, theirs), (sim, ours)):
            late = side.late_s()
            side.learn_slack(list(waits), late)
            lates.append((late, side.slack_s))
    assert theirs == ours
    if share:
        assert [late for late, _ in theirs] == pytest.approx(LATES)
        assert [slack for _, slack in theirs] == pytest.approx(SLACKS)
    else:  # ablated: with the first chunk every step; the slack is still learned
        assert all(late == 0.0 for late, _ in theirs) and theirs[0][1] == 4.0


def streamed(late: float, prewarm: bool = False) -> RLHFless:
    """The recorded run's simulator with a forward (a reference model's logprobs) fused with generation (no
    cold start, so that the forward instances are ready long before generation ends)."""
    pol = simulator()
    cost = CostModel(pol.cost.cluster, replace(pol.cost.f, cold_start_s=0.0))
    work = replace(pol.work, shapes={**pol.work.shapes, "ref": pol.work.shapes["actor"]},
                   forwards=(Call("ref_logp", "logprobs", "ref", stream=True),))
    return RLHFless(cost, work, replace(pol.opts, late=late, prewarm=prewarm))


def test_the_simulator_starts_a_fused_stages_forwards_late_and_holds_them_less() -> None:
    on, off = streamed(LATE_SHARE), streamed(0.0)
    slack: float | None = None
    for step in range(len(RESPONSES)):
        late, first = on.late_s(), on.step(recorded(step))
        base = off.step(recorded(step))
        assert first.notes["late_s"] == pytest.approx(late) and base.notes["late_s"] == 0.0
        assert first.pools["inference"].busy == pytest.approx(base.pools["inference"].busy)
        if step == 0:  # nothing measured yet: both start with the first finished sample
            assert late == 0.0 and first.pools["inference"].held == pytest.approx(base.pools["inference"].held)
        else:  # a share of the learned slack later: less held, and the slack is the backend's update
            assert late == pytest.approx(LATE_SHARE * (slack or 0.0)) and late > 0
            assert first.pools["inference"].held < base.pools["inference"].held
        assert on.slack_s == pytest.approx(update_slack(slack, [first.notes["chunk_wait_s"]], late))
        slack = on.slack_s


def test_a_returning_generation_instance_does_not_start_the_forwards_before_their_late_start() -> None:
    """RLHFless's testbed setting (bench/sim_papers.py: 16 L40S, Qwen2.5-3B GRPO, 256 prompts x 8, long-tailed
    responses, lambda 1), 8 steps. Its generation instances return at different times; when the first one's return
    started the forward instances whatever their late start, they held their devices waiting for chunks for most of
    generation (34 s a step) and the run held 22% more device-seconds than serverful pools (931 vs 761). Started
    late as learned, sooner only once every generation instance returned: 13 s a step, 18% fewer (623)."""
    from flowrl.backends.sim.hardware import load_cluster
    from flowrl.backends.sim.policies import Options
    from flowrl.backends.sim.shapes import known
    from flowrl.backends.sim.simulate import simulate
    from flowrl.backends.sim.work import flow_work
    from flowrl.backends.sim.workload import LongTail, synthetic
    from flowrl.compiler import compile_file
    from flowrl.ir.printer import to_json

    work = flow_work(to_json(compile_file("examples/longtail_grpo.flow")), {"actor": known("qwen2.5-3b")}, 256, 8,
                     2048)
    cost = CostModel(load_cluster("l40s:2"))
    load = synthetic(LongTail(prompts=256, samples=8, max_tokens=2048, median=300, dataset=1024), 8, seed=0)
    fixed = simulate("serverful", cost, work, load, Options())
    less = simulate("rlhfless", cost, work, load, Options(cost_weight=1.0))
    assert less.note("late_s") > 0
    assert less.held_s < fixed.held_s
