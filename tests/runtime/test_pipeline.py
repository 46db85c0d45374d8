"""A staged flow run on the local backend: weights carried between stages, per-stage outputs, the pipeline's
metrics, resume after an interrupted stage equal to an uninterrupted run, and `only` (`--stage`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl import backends
from flowrl.compiler import compile_any
from flowrl.dsl import Pipeline, Stage
from flowrl.errors import FlowError
from flowrl.runtime.carry import fit_weights
from flowrl.runtime.pipeline import PipelineResult, run_pipeline

FLOW = """flow two
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
run { steps = 3, seed = 3, checkpoint_every = 2 }
stage warm {
    step {
        rollout  = actor.generate(prompts, n = 4, max_tokens = 3)
        old_logp = actor.logprobs(rollout)
        scores   = correct(rollout)
        adv      = group_advantage(scores, group = 4)
        actor.update(rollout, old_logp = old_logp, advantages = adv)
    }
}
stage rl { use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.01) }
"""
TIMES = ("step_time_s", "tokens_per_s")


class Stop(Exception):
    """Raised from a step's callback: the run stops there, as a killed one would (its last checkpoint kept)."""


def strip_times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/")) and k not in TIMES} for r in rows]


def compile_flow(folder: Path, overrides: dict[str, str] | None = None) -> Pipeline:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "two.flow").write_text(FLOW)
    pipe = compile_any(str(folder / "two.flow"), overrides)
    assert isinstance(pipe, Pipeline)
    return pipe


def go(pipe: Pipeline, out: Path, **kwargs: Any) -> PipelineResult:
    return run_pipeline(pipe, out_dir=out, backend=lambda stage: backends.make("local"), **kwargs)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pipeline, PipelineResult]:
    folder = tmp_path_factory.mktemp("pipeline")
    pipe = compile_flow(folder)
    return pipe, go(pipe, folder / "full")


def test_each_stage_writes_its_run_and_the_pipeline_its_metrics(full: tuple[Pipeline, PipelineResult]) -> None:
    _, result = full
    out = result.out_dir
    assert result.ran == ("warm", "rl")
    for name in ("warm", "rl"):
        stage = out / "stages" / name
        assert {"metrics.jsonl", "graph.txt", "trace.json", "models.pt"} <= {p.name for p in stage.iterdir()}
        assert sorted(p.name for p in (stage / "checkpoints").iterdir()) == ["step_000002.pt", "step_000003.pt"]
    assert sorted(torch.load(out / "stages/warm/models.pt")) == ["actor"]
    assert sorted(torch.load(out / "stages/rl/models.pt")) == ["actor", "ref"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["stage"], r["stage_step"]) for r in rows] == [
        (1, "warm", 1), (2, "warm", 2), (3, "warm", 3), (4, "rl", 1), (5, "rl", 2), (6, "rl", 3)]
    stage_rows = [json.loads(line) for line in (out / "stages/rl/metrics.jsonl").read_text().splitlines()]
    assert rows[3]["actor/loss"] == stage_rows[0]["actor/loss"]
    state = json.loads((out / "pipeline.json").read_text())
    assert [(s["name"], s["steps"], s["done"]) for s in state["stages"]] == [("warm", 3, True), ("rl", 3, True)]
    assert "model ref" not in (out / "stages/warm/graph.txt").read_text()  # warm's step never uses it


def test_the_second_stage_starts_from_the_first_stages_weights(full: tuple[Pipeline, PipelineResult]) -> None:
    _, result = full
    out = result.out_dir
    warm = torch.load(out / "stages/warm/models.pt")["actor"]
    rl = torch.load(out / "stages/rl/models.pt")
    # ref is first used in rl with source = actor: it starts from warm's actor, and is never trained
    assert all(torch.equal(rl["ref"][k], warm[k]) for k in warm)
    assert not all(torch.equal(rl["actor"][k], warm[k]) for k in warm)  # rl trained the actor on from there
    first = result.metrics[3]
    assert first["stage"] == "rl" and first["actor/kl_mean"] == 0.0  # actor and ref equal before rl's first update
    init = torch.load(sorted((out / "stages/warm/checkpoints").iterdir())[0])  # warm's step 2: trained already
    assert not all(torch.equal(init["groups"]["colocated"]["actor"]["module"][k], warm[k]) for k in warm)


