"""Held device-time as the cluster counts it (backends/serverless/held.py): the attempts' arithmetic with worked
values, and the whole run's `cost/held_s` against a second driver on the same Ray cluster that integrates the
device slots in use from `ray.available_resources()` over the same run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from flowrl.backends.serverless.held import Attempt, held_by_task, settled


def attempt(name: str, worker: str, queued: float, granted: float | None, ended: float | None, shape: str = "serve",
            n: int = 0) -> Attempt:
    return Attempt(name, n, worker, shape, queued, granted, ended)


def test_each_attempt_holds_from_its_grant_to_its_end() -> None:
    held = held_by_task([attempt("a", "w1", 0.0, 0.5, 2.0), attempt("b", "w2", 0.0, 0.2, 1.2),
                         attempt("c", "w3", 1.0, None, None)])  # c: never granted yet, counts nothing
    assert held == pytest.approx({"a": 1.5, "b": 1.0})


def test_a_lease_kept_for_the_next_task_of_its_shape_counts_the_gap() -> None:
    # b was waiting (queued at 1.0) when a ended at 2.0 on w1, and got w1 at 2.1: the slot never went back
    kept = held_by_task([attempt("a", "w1", 0.0, 0.5, 2.0), attempt("b", "w1", 1.0, 2.1, 3.0)])
    assert kept == pytest.approx({"a": 1.5, "b": 1.0})
    # not waiting when a ended: a new lease (the slot was free from 2.0 to 2.5)
    assert held_by_task([attempt("a", "w1", 0.0, 0.5, 2.0), attempt("b", "w1", 2.4, 2.5, 3.0)]) == pytest.approx(
        {"a": 1.5, "b": 0.5})
    # another shape (the pre-warm function) cannot take a's lease
    assert held_by_task([attempt("a", "w1", 0.0, 0.5, 2.0), attempt("b", "w1", 1.0, 2.1, 3.0, shape="prewarm")]
                        ) == pytest.approx({"a": 1.5, "b": 0.9})


def test_a_worker_started_for_a_waiting_lease_holds_from_its_launch() -> None:
    # b waited from 1.0; w2 was launched at 1.2 for its lease, ready at 1.8, and got b at 2.0: held from 1.2
    tasks = [attempt("a", "w1", 0.0, 0.1, 3.0), attempt("b", "w2", 1.0, 2.0, 2.5)]
    assert held_by_task(tasks, {"w1": (-5.0, -4.0), "w2": (1.2, 1.8)}) == pytest.approx({"a": 2.9, "b": 1.3})
    # c got w1's kept lease; w2, launched at 1.2 for c's lease and ready at 1.8, went to d (queued at 1.9): the
    # lease was d's from w2's launch
    tasks = [attempt("a", "w1", 0.0, 0.1, 2.0), attempt("c", "w1", 1.0, 2.0, 3.0), attempt("d", "w2", 1.9, 2.1, 2.6)]
    assert held_by_task(tasks, {"w2": (1.2, 1.8)}) == pytest.approx({"a": 1.9, "c": 1.0, "d": 0.5 + 0.9})
    # started ahead of a backlog (its first task came long after it was ready) or when nothing waited (Ray's
    # own pool): no lease held for it
    assert held_by_task(tasks, {"w2": (1.2, 1.3)})["d"] == pytest.approx(0.5)
    assert held_by_task([attempt("e", "w3", 5.0, 5.1, 6.0)], {"w3": (4.0, 4.5)}) == pytest.approx({"e": 0.9})


def test_a_lost_attempt_holds_until_its_retry_asks_and_the_task_sums_its_attempts() -> None:
    lost = attempt("a", "w1", 0.0, 0.1, None, n=0)  # its worker died: no end of its own
    retry = attempt("a", "w2", 1.1, 1.3, 2.3, n=1)
    got = settled([lost, retry])
    assert got[0].ended == 1.1 and got[1] == retry
    assert held_by_task(got) == pytest.approx({"a": 1.0 + 1.0})


def _timed(seconds: float) -> float:
    """A task that holds its lease for about `seconds` -> the seconds its own clock saw."""
    import time

    began = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - began


@pytest.mark.ray
def test_the_clock_reads_only_the_named_tasks_of_this_run(ray_session: Any) -> None:
    """One GCS request a task, by its id where the pool tracked it, else by its name in this job: the run's tasks
    are read (each held at least what its own clock saw), another prefix's are not, and a name whose events never
    come is said missing once the wait is over."""
    from flowrl.backends.serverless.held import TaskClock

    ray = ray_session
    timed = ray.remote(num_cpus=0)(_timed)
    mine = {f"heldrun/g/task-{i}": timed.options(name=f"heldrun/g/task-{i}").remote(0.2) for i in range(2)}
    other = timed.options(name="otherrun/g/task-0").remote(0.2)
    own = dict(zip(mine, ray.get(list(mine.values())), strict=True))
    ray.get(other)
    clock = TaskClock("heldrun/", wait_s=0.5)
    clock.track("heldrun/g/task-0", mine["heldrun/g/task-0"])  # by its id; task-1 by its name
    held, missing = clock.held([*mine, "heldrun/g/never"])
    assert missing == ["heldrun/g/never"] and set(held) == set(mine)
    assert all(len(held[n]) == 1 and held[n][0] >= own[n] for n in mine)  # the lease covers the task's own run
    assert {a.name for a in clock.attempts(["otherrun/g/task-0", *mine])} == set(mine)  # another run's: not read
    assert set(clock.seen) == set(mine)


@pytest.mark.ray
def test_tasks_whose_records_never_came_are_charged_by_their_timers_and_said(ray_session: Any) -> None:
    """The backend's whole-run total counts every task, each as the cluster counted it where its records came
    and by its own timers where they did not; `measured_frac` says how much of the total is the cluster's."""
    from flowrl.backends.serverless.backend import ServerlessBackend
    from flowrl.backends.serverless.held import TaskClock
    from flowrl.runtime.protocol import Usage

    ray = ray_session
    timed = ray.remote(num_cpus=0)(_timed)
    ran = ray.get(timed.options(name="fracrun/g/task-0").remote(0.2))
    be = ServerlessBackend()
    be.clock = TaskClock("fracrun/", wait_s=0.5)
    seen = Usage("p", "g", 1, 0.0, 0.0, 0.0, ran, False)
    lost = Usage("p", "g", 2, 0.0, 0.0, 0.0, 0.5, False)  # a task of the run whose events never came
    out = be._as_counted([seen, lost], {"fracrun/g/task-0": seen, "fracrun/g/task-1": lost}, {})
    assert [u.measured for u in out] == [True, False] and out[1] == replace(lost, measured=False)
    assert out[0].held_s >= ran and be.unmeasured == 1
    assert be.held_total_s == pytest.approx(out[0].held_s + 0.5)
    assert be.measured_frac == pytest.approx(out[0].held_s / (out[0].held_s + 0.5))


