"""Device-time held by a multi-turn run on serverless pools whose instances give their devices back while tools
run (issue 26 items 5 and 3): the run's `cost/held_s` against a second driver on the same Ray cluster that
integrates the device slots in use from `ray.available_resources()` (tests/ray/slot_sampler.py), over a run that
released devices during environment waits."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLER = Path(__file__).with_name("slot_sampler.py")
# Every environment step waits ~1.5 s (lognormal, sigma 0.3): far longer than getting a device back costs on any
# machine, so from the third step (the release cost is measured on a warm round first) instances release.
FLOW = """\
flow env_release
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=;",
                        lr = 1e-5, context = 64 }}
model ref : reference {{ source = actor }}
env game = "envs.latency.Latency" {{ max_turns = 2, workers = 8, timeout = 30, median = 1.5, sigma = 0.3,
                                     turns = 2, obs = "1;" }}
data prompts = jsonl("data.jsonl") {{ batch = 4, shuffle = false }}
use grpo(group = 2, max_tokens = 4, env = game)
placement {{
    pool rollout {{ gpus = 1..1, elastic = true }}
    pool train   {{ gpus = 1..1, elastic = true }}
    actor.generate -> rollout
    actor.update, ref -> train
}}
run {{ seed = 0, checkpoint_every = 0, steps = {steps} }}
"""


def _helper(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_flow(tmp: Path, steps: int) -> Path:
    (tmp / "envs").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "envs" / "latency.py", tmp / "envs" / "latency.py")
    (tmp / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "id": 3 * a + b}) + "\n"
                                            for a in range(3) for b in range(3)))
    path = tmp / "env_release.flow"
    path.write_text(FLOW.format(steps=steps))
    return path


@pytest.mark.ray
def test_a_run_that_releases_during_env_waits_holds_what_the_cluster_counted(tmp_path: Path) -> None:
    head = _helper("cluster_head").head
    flow = env_flow(tmp_path / "flow", steps=4)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with head(2) as address:
        ready, counted = tmp_path / "sampling", tmp_path / "sampled.json"
        sampler = subprocess.Popen([sys.executable, str(SAMPLER), address, str(counted), str(ready)],
                                   stdin=subprocess.PIPE, env=env, cwd=ROOT)
        try:
            while not ready.exists():  # the sampler counts from before the run's first task
                assert sampler.poll() is None, "the sampler ended before it began counting"
                try:
                    sampler.wait(timeout=0.05)
                except subprocess.TimeoutExpired:
                    pass
            run = subprocess.run([sys.executable, "-m", "flowrl", "run", str(flow), "--backend", "serverless",
                                  "--address", address, "--out", str(tmp_path / "run")],
                                 env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        finally:
            assert sampler.stdin is not None
            sampler.stdin.close()
            sampler.wait(timeout=120)
    sampled = json.loads(counted.read_text())
    cost = json.loads((tmp_path / "run" / "cost.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("env/parks", 0.0) for r in rows) >= 1  # devices were given back during environment waits
    assert all(r["cost/env_wait_held_s"] >= 0.0 for r in rows) and "env_wait_held_s" in cost
    assert cost["held_s"] == pytest.approx(sampled["busy_slot_s"], rel=0.05), (cost["held_s"], sampled)