def test_resume_after_a_stage_stopped_mid_way_equals_the_uninterrupted_run(
        full: tuple[Pipeline, PipelineResult], tmp_path: Path) -> None:
    pipe, result = full
    seen: list[tuple[str, int]] = []

    @contextmanager
    def stop_at_warm_3(stage: Stage) -> Iterator[Any]:
        def on_step(step: int, row: dict[str, Any]) -> None:
            seen.append((stage.name, step))
            if (stage.name, step) == ("warm", 3):
                raise Stop  # after step 3's row, before its checkpoint: step 2's is the last
        yield on_step

    with pytest.raises(Stop):
        go(pipe, tmp_path / "cut", bar=stop_at_warm_3)
    assert seen == [("warm", 1), ("warm", 2), ("warm", 3)]
    state = json.loads((tmp_path / "cut/pipeline.json").read_text())
    assert [s["done"] for s in state["stages"]] == [False, False]
    resumed = go(pipe, tmp_path / "cut", resume=True)
    assert resumed.ran == ("warm", "rl")
    assert strip_times(resumed.metrics) == strip_times(result.metrics)
    on_disk = [json.loads(line) for line in (tmp_path / "cut/metrics.jsonl").read_text().splitlines()]
    assert strip_times(on_disk) == strip_times(result.metrics)


def test_resume_a_shortened_stage_and_skip_the_finished_one(full: tuple[Pipeline, PipelineResult],
                                                            tmp_path: Path) -> None:
    pipe, result = full
    short = compile_flow(tmp_path, {"stage.rl.steps": "1"})
    go(short, tmp_path / "short")
    warm_models = (tmp_path / "short/stages/warm/models.pt").read_bytes()
    resumed = go(pipe, tmp_path / "short", resume=True)
    assert resumed.ran == ("rl",)  # warm is done: its models.pt is read, not rerun
    assert (tmp_path / "short/stages/warm/models.pt").read_bytes() == warm_models
    assert strip_times(resumed.metrics) == strip_times(result.metrics)
    with pytest.raises(FlowError, match="already holds a run"):
        go(pipe, tmp_path / "short")


def test_one_stage_from_the_saved_models_or_from_initial_weights(full: tuple[Pipeline, PipelineResult],
                                                                  tmp_path: Path, capfd: pytest.CaptureFixture[str]
                                                                  ) -> None:
    pipe, result = full
    again = go(pipe, result.out_dir, only="rl", overwrite=True)
    assert again.ran == ("rl",)
    assert strip_times(again.metrics) == strip_times(result.metrics)  # warm's rows kept, rl's the same again
    alone = go(pipe, tmp_path / "alone", only="rl")
    assert "starts from initial weights" in capfd.readouterr().err
    state = json.loads((tmp_path / "alone/pipeline.json").read_text())
    assert state["notes"] and "warm" in state["notes"][0]
    assert [r["stage"] for r in alone.metrics] == ["rl"] * 3
    assert strip_times(alone.metrics)[0] != strip_times(result.metrics)[3]  # not from warm's weights
    with pytest.raises(FlowError, match="no stage named `rll`"):
        go(pipe, tmp_path / "x", only="rll")


def test_fit_weights_fills_a_value_models_backbone() -> None:
    lm = {"transformer.h.0.w": torch.ones(2), "transformer.wte": torch.ones(3), "lm_head.weight": torch.ones(3)}
    value = {"backbone.h.0.w": torch.zeros(2), "backbone.wte": torch.zeros(3), "value_head.weight": torch.zeros(1)}
    fitted = fit_weights(value, lm)
    assert torch.equal(fitted["backbone.h.0.w"], torch.ones(2)) and torch.equal(fitted["value_head.weight"],
                                                                                torch.zeros(1))
    assert fit_weights(lm, lm) == lm
    with pytest.raises(FlowError, match="layout differs"):
        fit_weights(lm, value, "ref")


def test_weights_carry_into_worker_processes(full: tuple[Pipeline, PipelineResult], tmp_path: Path) -> None:
    """On the process backend the groups' states are copies: the carried weights must still be the ones loaded
    (a trainer's copied state once brought the initial weights back)."""
    pipe, local = full
    out = tmp_path / "proc"
    result = run_pipeline(pipe, out_dir=out, backend=lambda stage: backends.make("process"))
    warm = torch.load(out / "stages/warm/models.pt")["actor"]
    rl = torch.load(out / "stages/rl/models.pt")
    assert all(torch.equal(rl["ref"][k], warm[k]) for k in warm)
    assert result.metrics[3]["actor/kl_mean"] == 0.0
    assert [r["actor/loss"] for r in result.metrics] == pytest.approx([r["actor/loss"] for r in local.metrics],
                                                                      rel=1e-4, abs=1e-6)
