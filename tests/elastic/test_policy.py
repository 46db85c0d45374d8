"""The elastic-pool policy's pure functions, on worked values."""

from __future__ import annotations

import math

import pytest

from flowrl.elastic import (
    DecodeCurve,
    LengthPredictor,
    PrefixShare,
    choose_instances,
    estimate,
    hand_over,
    migration_target,
    ranked_runs,
    share_prefixes,
    should_migrate,
    spearman,
)
from flowrl.elastic.predict import resample
from flowrl.elastic.scale import decode_seconds


def test_ewma_per_prompt_with_window() -> None:
    p = LengthPredictor(window=3)  # alpha = 0.5
    p.observe(["a", "a", "b"], [10, 20, 4])  # a: mean 15, b: 4
    assert p.predict(["a", "b"], fallback=64) == [15.0, 4.0]
    p.observe(["a"], [5])
    assert p.predict(["a"], fallback=64) == [10.0]  # 0.5 * 5 + 0.5 * 15
    window_one = LengthPredictor(window=1)  # alpha = 1: only the last step counts
    window_one.observe(["a"], [10])
    window_one.observe(["a"], [30])
    assert window_one.predict(["a"], fallback=0) == [30.0]


def test_unseen_prompts_default_then_batch_mean_then_history_then_fallback() -> None:
    fresh = LengthPredictor()
    assert fresh.predict(["x"], fallback=64) == [64.0]
    p = LengthPredictor(window=2)
    p.observe(["a", "b"], [10, 30])
    assert p.predict(["a", "new"], fallback=64) == [10.0, 10.0]  # the mean of this batch's seen prompts
    assert p.predict(["new", "other"], fallback=64) == [20.0, 20.0]  # none seen in the batch: all history
    assert LengthPredictor(default=7).predict(["new"], fallback=64) == [7.0]
    with pytest.raises(ValueError, match="window"):
        LengthPredictor(window=0)
    with pytest.raises(ValueError, match="lengths"):
        p.observe(["a"], [1, 2])


def test_spearman_on_worked_values() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3, 4) vs (1, 3, 2, 4): 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [5, 7, 6, 9]) == pytest.approx(0.8)
    # ties share the average rank: (1.5, 1.5, 3) vs (1, 2, 3) -> Pearson on ranks = sqrt(3) / 2
    assert spearman([2, 2, 5], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1], [2])) and math.isnan(spearman([3, 3], [1, 2]))


def test_ranked_runs_are_contiguous_in_length_order() -> None:
    predicted = [50, 3, 20, 3, 64, 9, 1]
    runs = ranked_runs(predicted, 3)
    # order 1, 3, 3, 9, 20, 50, 64 (ties by index), cut where Batch.split cuts 7 rows in 3: at 2 and 5
    assert runs == [[6, 1], [3, 5, 2], [0, 4]]
    assert sorted(i for r in runs for i in r) == list(range(len(predicted)))
    assert ranked_runs([5, 1], 4) == [[1], [0]]
    assert ranked_runs([], 2) == []
    with pytest.raises(ValueError):
        ranked_runs([1], 0)


def test_migration_trigger_and_target() -> None:
    assert not should_migrate(6, 10) and should_migrate(7, 10) and not should_migrate(10, 10)
    assert should_migrate(5, 10, tau=0.5) and not should_migrate(0, 0)
    with pytest.raises(ValueError):
        should_migrate(1, 2, tau=0.0)
    assert migration_target({0: 5, 1: 8, 2: 8}, source=1, need=3) == 2
    assert migration_target({0: 5, 1: 8, 2: 8}, source=0, need=3) == 1  # ties: the lowest id
    assert migration_target({0: 2, 1: 9}, source=1, need=3) is None


def test_decode_curve_interpolates_and_extends() -> None:
    curve = DecodeCurve({1: 0.010, 4: 0.016, 8: 0.024})
    assert curve.seconds(2) == pytest.approx(0.012)
    assert curve.seconds(6) == pytest.approx(0.020)
    assert curve.seconds(16) == pytest.approx(0.040)  # beyond the last point: the last segment's slope
    assert curve.seconds(0) == 0.0
    assert DecodeCurve({4: 0.02}).seconds(100) == 0.02
    with pytest.raises(ValueError):
        DecodeCurve({})


def test_decode_time_counts_each_step_at_the_batch_still_running() -> None:
    curve = DecodeCurve({1: 1.0, 2: 1.5, 3: 2.0})
    # lengths 2, 2, 5: steps 1-2 with 3 running (2.0 each), steps 3-5 with 1 (1.0 each)
    assert decode_seconds([2, 2, 5], curve) == pytest.approx(7.0)
    assert decode_seconds([], curve) == 0.0


