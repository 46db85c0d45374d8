"""The backend registry: every backend is reachable by name from `flowrl run --backend`, and bad choices say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl import backends
from flowrl.cli import main
from flowrl.errors import FlowError

ROOT = Path(__file__).resolve().parents[2]


def test_every_backend_folder_is_registered() -> None:
    # sim is the simulator (`flowrl simulate`): it runs a flow's steps on a described cluster, not its numbers
    folders = {p.name for p in (ROOT / "backends").iterdir() if (p / "__init__.py").exists()} - {"sim"}
    assert set(backends.names()) == folders == {"local", "threads", "process", "ray", "serverless"}


def test_an_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(FlowError) as e:
        backends.make("gpu")
    assert e.value.render() == "error: unknown backend 'gpu'\nhint: use one of: local, threads, process, ray, serverless"


@pytest.mark.parametrize("backend", ["threads", "process"])
def test_the_cli_runs_the_long_tail_example_on_a_backend_with_two_ranks(backend: str, tmp_path: Path) -> None:
    out = tmp_path / backend
    sets = ["prompts.batch=4", "actor.dim=32", "actor.layers=1", "actor.replicas=2", "ref.replicas=2"]
    argv = ["run", str(ROOT / "examples" / "longtail_grpo.flow"), "--backend", backend, "--steps", "2",
            "--out", str(out), "--quiet", *[a for s in sets for a in ("--set", s)]]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["fusion/workers"] == 2 and "fusion/fallback" not in r for r in rows)  # fused, on two ranks
    assert json.loads((out / "run.json").read_text())["backend"] == backend


def test_address_is_refused_for_a_backend_that_runs_here(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", str(ROOT / "examples" / "grpo_arith.flow"), "--backend", "threads", "--address", "h:1",
            "--out", str(tmp_path / "x"), "--quiet"]
    assert main(argv) == 1
    assert "--address is for a backend on a cluster; the threads backend runs here" in capsys.readouterr().err


def test_the_local_backend_says_why_a_fused_stage_ran_unfused(tmp_path: Path) -> None:
    out = tmp_path / "local"
    argv = ["run", str(ROOT / "examples" / "longtail_grpo.flow"), "--steps", "1", "--out", str(out), "--quiet",
            "--set", "prompts.batch=2", "--set", "actor.dim=32", "--set", "actor.layers=1"]
    assert main(argv) == 0
    why = json.loads((out / "run.json").read_text())["unfused"]
    assert why == {"rollout": "every group of the stage runs inline in the controller's process: chunk forwards "
                              "would only take turns with decoding"}
