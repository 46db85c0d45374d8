"""The broken flows of tests/dsl/broken/: each is a working GRPO flow with one mistake (issue 25's table, and more).

`flowrl check NAME.flow` must reject each with the full located message in NAME.expected (`{HERE}` stands for the
folder, `{TORCH}` for torch's version), and `flowrl run NAME.flow` must print the very same message, exit 1 and
show no traceback: what `run` would reject for the flow's own sake, `check` rejects first. The `warn_*` flows are
valid: `check` prints their warning and exits 0, and `run` prints it before its first step (the default batch
larger than a small data set is one: a step then repeats prompts, which small flows rely on; GRPO with groups of
one another; a batch the flow writes past its data is an error).
Both verbs go through the CLI's entry point (`flowrl.cli.main`) in this process.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flowrl.cli import main

BROKEN = Path(__file__).parent / "broken"
FLOWS = sorted(p.name for p in BROKEN.glob("*.flow") if not p.name.startswith("warn_"))
WARNED = sorted(p.name for p in BROKEN.glob("warn_*.flow"))
# flows broken only on a machine like this one (no CUDA, no vLLM): fine, or otherwise broken, elsewhere
HERE_ONLY = {"device_cuda.flow": torch.cuda.is_available(),
             "warn_engine_vllm_here.flow": torch.cuda.is_available() or importlib.util.find_spec("vllm") is not None}


def expected(name: str) -> str:
    text = (BROKEN / name).with_suffix(".expected").read_text(encoding="utf-8")
    return text.replace("{HERE}", str(BROKEN)).replace("{TORCH}", torch.__version__)


@pytest.fixture
def in_broken(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(BROKEN)
    return BROKEN


def test_every_row_of_the_issue_has_a_broken_flow() -> None:
    rows = {"heads_not_dividing_dim", "tiny_unknown", "lr_negative", "dim_zero", "device_cuda", "batch_zero",
            "group_zero", "max_tokens_negative", "max_tokens_past_context", "charset_missing",
            "hf_missing_absolute", "hf_missing_relative", "device_gpu", "dtype_unknown", "batch_past_data"}
    assert rows <= {Path(n).stem for n in FLOWS}
    # runs, but says so before the first step: GRPO groups of one, the default batch past a small data set
    assert {"warn_group_one.flow", "warn_default_batch_past_data.flow"} <= set(WARNED)


@pytest.mark.parametrize("name", FLOWS)
def test_check_rejects_it_located(in_broken: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    if HERE_ONLY.get(name):
        pytest.skip("this machine has what the flow lacks elsewhere (CUDA, vLLM)")
    assert main(["check", name]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == expected(name)
    first = out.err.splitlines()[0]
    assert ": error: " in first and (first.startswith(f"{name}:") or first.startswith("<stdlib>/"))
    assert "^" in out.err


@pytest.mark.parametrize("name", FLOWS)
def test_run_prints_the_same_error_and_no_traceback(in_broken: Path, name: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    if HERE_ONLY.get(name):
        pytest.skip("this machine has what the flow lacks elsewhere (CUDA, vLLM)")
    out_dir = tmp_path / "run"
    assert main(["run", name, "--steps", "1", "--quiet", "--out", str(out_dir)]) == 1
    out = capsys.readouterr()
    assert out.err == expected(name)
    assert "Traceback" not in out.err + out.out and "internal error" not in out.err
    assert not out_dir.exists()  # rejected before anything was written


@pytest.mark.parametrize("name", WARNED)
def test_a_warned_flow_checks_ok_with_its_warning(in_broken: Path, name: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    if HERE_ONLY.get(name):
        pytest.skip("this machine has what the flow lacks elsewhere (CUDA, vLLM)")
    assert main(["check", name]) == 0
    out = capsys.readouterr()
    assert out.out == f"{name}: ok\n"
    assert out.err == expected(name)
    assert ": warning: " in out.err.splitlines()[0]


def test_run_warns_before_its_first_step(in_broken: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The warning is printed before the run starts: it is the first thing on stderr, and the run then goes on."""
    out_dir = tmp_path / "run"
    assert main(["run", "warn_group_one.flow", "--steps", "1", "--quiet", "--out", str(out_dir)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(expected("warn_group_one.flow"))
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


@pytest.mark.parametrize(("flags", "message"), [(["--steps", "0"], "--steps must be at least 1, got 0"),
                                               (["--seed", "-1"], "--seed must be at least 0, got -1")])
def test_the_cli_numbers_are_checked_like_the_run_block(in_broken: Path, tmp_path: Path, flags: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "warn_group_one.flow", *flags, "--quiet", "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "r").exists()


def test_run_refuses_what_check_warned_depends_on_the_machine(in_broken: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM from a tiny model on a CPU machine: check warns, run prints the warnings first, then refuses it."""
    if HERE_ONLY["warn_engine_vllm_here.flow"]:
        pytest.skip("this machine has CUDA or vLLM")
    assert main(["run", "warn_engine_vllm_here.flow", "--quiet", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(expected("warn_engine_vllm_here.flow"))
    refused = err.removeprefix(expected("warn_engine_vllm_here.flow"))
    assert refused.startswith("warn_engine_vllm_here.flow:4:1: error: engine \"vllm\" needs vLLM")
    assert "Traceback" not in err and "internal error" not in err


def test_the_cli_device_flag_is_checked_too(in_broken: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "warn_group_one.flow", "--device", "gpu", "--quiet", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err == ('error: --device: unknown device "gpu"\n'
                   "hint: --device takes auto, cpu, cuda or cuda:N\n")
    assert not (tmp_path / "r").exists()
