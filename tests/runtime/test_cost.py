"""The cost report (flowrl.runtime.cost): device-seconds held and busy per pool and step, summed at the end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import flowrl
from flowrl.runtime.controller import Span
from flowrl.runtime.cost import CostMeter, DeviceKeeps, Pool, Reservation, summary, table, union_s
from flowrl.runtime.protocol import Usage

FLOW = """
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3,
                      replicas = 2 }
model ref : reference { source = actor, replicas = 2 }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.01)
placement {
    pool gen   { gpus = 2 }
    pool train { gpus = 2 }
    actor.generate -> gen
    actor.update, ref -> train
}
run { steps = 3, seed = 2 }
"""


@pytest.mark.parametrize(("intervals", "want"), [
    ([], 0.0),
    ([(0.0, 1.0), (2.0, 3.0)], 2.0),
    ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlap counted once
    ([(0.0, 4.0), (1.0, 2.0)], 4.0),  # nested
    ([(2.0, 3.0), (0.0, 1.0), (0.5, 2.5)], 3.0),
])
def test_union(intervals: list[tuple[float, float]], want: float) -> None:
    assert union_s(intervals) == pytest.approx(want)


def test_the_meter_on_hand_made_spans() -> None:
    pools = [Pool("gen", ("gen",), 1), Pool("train", ("train",), 2)]
    meter = CostMeter(pools, starting_s=3.0, clock=10.0)
    spans = [Span("rollout", "generate", "gen", 1, 0.0, 1.0), Span("ref_logp", "logprobs", "train", 1, 1.0, 0.5),
             Span("actor.update", "update", "train", 1, 1.5, 1.0), Span("scores", "reward", "controller", 1, 1.0, 0.1)]
    first = meter.step(spans, now=14.0)  # 4 s since the groups were up
    assert first["cost/gen/held_s"] == 1 * 4.0 + 1 * 3.0 and first["cost/train/held_s"] == 2 * 4.0 + 2 * 3.0
    assert first["cost/gen/busy_s"] == 1.0 and first["cost/train/busy_s"] == 2 * 1.5
    assert first["cost/held_s"] == 21.0 and first["cost/busy_s"] == 4.0 and first["cost/starting_s"] == 9.0
    assert first["cost/idle_s"] == 21.0 - 4.0 - 9.0 and first["cost/cold_starts"] == 3
    second = meter.step([], now=16.0)
    assert second["cost/held_s"] == 3 * 2.0 and second["cost/starting_s"] == 0 and second["cost/cold_starts"] == 0


def test_a_run_reports_its_device_seconds_and_they_match_its_trace(tmp_path: Path) -> None:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "f.flow").write_text(FLOW)
    res = flowrl.run(flowrl.load(str(tmp_path / "f.flow")), out_dir=tmp_path / "out", backend="process")
    devices = {"gen": 2, "train": 2}  # the ranks each pool's group runs
    events = [e for e in json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X"]
    for row in res.metrics:
        assert row["cost/held_s"] == pytest.approx(sum(row[f"cost/{p}/held_s"] for p in devices))
        assert row["cost/busy_s"] == pytest.approx(sum(row[f"cost/{p}/busy_s"] for p in devices))
        for pool, n in devices.items():  # busy = the union of the pool's spans in trace.json, times its devices
            spans = [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
                     if e["args"]["group"] == pool and e["args"]["step"] == row["step"]]
            assert row[f"cost/{pool}/busy_s"] == pytest.approx(union_s(spans) * n, abs=1e-5)
            assert row[f"cost/{pool}/busy_s"] <= row[f"cost/{pool}/held_s"]
    assert [r["cost/cold_starts"] for r in res.metrics] == [4, 0, 0]  # every rank started once, cold
    saved = json.loads((tmp_path / "out" / "cost.json").read_text())
    assert saved == res.cost
    assert saved["held_s"] == pytest.approx(sum(r["cost/held_s"] for r in res.metrics))
    assert {p["pool"]: p["devices"] for p in saved["pools"]} == devices


def test_prices_put_money_in_the_report() -> None:
    rows = [{"step_time_s": 1800.0, "cost/held_s": 7200.0, "cost/busy_s": 3600.0, "cost/gen/held_s": 3600.0,
             "cost/gen/busy_s": 1800.0, "cost/train/held_s": 3600.0, "cost/train/busy_s": 1800.0}] * 2
    pools = [Pool("gen", ("gen",), 1), Pool("train", ("train",), 1)]
    assert "money" not in summary(rows, pools)
    report = summary(rows, pools, gpu_hour=2.0, cpu_hour=0.5)
    # two steps: 4 device-hours at 2.0, one hour of stepping at 0.5
    assert report["money"] == {"devices": 8.0, "controller": 0.5, "gpu_hour": 2.0, "cpu_hour": 0.5, "total": 8.5}
    assert [p["money"] for p in report["pools"]] == [4.0, 4.0]
    assert "money: 8.5000 = devices 8.0000 at 2 a device-hour + controller 0.5000 at 0.5 an hour" in table(report)


def test_a_negative_price_is_a_located_error(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    (tmp_path / "f.flow").write_text(FLOW.replace("run { steps = 3, seed = 2 }", "run { gpu_hour = -1.5 }"))
    with pytest.raises(flowrl.FlowError) as e:
        flowrl.load(str(tmp_path / "f.flow"))
    assert e.value.render() == (f"{tmp_path / 'f.flow'}:14:18: error: `gpu_hour` must be at least 0\n"
                                "    run { gpu_hour = -1.5 }\n"
                                "                     ^^^^\n"
                                "hint: a price per hour; 0 leaves money out of the cost report")


def test_a_negative_prewarm_margin_is_a_located_error(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    (tmp_path / "f.flow").write_text(FLOW.replace("run { steps = 3, seed = 2 }", "run { prewarm_margin = -1 }"))
    with pytest.raises(flowrl.FlowError) as e:
        flowrl.load(str(tmp_path / "f.flow"))
    assert e.value.render().startswith(f"{tmp_path / 'f.flow'}:14:24: error: `prewarm_margin` must be at least 0\n")


def test_an_unknown_dedup_prefill_is_a_located_error(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    (tmp_path / "f.flow").write_text(FLOW.replace("run { steps = 3, seed = 2 }", 'run { dedup_prefill = "once" }'))
    with pytest.raises(flowrl.FlowError) as e:
        flowrl.load(str(tmp_path / "f.flow"))
    assert e.value.render().startswith(
        f"{tmp_path / 'f.flow'}:14:23: error: `dedup_prefill` must be one of auto, handover, local, off\n")


def test_instances_that_keep_their_models_on_the_device_are_counted_and_said() -> None:
    """An elastic pool's tasks: those that left their models on the device (keep_warm = "device") are counted,
    the most memory one left above its floor is reported, and each task's span names its device."""
    from flowrl.runtime.cost import instance_spans
    from flowrl.runtime.protocol import Usage

    used = [Usage("gen", "gen", 11, 100.0, 0.5, 0.25, 1.0, True, device="cuda:1", gpu="7", left_bytes=0.0),
            Usage("gen", "gen", 12, 100.5, 0.0, 0.0, 2.0, False, device="cuda:0", gpu="5", kept_on_device=True,
                  left_bytes=4096.0),
            Usage("train", "train", 13, 101.0, 0.0, 0.1, 1.0, False, device="cpu")]
    row = CostMeter([Pool("gen", ("gen",), 2), Pool("train", ("train",), 1)], starting_s=0.0, clock=0.0).step(
        [], now=5.0, usage=used)
    assert row["cost/kept_on_device"] == 1.0 and row["cost/device_left_bytes"] == 4096.0
    assert row["cost/held_s"] == pytest.approx(1.75 + 2.0 + 1.1)
    assert [s.node for s in instance_spans(used, 1, 99.0)] == [
        "instance 11 (cold) on cuda:1, GPU 7", "instance 12 on cuda:0, GPU 5", "instance 13 on cpu"]
    report = summary([{"step": 1, **row}], [Pool("gen", ("gen",), 2), Pool("train", ("train",), 1)])
    assert report["kept_on_device"] == 1.0
    assert table(report).splitlines()[-1] == (
        '1 instance tasks kept their models on the device after giving it back (keep_warm = "device"): their '
        "processes held those devices 0.0 dev-s between tasks, counted in held dev-s (the report's own figure: the "
        "cluster counts them free)")