@pytest.mark.ray
def test_the_cost_report_holds_what_the_cluster_counted(tmp_path: Path, cluster: ModuleType) -> None:
    """Two integrals over the same run: the device slots Ray had reserved, sampled every ~10 ms by another
    driver, and the run's `cost/held_s` (start-up, pre-warmed waits, migration and scheduling included)."""
    flow = cluster.longtail_flow(tmp_path, "1..2", run=", prewarm = true")
    sampled, cost = cluster.sampled_run(flow, tmp_path, "serverless", slots=2, steps=6)
    assert sampled["samples"] > 100 and sampled["most_busy"] >= 1.0  # it saw the run
    cluster.check_held(cost, sampled)
    assert cost["measured_frac"] == 1.0 and cost["timed_s"] == 0.0  # every task's records came and were read


@pytest.mark.ray
def test_fixed_pools_hold_their_placement_groups_from_creation_to_removal(tmp_path: Path, ray_session: Any,
                                                                           split_grpo: Any) -> None:
    """The Ray backend's held device-time is its placement groups' lives: created before the first step, alive
    (and counted open) through every step, removed at shutdown; ranks times life."""
    from flowrl.backends.ray import RayBackend

    be = RayBackend()
    seen: list[tuple[int, list[Any]]] = []
    flowrl_run(split_grpo(steps=2), tmp_path, be,
               on_step=lambda step, row: seen.append((step, list(be.reserved))))
    assert [s for s, _ in seen] == [1, 2]
    for _, live in seen:
        assert sorted((r.group, r.ranks) for r in live) == [("gen", 1), ("train", 1)]
        assert all(r.removed is None for r in live)
    assert len(be.reserved) == 2 and all(r.removed is not None and r.removed > r.created for r in be.reserved)
    gen = next(r for r in be.reserved if r.group == "gen")
    assert gen.removed is not None and gen.held_s() == pytest.approx(gen.removed - gen.created)


def flowrl_run(graph: Any, out: Path, backend: Any, **kw: Any) -> Any:
    import flowrl

    return flowrl.run(graph, out_dir=out / "run", backend=backend, **kw)
