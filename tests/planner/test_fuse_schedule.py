"""The fused actor/critic training schedule: valid (checked by an independent replay of its JSON), never below
its lower bound, no worse than its greedy start, memory optimised without a longer makespan, deterministic."""

from __future__ import annotations

import json

import pytest

from flowrl.cli import main
from flowrl.planner.fuse_schedule import Problem, lower_bound, solve


def replay(p: Problem, out: dict) -> tuple[float, list[float]]:
    """Makespan and peak memory of the JSON schedule, recomputed from the problem statement alone."""
    end: dict[tuple, float] = {}
    pos = [0] * p.a
    free = [0.0] * p.a
    nodes = out["schedule"]
    total = sum(len(n) for n in nodes)
    seen = set()
    while len(end) < total:
        moved = False
        for n, tasks in enumerate(nodes):
            while pos[n] < len(tasks):
                t = tasks[pos[n]]
                j, c, k, kind = t["model"], t["copy"], t["mb"], t["kind"]
                stages = p.a if j == 0 else p.b
                stage = n if j == 0 else (c + 1) * p.b - 1 - n  # where the statement puts it
                assert 0 <= stage < stages
                if kind == "F":
                    deps = [(j, c, k, stage - 1, "F")] if stage > 0 else []
                else:
                    deps = [(j, c, k, stage, "F")] if stage == stages - 1 else [(j, c, k, stage + 1, "B")]
                if any(d not in end for d in deps):
                    break
                dur = p.fwd[j] * (1 if kind == "F" else 2)
                start = max([free[n], *(end[d] for d in deps)])
                key = (j, c, k, stage, kind)
                assert key not in seen
                seen.add(key)
                end[key] = free[n] = start + dur
                pos[n] += 1
                moved = True
        assert moved, "the schedule deadlocks"
    expected = {(0, 0, k, s, f) for k in range(p.m[0]) for s in range(p.a) for f in "FB"}
    expected |= {(1, c, k, s, f) for c in range(p.a // p.b) for k in range(p.m[1] // (p.a // p.b))
                 for s in range(p.b) for f in "FB"}
    assert seen == expected  # every task once, on its own node
    peaks = []
    for tasks in nodes:
        held = peak = 0.0
        for t in tasks:
            held += p.mem[t["model"]] if t["kind"] == "F" else -p.mem[t["model"]]
            peak = max(peak, held)
        peaks.append(peak)
    return max(free), peaks


CASES = [Problem(4, 2, (8, 8), (1.0, 0.5)), Problem(4, 4, (4, 6), (1.0, 1.0), (2.0, 1.0)),
         Problem(6, 3, (5, 4), (0.7, 1.3)), Problem(2, 1, (3, 4), (1.0, 0.25))]


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"A{p.a}B{p.b}")
def test_schedule_is_valid_and_between_its_bounds(p: Problem) -> None:
    s = solve(p, seed=1, iters=3000)
    out = s.to_json()
    makespan, peaks = replay(p, out)
    assert makespan == pytest.approx(s.makespan) and peaks == pytest.approx(s.peak_memory)
    assert s.lower_bound - 1e-9 <= s.makespan <= s.greedy_makespan + 1e-9
    assert json.loads(json.dumps(out)) == out and set(out) == {"makespan", "lower_bound", "peak_memory", "schedule"}


def test_lower_bound_worked_values() -> None:
    # model 0: 3 * 1 * (8 + 4 - 1) = 33; model 1 per copy: 3 * 0.5 * (4 + 2 - 1) = 7.5; node work 3 * (8 + 2) = 30
    assert lower_bound(Problem(4, 2, (8, 8), (1.0, 0.5))) == pytest.approx(33.0)
    # one node: everything in sequence, and the schedule meets it
    one = Problem(1, 1, (3, 2), (1.0, 2.0))
    assert lower_bound(one) == pytest.approx(3 * (3 * 1.0 + 2 * 2.0))
    assert solve(one, iters=200).makespan == pytest.approx(lower_bound(one))


def test_fusing_fills_each_pipelines_bubbles() -> None:
    p = Problem(4, 2, (8, 8), (1.0, 0.5))
    s = solve(p, seed=0)
    alone = 3 * 1.0 * (8 + 3) + 3 * 0.5 * (4 + 1)  # the two pipelines one after the other
    assert s.makespan < alone


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"A{p.a}B{p.b}")
def test_memory_phase_keeps_the_makespan_and_never_raises_the_peak(p: Problem) -> None:
    span_only = solve(p, seed=3, iters=2000, memory=False)
    both = solve(p, seed=3, iters=2000)  # the same RNG draws up to the memory phase: the same phase-1 result
    assert both.makespan <= span_only.makespan + 1e-9
    assert max(both.peak_memory) <= max(span_only.peak_memory) + 1e-9


def test_same_seed_same_schedule() -> None:
    p = Problem(4, 2, (6, 4), (1.0, 0.6))
    assert solve(p, seed=7, iters=1500).to_json() == solve(p, seed=7, iters=1500).to_json()


def test_cli_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuse-schedule", "--pp", "4,2", "--microbatches", "4,4", "--fwd", "1,0.5", "--json",
                 "--iters", "500"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] >= out["lower_bound"] and len(out["schedule"]) == 4
    assert main(["fuse-schedule", "--pp", "4,3", "--microbatches", "4,4", "--fwd", "1,1"]) == 1
    assert "B = 3 must divide A = 4" in capsys.readouterr().err
    assert main(["fuse-schedule", "--pp", "4,2", "--microbatches", "4,3", "--fwd", "1,1"]) == 1
    assert "split evenly over its 2" in capsys.readouterr().err
    assert main(["fuse-schedule", "--pp", "4,2", "--microbatches", "4,4", "--fwd", "one,1"]) == 1
    assert "--fwd: expected two float values" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(8, 4, 8, 0.5), (8, 8, 16, 0.5), (16, 8, 8, 1.0), (8, 8, 8, 1.0)])
def test_rlhfuse_shapes_within_five_percent_of_the_bound(shape: tuple[int, int, int, float]) -> None:
    """RLHFuse's experiment shapes (large model PP 8 or 16, small model PP half or equal): within 5% of the lower
    bound (the sweep over 8-64 micro-batches: bench/fuse_schedule_sweep.py, bench/RESULTS_fuse_schedule.md)."""
    a, b, m, f1 = shape
    p = Problem(a, b, (m, m), (1.0, f1))
    s = solve(p, seed=0, iters=500)
    replay(p, s.to_json())
    assert s.makespan <= 1.05 * s.lower_bound, (shape, s.makespan, s.lower_bound)


@pytest.mark.parametrize("inst", [(8, 4, (8, 4), (5.0, 4.0), (1.95, 2.0)), (8, 8, (8, 8), (5.0, 2.0), (1.95, 1.0)),
                                  (16, 8, (16, 8), (2.0, 2.0), (1.64, 2.0))])
def test_published_rlhfuse_instances_within_five_percent(inst: tuple) -> None:  # type: ignore[type-arg]
    """The smallest of the instances FlexFusion published (bench/fuse_schedule_published.py runs all 12); the first
    needs the bubble-filled 1F1B start to reach its bound."""
    p = Problem(*inst)
    s = solve(p, seed=0)
    replay(p, s.to_json())
    assert s.makespan <= 1.05 * s.lower_bound, (inst, s.makespan, s.lower_bound)