def test_estimate_and_the_cost_weighted_choice() -> None:
    curve = DecodeCurve({1: 1.0, 2: 1.0, 4: 1.0})  # a step costs 1 s at any batch up to 4
    predicted = [1, 1, 1, 10]  # one long prompt
    # one instance: 10 steps, 10 device-seconds; two: runs [0, 1] and [2, 3] -> 1 s and 10 s
    assert estimate(predicted, 1, 1, curve) == (10.0, 10.0)
    assert estimate(predicted, 1, 2, curve) == (10.0, 11.0)
    assert estimate(predicted, 1, 2, curve, start_s=2.0) == (12.0, 15.0)
    # a curve where batch size matters: four instances finish the short prompts in 1 step each
    busy = DecodeCurve({1: 1.0, 4: 4.0})
    t1, c1 = estimate(predicted, 1, 1, busy)  # steps 1 at 4 s, then 9 at 1 s: 13 s
    t4, c4 = estimate(predicted, 1, 4, busy)  # 1 + 1 + 1 + 10
    assert (t1, c1) == (13.0, 13.0) and (t4, c4) == (10.0, 13.0)
    # N = 2: runs [0, 1] (1 step at batch 2: 2 s) and [2, 3] (1 step at 2 s, 9 at 1 s: 11 s)
    assert estimate(predicted, 1, 2, busy) == (11.0, 13.0)
    # with 2 s to start an instance: T = 15, 13, 12 and C = 15, 17, 21 for N = 1, 2, 4
    choice = {w: choose_instances(predicted, 1, [4, 1, 2], busy, weight=w, start_s=2.0) for w in (0.0, 0.5, 1.0)}
    assert [(c.instances, c.time_s, c.device_s) for c in choice[1.0].candidates] == \
        [(1, 15.0, 15.0), (2, 13.0, 17.0), (4, 12.0, 21.0)]
    assert choice[1.0].chosen.instances == 4  # fastest
    assert choice[0.0].chosen.instances == 1  # fewest device-seconds
    # 0.5 * 13 / 12 + 0.5 * 17 / 15 = 1.108 beats 1.125 (N = 1) and 1.2 (N = 4)
    assert choice[0.5].chosen.instances == 2
    assert choice[0.5].chosen.score == pytest.approx(0.5 * 13 / 12 + 0.5 * 17 / 15)
    # equal scores: fewer instances
    assert choose_instances(predicted, 1, [1, 2, 4], busy, weight=0.0).chosen.instances == 1
    with pytest.raises(ValueError):
        choose_instances(predicted, 1, [1], busy, weight=1.5)


def test_profiles_keep_each_prompts_spread_of_sample_lengths() -> None:
    p = LengthPredictor(window=1)  # alpha 1: the last step only
    p.observe(["a"] * 4 + ["b"] * 4, [2, 10, 4, 4, 5, 5, 5, 5])
    assert p.predict(["a", "b"], fallback=0.0) == [5.0, 5.0]  # the same mean ...
    # ... but a's group waits for a sample of 10
    assert p.predict_profiles(["a", "b"], 4, fallback=0.0) == [[2.0, 4.0, 4.0, 10.0], [5.0, 5.0, 5.0, 5.0]]
    # a new prompt: its predicted mean (the seen ones' mean, 5) times the average shape
    # ([0.4, 0.8, 0.8, 2.0] and [1, 1, 1, 1] -> [0.7, 0.9, 0.9, 1.5])
    assert p.predict_profiles(["c"], 4, fallback=0.0)[0] == pytest.approx([3.5, 4.5, 4.5, 7.5])
    # another group size: the profile resampled at evenly spaced quantiles
    assert p.predict_profiles(["a"], 2, fallback=0.0) == [[2.0, 10.0]]
    assert p.predict_profiles(["a"], 7, fallback=0.0)[0] == pytest.approx([2, 3, 4, 4, 4, 7, 10])
    # EWMA per position of the sorted lengths (window 3: alpha 0.5)
    q = LengthPredictor(window=3)
    q.observe(["a", "a"], [2, 8])
    q.observe(["a", "a"], [6, 4])
    assert q.predict_profiles(["a"], 2, fallback=0.0) == [[3.0, 7.0]]
    restored = LengthPredictor(window=3)
    restored.load_state_dict(q.state_dict())
    assert restored.predict_profiles(["a"], 2, fallback=0.0) == [[3.0, 7.0]]


