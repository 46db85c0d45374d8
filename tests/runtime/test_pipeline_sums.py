"""examples/sums_pipeline.flow end to end (issue 27's learning bar): SFT on the demonstrations of half the sums, a
reward model trained on the example's preference pairs that ranks the held-out pairs right at least 90% of the time,
then PPO against it: the policy's greedy answers, judged by the hidden rule (examples/judge_sums.py), are clearly
better at the end than after SFT alone. About 3 minutes on 2 cores (measured: held-out accuracy 1.0; 48 -> 69 of
100 sums right)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.judge_sums import Judge  # the repository root is on the path, as `tests.` imports need
from flowrl import backends
from flowrl.compiler import compile_any
from flowrl.dsl.stages import Pipeline
from flowrl.runtime.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[2]
FLOW = ROOT / "examples" / "sums_pipeline.flow"


@pytest.mark.slow
def test_sft_then_reward_model_then_ppo_beats_sft_alone(tmp_path: Path) -> None:
    pipe = compile_any(str(FLOW))
    assert isinstance(pipe, Pipeline) and pipe.names == ("sft", "rm", "rm_anneal", "ppo")
    run_pipeline(pipe, out_dir=tmp_path, backend=lambda stage: backends.make("local"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    held = [r["rm/eval_accuracy"] for r in rows if r["stage"] == "rm_anneal" and "rm/eval_accuracy" in r]
    assert held and held[-1] >= 0.9, held  # 200 pairs of a sum and a wrong answer never seen together
    judge = Judge(str(FLOW))
    last = {name: max((tmp_path / "stages" / name / "checkpoints").glob("step_*.pt")) for name in ("sft", "ppo")}
    after_sft = sum(judge.answers(judge.checkpoint(last["sft"])))
    after_ppo = sum(judge.answers(judge.checkpoint(last["ppo"])))
    assert after_ppo >= after_sft + 10, (after_sft, after_ppo)  # of 100 sums