def test_the_report_says_how_much_of_held_the_cluster_counted() -> None:
    """Tasks the backend measured (their records came: `measured`) and tasks it could not (their own timers':
    `measured` False) give `measured_s`, `timed_s` and their share, in the rows, cost.json and the table; a
    backend that measures nothing (`measured` None) reports neither."""
    pools = [Pool("gen", ("gen",), 1)]
    used = [Usage("gen", "gen", 1, 0.0, 0.0, 0.0, 3.0, False, measured=True),
            Usage("gen", "gen", 2, 0.0, 0.0, 0.0, 1.0, False, measured=False)]
    rows = [{"step": 1, **CostMeter(pools, starting_s=0.0, clock=0.0).step([], now=5.0, usage=used)},
            {"step": 2, **CostMeter(pools, starting_s=0.0, clock=0.0).step([], now=5.0, usage=used[:1])}]
    assert (rows[0]["cost/measured_s"], rows[0]["cost/timed_s"], rows[0]["cost/measured_frac"]) == (3.0, 1.0, 0.75)
    assert rows[1]["cost/measured_frac"] == 1.0
    report = summary(rows, pools)
    assert (report["measured_s"], report["timed_s"], report["measured_frac"]) == (6.0, 1.0, pytest.approx(6 / 7))
    assert table(report).splitlines()[-1] == (
        "85.7% of the instance tasks' held dev-s is the cluster's own count; the rest, tasks whose task events Ray "
        "did not keep, is their own timers' (it misses scheduling and result transfer)")
    plain = CostMeter(pools, starting_s=0.0, clock=0.0).step([], now=5.0, usage=[replace(used[0], measured=None)])
    assert "cost/measured_frac" not in plain and "measured_frac" not in summary([{"step": 1, **plain}], pools)