def test_estimate_with_profiles_waits_for_each_groups_longest_sample() -> None:
    curve = DecodeCurve({1: 1.0})
    predicted = [5.0, 5.0]
    # as means: every sample 5 steps; with the profiles, the instance holding prompt 0 runs 10 steps
    assert estimate(predicted, 2, 1, curve) == (5.0, 5.0)
    assert estimate(predicted, 2, 2, curve, profiles=[[0.0, 10.0], [5.0, 5.0]]) == (10.0, 15.0)
    choice = choose_instances(predicted, 2, [1, 2], curve, weight=1.0, profiles=[[0.0, 10.0], [5.0, 5.0]])
    assert [(c.instances, c.time_s) for c in choice.candidates] == [(1, 10.0), (2, 10.0)]


def test_resample_keeps_the_spread() -> None:
    assert resample([1.0, 2.0, 6.0], 3) == [1.0, 2.0, 6.0]
    assert resample([1.0, 2.0, 6.0], 1) == [3.0]  # one sample: the group's mean
    assert resample([4.0], 3) == [4.0, 4.0, 4.0]
    assert resample([0.0, 10.0], 5) == [0.0, 2.5, 5.0, 7.5, 10.0]


def test_prewarm_starts_a_stage_its_start_time_and_a_margin_before_its_earliest_start() -> None:
    from flowrl.elastic import prewarm_delay

    assert prewarm_delay([], ready_s=0.2) is None  # no history: nothing to go by
    assert prewarm_delay([0.9, 0.5, 0.7], ready_s=0.2, margin_s=0.05) == pytest.approx(0.25)
    assert prewarm_delay([0.1], ready_s=0.2, margin_s=0.05) == 0.0  # less time than a start: at the step's start


def test_a_prefix_on_several_instances_is_computed_by_the_first_and_taken_by_the_others() -> None:
    # prompts 0-5 on instances 0,0,1,1,1,2; prefix 0 opens prompts 1, 2, 5 (instances 0, 1, 2), prefix 1
    # opens prompts 3, 4 (instance 1 only)
    groups, instance_of = [[1, 2, 5], [3, 4]], [0, 0, 1, 1, 1, 2]
    assert share_prefixes(groups, instance_of, 3, hand_over=True) == [
        PrefixShare(compute=(0,), offer=(0,)),
        PrefixShare(compute=(1,), take=((0, 0),)),
        PrefixShare(take=((0, 0),)),
    ]
    assert share_prefixes(groups, instance_of, 3, hand_over=False) == [  # each holder computes it once
        PrefixShare(compute=(0,)), PrefixShare(compute=(0, 1)), PrefixShare(compute=(0,))]
    assert share_prefixes([[0, 1]], [0, 0], 2, hand_over=True) == [PrefixShare(compute=(0,)), PrefixShare()]


def test_hand_over_where_the_measured_transfer_costs_less_than_recomputing() -> None:
    assert hand_over(None, None) and hand_over(0.01, None) and hand_over(None, 5.0)  # unmeasured: measure it
    assert hand_over(0.010, 0.004) and not hand_over(0.004, 0.010) and not hand_over(0.004, 0.004)


def test_the_sink_is_the_instance_with_the_most_predicted_work() -> None:
    from flowrl.elastic import migration_sink

    assert migration_sink([5.0, 9.0, 7.0], [2, 2, 2]) == 1
    assert migration_sink([5.0, 9.0, 9.0], [2, 2, 2]) == 2  # ties: the later (the length order's end)
    assert migration_sink([4.0], [3]) is None  # one instance: nothing to migrate


def test_a_generation_plan_on_worked_values() -> None:
    from flowrl.elastic import plan_generation

    predicted = [50.0, 3.0, 20.0, 3.0, 64.0, 9.0, 1.0]
    # nothing measured: every instance, length-ranked runs cut as Batch.split cuts, the sink the longest run
    first = plan_generation(predicted, 1, 3, {}, 0.0, 0.5, 0.7)
    assert (first.instances, first.runs, first.sink, first.choice) == (3, ((6, 1), (3, 5, 2), (0, 4)), 2, None)
    # assignment off: data order; migration off (tau 1): no sink
    assert plan_generation(predicted, 1, 3, {}, 0.0, 0.5, 1.0, assign=False).runs == ((0, 1), (2, 3, 4), (5, 6))
    assert plan_generation(predicted, 1, 3, {}, 0.0, 0.5, 1.0).sink is None
    # a measured flat curve with 2 s to start an instance: weight 0 buys the fewest device-seconds, one instance
    one = plan_generation(predicted, 1, 3, {1: 1.0}, 2.0, 0.0, 0.7)
    assert (one.instances, one.runs, one.sink) == (1, ((6, 1, 3, 5, 2, 0, 4),), None)
    assert one.choice is not None and one.choice.chosen.time_s == 66.0  # 2 s start + 64 steps
    assert plan_generation(predicted, 1, 1, {1: 1.0}, 0.0, 0.5, 0.7).runs == ((0, 1, 2, 3, 4, 5, 6),)


