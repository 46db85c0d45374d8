"""A private Ray head for the tests that join a cluster the way a user does (`flowrl run --address`): started
with `ray start --head` on free ports in a session of its own, stopped by killing that session's processes (never
`ray stop`, which stops every Ray instance on the machine); `flowrl run` against it, alone or counted from outside
by a second driver (slot_sampler.py); and the flows those tests run.

The tests get this module from the `cluster` fixture (tests/ray/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).parent / "ray"
DATA = ROOT / "examples" / "data" / "longtail.jsonl"
SAMPLER = Path(__file__).with_name("slot_sampler.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def head(slots: int, cpus: int = 2, *, extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
         port: int | None = None) -> Iterator[str]:
    """A Ray head with `cpus` CPUs and `slots` device slots (none: no `device_slot` resource) -> its address; its
    processes (and every process they started, in their session: an autoscaler's nodes too) killed after.
    `extra`: more `ray start` options; `env`: more environment; `port`: the GCS's (default: a free one)."""
    temp = Path(tempfile.mkdtemp(prefix="flowrl-h-", dir="/tmp"))  # Ray's socket paths must stay short
    port = port or free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    cmd = [str(RAY), "start", "--head", "--port", str(port), "--num-cpus", str(cpus),
           *(("--resources", json.dumps({"device_slot": slots})) if slots else ()), "--include-dashboard=false",
           "--ray-client-server-port", str(free_port()), "--temp-dir", str(temp), *extra]
    started = subprocess.run(cmd, env=env, capture_output=True, text=True, start_new_session=True, timeout=180)
    session = _session_of(temp)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"127.0.0.1:{port}"
    finally:
        _kill(session)


def _session_of(temp: Path) -> int | None:
    """The session id of the head's processes (the ones whose command line names its temp dir)."""
    for p in psutil.process_iter(["cmdline"]):
        if any(str(temp) in part for part in (p.info["cmdline"] or [])):
            return os.getsid(p.pid)
    return None


def _kill(session: int | None) -> None:
    if session is None or session == os.getsid(0):
        return
    procs = [p for p in psutil.process_iter() if _sid(p) == session]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _sid(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def run_flow(flow: Path, address: str, out: Path, backend: str = "serverless", steps: int | None = None,
             timeout_s: float = 900, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`flowrl run FLOW --backend BACKEND --address ADDRESS [--steps STEPS] --out OUT EXTRA...` in a process of its
    own, as a user runs it against a cluster; bounded by `timeout_s`, so a hang fails a test instead of stopping
    the suite."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "flowrl", "run", str(flow), "--backend", backend, "--address", address,
           *(("--steps", str(steps)) if steps is not None else ()), "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def sampled_run(flow: Path, tmp: Path, backend: str, slots: int, cpus: int = 2, steps: int | None = None,
                resource: str = "device_slot") -> tuple[dict[str, float], dict[str, Any]]:
    """`flowrl run` of `flow` (out: tmp/run) joined to a private head with `slots` device slots and `cpus` CPUs,
    while a second driver on the same cluster (slot_sampler.py) integrates the `resource` in use, from before the
    run asks for anything until its driver has exited -> (the sampler's figures, the run's cost.json)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with head(slots, cpus) as address:
        ready, counted = tmp / "sampling", tmp / "sampled.json"
        sampler = subprocess.Popen([sys.executable, str(SAMPLER), address, str(counted), str(ready), resource],
                                   stdin=subprocess.PIPE, env=env, cwd=ROOT)
        try:
            while not ready.exists():  # the sampler counts from before the run reserves anything
                assert sampler.poll() is None, "the sampler ended before it began counting"
                try:
                    sampler.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass
            run = run_flow(flow, address, tmp / "run", backend, steps)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        finally:
            assert sampler.stdin is not None
            sampler.stdin.close()  # the run's driver has exited: everything it held is back
            sampler.wait(timeout=120)
    return json.loads(counted.read_text()), json.loads((tmp / "run" / "cost.json").read_text())


def check_held(cost: dict[str, Any], sampled: dict[str, float]) -> None:
    """The run's `held_s` agrees with the sampler's integral: within 5% (the run reads its tasks' records, the
    sampler the cluster's reservations) plus the bound on the sampling's own error, which grows when a busy
    machine spaces the samples out (slot_sampler.py)."""
    held, busy = cost["held_s"], sampled["busy_slot_s"]
    # a sampler starved so long that its bound says nothing is a failure, not a pass (quiet: 0.6% of busy)
    assert sampled["uncertain_slot_s"] <= 0.25 * busy, sampled
    assert abs(held - busy) <= 0.05 * busy + sampled["uncertain_slot_s"], (held, sampled)


def longtail_flow(out: Path, rollout: str, train: str = "1..1", run: str = "", batch: int = 8, group: int = 4,
                  max_tokens: int = 24) -> Path:
    """examples/longtail_grpo.flow, smaller (batch `batch`, group `group`, `max_tokens`), with elastic pools
    `rollout` and `train` (`gpus` ranges) and extra `run` keys."""
    text = (
        "flow longtail_grpo_small\n"
        'model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, '
        'charset = "0123456789+=", lr = 1e-5 }\n'
        "model ref : reference { source = actor }\n"
        'reward length = "flowrl.rewards.length_target"\n'
        f'data prompts = jsonl("{DATA}") {{ batch = {batch}, shuffle = true }}\n'
        f"use grpo(reward = length, group = {group}, max_tokens = {max_tokens}, kl_coef = 0.01, temperature = 1.0)\n"
        "placement {\n"
        f"    pool rollout {{ gpus = {rollout}, elastic = true }}\n"
        f"    pool train   {{ gpus = {train}, elastic = true }}\n"
        "    actor.generate -> rollout\n"
        "    actor.update, ref -> train\n"
        "}\n"
        f"run {{ seed = 0, checkpoint_every = 0 {run} }}\n")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "longtail_small.flow"
    path.write_text(text)
    return path
