"""The ray backend end to end: the same metrics as the local backend, clean worker errors, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl import run
from flowrl.errors import ExecutionError
from flowrl.ir.graph import Graph

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_one_rank_per_group_gives_the_local_metrics(algo: str, tiny: Callable[..., Graph], tmp_path: Path,
                                                     local_metrics: Callable[..., Any],
                                                     same_metrics: Callable[..., None]) -> None:
    steps = 3 if algo == "grpo" else 2
    remote = run(tiny(algo=algo, steps=steps), out_dir=tmp_path, backend="ray")
    same_metrics(local_metrics(algo=algo, steps=steps), remote.metrics)
    assert (tmp_path / "checkpoints" / f"step_{steps:06d}.pt").exists()  # state_dict came back from the ranks


def test_a_worker_exception_reaches_the_user_as_itself_with_the_worker_traceback(
        flow_text: Callable[..., str], tmp_path: Path) -> None:
    # positions past `context` fail inside the worker's model. A policy's prompts are cut to its context before the
    # run (flowrl.runtime.overlong), so the short context is the critic's: its values read prompt + response.
    text = flow_text(algo="ppo", steps=1, max_tokens=8).replace(
        "model critic : critic { source = actor, lr = 1e-3 }",
        'model critic : critic { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, context = 4, '
        'charset = "0123456789+=", lr = 1e-3 }')
    assert "context = 4" in text
    with pytest.raises(ExecutionError) as info:
        run(flowrl.compile_flow(text, "/flows/short_critic.flow"), out_dir=tmp_path, backend="ray")
    text = str(info.value)
    assert "while executing values = critic.values(rollout)" in text
    assert "IndexError: index out of range in self" in text
    assert "--- in worker group colocated, rank 0, " in text
    assert 'flowrl/runtime/worker.py", line' in text  # the worker's own frames
    assert "RayTaskError" not in text and "ray/_private" not in text
    assert isinstance(info.value.__cause__, IndexError)


def _cli(args: list[str], **kw: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # as a user's shell would be
    return subprocess.Popen([sys.executable, "-m", "flowrl", "run", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_cli_starts_a_local_ray_with_logs_in_the_run_directory_and_stops_on_ctrl_c(
        flow_text: Callable[..., str], tmp_path: Path) -> None:
    flow = tmp_path / "tiny.flow"
    flow.write_text(flow_text(steps=3), encoding="utf-8")
    out = tmp_path / "run"
    # A run that cannot end before the signal (a million steps), interrupted once it has logged step 1: the
    # progress line on stderr is the event waited for (readline blocks until it comes).
    proc = _cli([str(flow), "--backend", "ray", "--out", str(out), "--steps", "1000000", "--set", "run.log_every=1"],
                start_new_session=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("step 1/1000000"), first + proc.communicate()[1]
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
    stdout, stderr = proc.communicate(timeout=120)  # a failure guard: Ctrl-C ends a run within seconds
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert "ray" not in stderr.lower().replace("--backend ray", ""), stderr  # Ray's logs are not on the terminal
    (logs,) = (out / "ray").glob("session_*")  # the Ray session's logs, copied from Ray's temp dir at exit
    assert logs.is_dir() and not logs.is_symlink() and (logs / "raylet.out").exists()
    assert (out / "ray" / "driver.log").exists()
    assert not _processes_mentioning(logs.name)  # the instance's raylet, GCS and workers are gone


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if text in line:
            found.append(line)
    return found


def test_a_wrong_cluster_address_is_a_clear_error_not_minutes_of_retries() -> None:
    from flowrl.backends.ray.cluster import Session
    from flowrl.errors import FlowError

    with pytest.raises(FlowError, match=r"cannot join the Ray cluster at 127\.0\.0\.1:1: nothing answers there"):
        Session(address="127.0.0.1:1")._join({})


def test_shutdown_returns_the_cpus_before_the_next_run_sizes_its_groups(tiny: Callable[..., Graph],
                                                                        ray_session: Any) -> None:
    """Placement groups are removed asynchronously; a run started right after another (the next test, a
    notebook's second run) must find the CPUs free, not fail with 'no free CPU for its ranks'."""
    from flowrl.backends.ray.backend import RayBackend

    free = ray_session.available_resources()["CPU"]
    for _ in range(2):
        backend = RayBackend()
        try:
            groups = backend.start(tiny(replicas=2), seed=0, device="cpu")
            assert groups and ray_session.available_resources().get("CPU", 0.0) < free  # reserved while running
        finally:
            backend.shutdown()
        assert ray_session.available_resources()["CPU"] >= free  # at once, not some time later
