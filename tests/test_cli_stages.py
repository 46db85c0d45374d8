"""The command line on a flow with `stage` blocks: check, compile (text and JSON), run with --resume and --stage,
viz (stages as clusters) and timeline (per stage)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.cli import main

FLOW = """flow two
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
run { steps = 2, seed = 3 }
stage warm { use grpo(reward = correct, group = 4, max_tokens = 3)  run { steps = 1 } }
stage rl { use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.01) }
"""


@pytest.fixture
def flow(tmp_path: Path) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "two.flow"
    path.write_text(FLOW)
    return path


def test_check_every_stage(flow: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(flow)]) == 0
    assert capsys.readouterr().out.startswith(f"{flow}: ok (2 stages: warm, rl)\n")
    rl = "stage rl { use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.01) }"
    flow.write_text(FLOW.replace(rl, "model rm : reward_model { source = actor }\n"
                                     "stage rl { use grpo(reward = rm, group = 4, max_tokens = 3) }"))
    assert main(["check", str(flow)]) == 1
    err = capsys.readouterr().err
    assert "error: reward model `rm` scores rollouts in stage `rl`, but no earlier stage trains it" in err
    assert "hint: train it in an earlier stage, or give it a checkpoint source" in err


def test_compile_prints_each_stage_under_its_header(flow: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(flow), "--set", "stage.rl.steps=5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stage warm  (1 steps)\n  flow two  (use grpo)\n")
    assert "\nstage rl  (5 steps)\n  flow two  (use grpo)\n" in out
    assert main(["compile", str(flow), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in body["stages"]] == ["warm", "rl"]
    assert body["stages"][1]["graph"]["flow"] == "two"


def test_run_resume_and_one_stage(flow: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["run", str(flow), "--out", str(out), "--quiet", "--set", "stage.rl.steps=1"]) == 0
    assert "done: ran warm, rl" in capsys.readouterr().out
    assert main(["run", str(flow), "--out", str(out), "--quiet", "--resume"]) == 0
    text = capsys.readouterr().out
    assert "skipped (finished earlier): warm" in text and "done: ran rl" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["stage_step"], r["step"]) for r in rows] == [("warm", 1, 1), ("rl", 1, 2), ("rl", 2, 3)]
    assert main(["run", str(flow), "--out", str(out), "--quiet", "--stage", "rl"]) == 1
    assert "already holds a run of stage `rl`" in capsys.readouterr().err
    assert main(["run", str(flow), "--out", str(out), "--quiet", "--stage", "rl", "--overwrite"]) == 0
    assert "done: ran rl" in capsys.readouterr().out
    assert main(["run", str(flow), "--out", str(out), "--quiet", "--stage", "nope"]) == 1
    assert "no stage named `nope`" in capsys.readouterr().err
    assert main(["timeline", str(out), "-o", str(tmp_path / "tl.png")]) == 0
    assert capsys.readouterr().out.split() == ["wrote", str(tmp_path / "tl-warm.png"), "wrote",
                                               str(tmp_path / "tl-rl.png")]
    assert main(["timeline", str(out), "-o", str(tmp_path / "one.png"), "--stage", "rl"]) == 0
    assert (tmp_path / "one.png").stat().st_size > 0


def test_stage_needs_a_staged_flow(tmp_path: Path, flow: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain.flow"
    plain.write_text(FLOW.split("stage warm")[0] + "use grpo(reward = correct, group = 4, max_tokens = 3)\n")
    assert main(["run", str(plain), "--out", str(tmp_path / "p"), "--stage", "rl"]) == 1
    assert "--stage runs one stage of a flow with `stage` blocks" in capsys.readouterr().err


def test_viz_draws_the_stages_as_clusters_left_to_right(flow: Path, tmp_path: Path) -> None:
    for view in ("parsed", "optimized", "placed"):
        dot = tmp_path / f"{view}.dot"
        assert main(["viz", str(flow), "-o", str(dot), "--stage", view]) == 0
        source = dot.read_text()
        assert "subgraph cluster_stage_0 {" in source and "subgraph cluster_stage_1 {" in source
        assert "stage warm" in source and "stage rl" in source
        assert '"warm/rollout"' in source and '"rl/rollout"' in source  # one node per stage, apart
        assert "label=then" in source and "lhead=cluster_stage_1 ltail=cluster_stage_0" in source


def _metrics(path: Path) -> list[dict]:
    """The rows written whole (a row still being written, without its newline, is left for the next look)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def test_a_stage_killed_mid_way_resumes_to_the_uninterrupted_metrics(flow: Path, tmp_path: Path) -> None:
    """`flowrl run` is interrupted (SIGINT, as Ctrl-C) in a first stage that cannot end on its own, once its second
    step's row is written; --resume with that stage given one step past its last checkpoint equals a run of as many
    steps straight (however far it got before the signal landed)."""
    sets = ["--set", "run.checkpoint_every=1", "--set", "stage.rl.steps=1"]
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "flowrl", "run", str(flow), "--out", str(cut), "--quiet", *sets,
           "--set", "stage.warm.steps=100000"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while len(_metrics(cut / "stages/warm/metrics.jsonl")) < 2:  # the event: step 2's row on disk
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)  # polling for the row, not a guess at how long a step takes
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "continue with --resume" in err
    state = json.loads((cut / "pipeline.json").read_text())
    assert [s["done"] for s in state["stages"]] == [False, False]
    last = max(int(p.stem.removeprefix("step_")) for p in (cut / "stages/warm/checkpoints").glob("step_*.pt"))
    steps = ["--set", f"stage.warm.steps={last + 1}"]
    assert main(["run", str(flow), "--out", str(cut), "--quiet", "--resume", *sets, *steps]) == 0
    straight = tmp_path / "straight"
    assert main(["run", str(flow), "--out", str(straight), "--quiet", *sets, *steps]) == 0

    def numbers(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/"))
                 and k not in ("step_time_s", "tokens_per_s")} for r in rows]

    assert numbers(_metrics(cut / "metrics.jsonl")) == numbers(_metrics(straight / "metrics.jsonl"))
    assert [(r["stage"], r["stage_step"]) for r in _metrics(cut / "metrics.jsonl")] == [
        *(("warm", i) for i in range(1, last + 2)), ("rl", 1)]


def test_check_notes_each_stage(flow: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flow.write_text(FLOW.replace("run { steps = 2, seed = 3 }", "run { steps = 2, seed = 3, max_staleness = 1 }"))
    assert main(["check", str(flow), "--backend", "local"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": note:")[0] for line in out[1:]] == [f"{flow}: stage warm", f"{flow}: stage rl"]
    assert all("max_staleness = 1 } is not applied" in line for line in out[1:])
