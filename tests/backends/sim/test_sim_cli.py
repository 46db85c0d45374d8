"""`flowrl simulate` and `flowrl plan` end to end, and the trace `flowrl timeline` draws
(flowrl.backends.sim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.backends.sim.commands import versus
from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.hardware import load_cluster
from flowrl.backends.sim.plan import best, plans
from flowrl.backends.sim.policies import Options
from flowrl.backends.sim.registry import make
from flowrl.backends.sim.shapes import known
from flowrl.backends.sim.work import flow_work
from flowrl.backends.sim.workload import LongTail, synthetic
from flowrl.cli import main
from flowrl.compiler import compile_file
from flowrl.ir.printer import to_json
from flowrl.viz.timeline import load_spans

ROOT = Path(__file__).resolve().parents[3]
GRPO = str(ROOT / "examples/longtail_grpo.flow")
PPO = str(ROOT / "examples/longtail_ppo.flow")


def test_simulate_compares_policies_and_writes_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    args = ["simulate", GRPO, "--cluster", "l40s:2", "--model", "actor=qwen2.5-3b", "--prompts", "64",
            "--max-tokens", "1024", "--steps", "6", "--policy", "serverful,rlhfuse,rlhfless,pipe-rlhf",
            "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "policy rlhfless on l40s:2 (16 devices), 6 steps (means over 5)" in out
    assert "against serverful:" in out and "rlhfless" in out.split("against serverful:")[1]
    for policy in ("serverful", "rlhfuse", "rlhfless", "pipe-rlhf"):
        spans, names = load_spans(tmp_path / policy)
        assert {int(s["args"]["step"]) for s in spans} == set(range(1, 7))
        summary = json.loads((tmp_path / policy / "simulation.json").read_text())
        assert summary["policy"] == policy and summary["device_s"] > 0
    _, names = load_spans(tmp_path / "rlhfless")
    assert {"generation", "generation instances", "inference", "training"} <= set(names.values())
    assert main(["timeline", str(tmp_path / "rlhfless"), "-o", str(tmp_path / "t.png")]) == 0


def test_the_comparison_says_faster_slower_fewer_more_or_same() -> None:
    assert versus(1.0, 0.5, 10.0, 7.0) == "step 2.00x faster, 30.0% fewer device-seconds"
    assert versus(1.0, 4.0, 10.0, 25.0) == "step 4.00x slower, 150.0% more device-seconds"
    # what would print as 1.00x and -0.0% is the same
    assert versus(1.0, 1.001, 10.0, 10.0004) == "same step time, same device-seconds"


def test_simulated_cost_sums_equal_the_trace_spans(tmp_path: Path):
    g = to_json(compile_file(GRPO))
    work = flow_work(g, {"actor": known("qwen2.5-7b")}, prompts=32, max_tokens=512)
    steps = synthetic(LongTail(prompts=32, samples=8, max_tokens=512, median=100), 4)
    pol = make("rlhfless", CostModel(load_cluster("h100")), work, Options())
    for step in steps:
        r = pol.step(step)
        inst = [s for s in r.spans if s.track == "generation instances"]  # one device each (tp 1)
        assert r.pools["generation"].held == pytest.approx(sum(s.end - s.start for s in inst)
                                                           + r.pools["generation"].starting)


def test_simulate_errors_are_located(capsys: pytest.CaptureFixture[str]):
    assert main(["simulate", GRPO, "--cluster", "tpu"]) == 1
    assert "cluster 'tpu': no such built-in cluster" in capsys.readouterr().err
    assert main(["simulate", GRPO, "--cluster", "h100", "--policy", "fastest"]) == 1
    assert "unknown fastest" in capsys.readouterr().err
    assert main(["simulate", GRPO, "--cluster", "h100", "--model", "actor"]) == 1
    assert "expected NAME=SHAPE" in capsys.readouterr().err
    assert main(["simulate", GRPO, "--cluster", "l40s", "--model", "actor=llama-2-70b", "--gen-tp", "1"]) == 1
    assert "does not fit on 1 x L40S-48G" in capsys.readouterr().err


def test_simulate_replays_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    rows = [{"step": k, "node": "rollout", "prompt_id": list(range(16)), "prompt_len": [24] * 16,
             "response_len": [[(p * 7 + k) % 64 + 1] * 8 for p in range(16)]} for k in range(1, 4)]
    (tmp_path / "lengths.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": k, "step_time_s": 1.0, "time/scores": 0.5})
                                                      for k in range(1, 4)))
    assert main(["simulate", GRPO, "--cluster", "cpu", "--trace", str(tmp_path), "--steps", "3", "--json"]) == 0
    [summary] = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and summary["pools"]["all"]["held_s"] == pytest.approx(summary["step_s"])


def test_plan_respects_memory_and_ranks_by_the_objective(capsys: pytest.CaptureFixture[str]):
    g = to_json(compile_file(PPO))
    work = flow_work(g, {"actor": known("llama-2-70b"), "critic": known("llama-2-13b")}, prompts=256, samples=1,
                     max_tokens=512)
    cost = CostModel(load_cluster("h100:16"))
    step = synthetic(LongTail(prompts=256, samples=1, max_tokens=512, median=100), 1)[0]
    found = plans(cost, work, step)
    assert found
    for p in found:
        for t in p.trains:
            assert cost.train_memory(work.shapes[t.model], p.train, t.tp, t.pp, 1.0) <= 0.9 * cost.dev.memory
        assert p.gen_tp * 0.9 * cost.dev.memory > work.shapes["actor"].weight_bytes
    fastest = best(cost, work, step, "time", top=3)
    assert fastest[0].time_s == min(p.time_s for p in found)
    cheapest = best(cost, work, step, "cost", top=3)
    assert cheapest[0].device_s == min(p.device_s for p in found)
    assert main(["plan", PPO, "--cluster", "h100:16", "--model", "actor=llama-2-70b", "--model",
                 "critic=llama-2-13b", "--prompts", "256", "--samples", "1", "--max-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "best 5 plans on h100:16 (128 x H100-SXM-80G) by time" in out


def test_plan_says_when_nothing_fits(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", PPO, "--cluster", "l40s", "--model", "actor=llama-65b", "--prompts", "8"]) == 1
    assert "no plan fits" in capsys.readouterr().err
