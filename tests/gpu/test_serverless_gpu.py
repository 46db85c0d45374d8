"""`flowrl run --backend serverless` on the GPUs of this machine (issue 24 item 9), skipped where CUDA is not
available: every instance task ran its models on the GPU Ray assigned it, and gave the device back with its
memory at the floor it found (torch.cuda.memory_allocated in the instance before building, and after moving its
models to host memory)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "arith.jsonl"
FLOW = f"""
flow gpu_grpo
model actor : policy {{ source = "tiny:gpt2", layers = 2, dim = 64, heads = 2, charset = "0123456789+=", lr = 1e-3 }}
model ref : reference {{ source = actor }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("{DATA}") {{ batch = 8, shuffle = true }}
use grpo(reward = correct, group = 4, max_tokens = 8, kl_coef = 0.05)
placement {{
    pool gen   {{ gpus = 1, gpu_fraction = 0.5 }}  # half a GPU an instance: one GPU holds both pools
    pool train {{ gpus = 1, gpu_fraction = 0.5 }}
    actor.generate -> gen
    actor.update, ref -> train
}}
run {{ steps = 4, seed = 0 }}
"""
SPAN = re.compile(r"^instance \d+.* on (?P<device>cuda:\d+), GPU (?P<gpu>\S+)$")


def _place(gpu: str) -> str:
    """The device a process that sees the node's GPUs (CUDA_VISIBLE_DEVICES as here) calls Ray's GPU `gpu`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return f"cuda:{int(gpu)}"
    return f"cuda:{[v.strip() for v in visible.split(',')].index(gpu)}"


def test_serverless_instances_run_on_their_gpus_and_give_the_memory_back(tmp_path: Path) -> None:
    (tmp_path / "gpu.flow").write_text(FLOW)
    out = tmp_path / "out"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "flowrl", "run", str(tmp_path / "gpu.flow"), "--backend",
                           "serverless", "--device", "auto", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    spans = [e["name"] for e in events if e.get("ph") == "X" and e.get("cat") == "held" and "(lost)" not in e["name"]]
    assert spans
    for name in spans:
        m = SPAN.match(name)
        assert m is not None, f"{name}: no GPU (an instance ran off the GPU)"
        assert m["device"] == _place(m["gpu"]), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["cost/device_left_bytes"] == 0.0 for r in rows)  # every task left its device at its floor
    assert all(r["cost/kept_on_device"] == 0.0 for r in rows)