class Reserved:
    """A backend whose pools the cluster reserves (flowrl.runtime.cost.Reserving), by hand."""

    def __init__(self, *reserved: Reservation):
        self.reserved = list(reserved)

    def reservations(self) -> list[Reservation]:
        return self.reserved


def test_reserved_pools_are_charged_their_reservations_from_the_grant_to_the_removal() -> None:
    """Wall clock = perf_counter + 1000. gen (1 rank) granted at 1002, train (2 ranks) at 1003; the groups were
    up at 1006 (perf 6), steps end at 1010 and 1012; removed at 1015 and 1014: start-up in the first step,
    the teardown in `ended`'s row, and the whole is ranks times life."""
    pools = [Pool("gen", ("gen",), 1), Pool("train", ("train",), 2)]
    be = Reserved(Reservation("gen", 1, 1002.0), Reservation("train", 2, 1003.0))
    meter = CostMeter(pools, starting_s=99.0, clock=6.0, reserving=be, wall=1000.0)  # starting_s: not used
    spans = [Span("rollout", "generate", "gen", 1, 6.5, 1.0), Span("actor.update", "update", "train", 1, 8.0, 1.0)]
    first = meter.step(spans, now=10.0)
    assert first["cost/gen/held_s"] == pytest.approx(8.0) and first["cost/train/held_s"] == pytest.approx(2 * 7.0)
    assert first["cost/starting_s"] == pytest.approx(4.0 + 2 * 3.0) and first["cost/cold_starts"] == 3
    assert first["cost/busy_s"] == pytest.approx(1.0 + 2.0)
    assert first["cost/idle_s"] == pytest.approx(22.0 - 3.0 - 10.0)
    second = meter.step([], now=12.0)
    assert second["cost/held_s"] == pytest.approx(3 * 2.0) and second["cost/starting_s"] == 0.0
    be.reserved = [Reservation("gen", 1, 1002.0, 1015.0), Reservation("train", 2, 1003.0, 1014.0)]
    [ended] = meter.ended(20.0, None)
    assert ended["cost/gen/held_s"] == pytest.approx(3.0) and ended["cost/train/held_s"] == pytest.approx(2 * 2.0)
    assert ended["cost/stopping_s"] == ended["cost/held_s"] == ended["cost/idle_s"] == pytest.approx(7.0)
    report = summary([{"step": 1, **first}, {"step": 2, **second}, ended], pools)
    assert report["held_s"] == pytest.approx(sum(r.held_s() for r in be.reserved)) == pytest.approx(13.0 + 22.0)
    assert report["stopping_s"] == pytest.approx(7.0) and report["starting_s"] == pytest.approx(10.0)
    assert "kept_s" not in report
    assert table(report).splitlines()[-1].endswith("(starting 10.0 dev-s, stopping 7.0 dev-s, 3 cold starts)")