def test_learning_the_decode_curve_and_the_start_overhead() -> None:
    from flowrl.elastic import learn_decode, start_overhead

    curve = learn_decode({}, [(4, 10, 2.0), (2, 0, 0.5), (0, 3, 9.0)])  # 0.2 s a step; 0 steps count as 1
    assert curve == {4: 0.2, 2: 0.5}
    assert learn_decode(curve, [(4, 20, 2.0)])[4] == pytest.approx(0.15)  # an even EWMA with the old point
    assert start_overhead([(0.3, False), (0.5, False), (2.0, True)]) == pytest.approx(0.4)  # warm ones only
    assert start_overhead([(2.0, True)]) == 0.0


def test_prewarm_plan_and_what_a_call_teaches_it() -> None:
    from flowrl.elastic import learn_start, prewarm_plan

    assert prewarm_plan([], 0.2, 3) is None and prewarm_plan([0.9], 0.2, 0) is None
    assert prewarm_plan([0.9], 0.2, 3, margin_s=0.05) == (pytest.approx(0.65), 3)
    assert prewarm_plan([0.9], 0.2, 3, enabled=False) is None
    assert learn_start(0.0, 0, [1.5, 2.0], 3, first=True) == (2.0, 3)  # cold ones: the slowest start
    assert learn_start(2.0, 3, [], 3, first=True) == (2.0, 0)  # all warm: nothing to pre-warm next step
    assert learn_start(2.0, 3, [], 3, first=False) == (2.0, 3)  # a later call does not decide


def test_the_hand_over_decision_and_its_patience() -> None:
    from flowrl.elastic import HandOver, PrefillRates, decide_hand_over

    def fields(h: HandOver) -> tuple[bool, float | None, float | None]:
        return h.handing, h.patience_s, h.recompute_s

    assert fields(decide_hand_over("auto", None, None, [6])) == (True, 1.0, None)  # unmeasured: hand over, 1 s
    # recomputing 8 tokens on average at 1 ms a token: 8 ms; a 4 ms handover wins, a 10 ms one does not
    assert fields(decide_hand_over("auto", 0.001, 0.004, [6, 10])) == (True, pytest.approx(0.008),
                                                                         pytest.approx(0.008))
    assert decide_hand_over("auto", 0.001, 0.010, [6, 10]).handing is False
    assert decide_hand_over("local", 0.001, 0.001, [6]).handing is False
    assert fields(decide_hand_over("handover", 0.001, 9.0, [6])) == (True, None, pytest.approx(0.006))
    rates = PrefillRates()
    rates.learn([{"prefill_s": 0.006, "prefill_tokens": 6.0}, {"handover_s": 0.05, "handover_tokens": 6.0}])
    assert (rates.rate_s, rates.handover_s) == (pytest.approx(0.001), 0.05)


def test_an_instance_with_slots_decodes_at_most_that_many_at_once() -> None:
    from flowrl.elastic import decode_steps

    curve = DecodeCurve({1: 1.0, 2: 1.5, 3: 2.0})
    # slots 2: samples of 2 and 2 run together (2 steps at 1.5 s), then the 5 alone (5 steps at 1 s)
    assert decode_seconds([2, 2, 5], curve, slots=2) == pytest.approx(8.0)
    assert decode_steps([2, 2, 5], slots=2) == 7 and decode_steps([2, 2, 5]) == 5
    assert decode_seconds([2, 2, 5], curve, slots=1) == pytest.approx(9.0)  # one after another
    assert decode_seconds([2, 2, 5], curve, slots=3) == decode_seconds([2, 2, 5], curve)  # room for all
    # the order they enter in matters: the 5 first shares its steps with both 2s (2 x 1.5 s, 2 x 1.5 s, 1 s)
    assert decode_seconds([5, 2, 2], curve, slots=2) == pytest.approx(7.0)
    # the choice sees it: one instance of 1 slot takes 3 samples in turn, three take them at once
    flat = DecodeCurve({1: 1.0})
    choice = choose_instances([4.0, 4.0, 4.0], 1, [1, 3], flat, weight=1.0, slots=1)
    assert [(c.instances, c.time_s) for c in choice.candidates] == [(1, 12.0), (3, 4.0)]