def test_fixed_pools_without_a_cluster_keep_their_report_and_charge_no_teardown() -> None:
    meter = CostMeter([Pool("gen", ("gen",), 1)], starting_s=2.0, clock=0.0)
    assert meter.step([], now=3.0)["cost/held_s"] == 5.0
    assert meter.ended(10.0, None) == []
    assert "stopping_s" not in summary([meter.step([], now=4.0)], [Pool("gen", ("gen",), 1)])


def use(pid: int, began: float, held: float, *, group: str = "gen", cold: bool = False, kept: bool = True,
        lost: float = 0.0) -> Usage:
    return Usage(group, group, pid, began, 0.0, 0.0, 0.0 if lost else held, cold, kept_on_device=kept, lost_s=lost)


def test_a_process_that_keeps_models_on_its_device_holds_it_until_it_gives_them_up() -> None:
    """Worked values (wall clock). Process 1 keeps gen's models after a task over [0, 1]: held between tasks
    until its next gen task at 5 (warm: they were there all along), then kept again from 6 to the run's end."""
    keeps = DeviceKeeps()
    assert keeps.charge([use(1, 0.0, 1.0)], now=3.0) == pytest.approx({"gen": 2.0})  # open: charged as it goes
    assert keeps.charge([use(1, 5.0, 1.0)], now=8.0) == pytest.approx({"gen": 2.0 + 2.0})  # 3..5, then 6..8
    assert keeps.charge([], now=9.0) == pytest.approx({"gen": 1.0})  # the run's end
    # a task that gives its device back clean (kept false) ends nothing but its own hold
    assert DeviceKeeps().charge([use(2, 0.0, 1.0, kept=False)], now=4.0) == {}


def test_kept_models_given_up_by_an_eviction_or_a_lost_process_stop_counting_there() -> None:
    # process 1 keeps gen's models from 1; train builds its own there at 2 and 4; gen's next task there (at 6)
    # is cold: they were evicted by the last build before it (4), the latest they can have been there
    keeps = DeviceKeeps()
    got = keeps.charge([use(1, 0.0, 1.0), use(1, 2.0, 0.5, group="train", cold=True, kept=False),
                        use(1, 4.0, 0.5, group="train", cold=True, kept=False),
                        use(1, 6.0, 1.0, cold=True, kept=False)], now=10.0)
    assert got == pytest.approx({"gen": 3.0})
    # no build in between: the cold task dropped them at its own start
    assert DeviceKeeps().charge([use(1, 0.0, 1.0), use(1, 3.0, 1.0, cold=True, kept=False)], now=9.0) == \
        pytest.approx({"gen": 2.0})
    # process 1 was lost at 2.5 (an attempt there held its slot until its retry): gen's and train's kept models
    # went with it
    lost = DeviceKeeps()
    got = lost.charge([use(1, 0.0, 1.0), use(1, 1.5, 0.5, group="train"), use(1, 2.5, 0.0, lost=1.0)], now=9.0)
    assert got == pytest.approx({"gen": 1.5, "train": 0.5}) and not lost.open


def test_the_meter_charges_kept_devices_in_held_and_apart() -> None:
    """An elastic step's row: kept seconds in the pool's held and apart (`kept_s`), idle; at the end (`ended`)
    what was still kept."""
    pools = [Pool("gen", ("gen",), 1)]
    meter = CostMeter(pools, starting_s=0.0, clock=0.0, wall=100.0)
    row = meter.step([], now=5.0, usage=[use(1, 100.0, 1.0)])  # held over [100, 101], kept to 105
    assert row["cost/gen/kept_s"] == row["cost/kept_s"] == pytest.approx(4.0)
    assert row["cost/gen/held_s"] == row["cost/held_s"] == pytest.approx(5.0)
    assert row["cost/idle_s"] == pytest.approx(4.0)
    [end] = meter.ended(7.0, [])
    assert end["cost/kept_s"] == pytest.approx(2.0)
    report = summary([{"step": 1, **row}, end], pools)
    assert report["kept_s"] == pytest.approx(6.0) and report["held_s"] == pytest.approx(7.0)
