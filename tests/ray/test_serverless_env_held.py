"""Device-time held by a multi-turn run on serverless pools whose instances give their devices back while tools
run (issue 26 items 5 and 3): the run's `cost/held_s` against a second driver on the same Ray cluster that
integrates the device slots in use from `ray.available_resources()` (tests/ray/slot_sampler.py), over a run that
released devices during environment waits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def env_flow(tmp: Path, steps: int) -> Path:
    (tmp / "envs").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "envs" / "latency.py", tmp / "envs" / "latency.py")
    (tmp / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "id": 3 * a + b}) + "\n"
                                            for a in range(3) for b in range(3)))
    path = tmp / "env_release.flow"
    path.write_text(FLOW.format(steps=steps))
    return path


@pytest.mark.ray
def test_a_run_that_releases_during_env_waits_holds_what_the_cluster_counted(tmp_path: Path,
                                                                              cluster: ModuleType) -> None:
    flow = env_flow(tmp_path / "flow", steps=4)
    sampled, cost = cluster.sampled_run(flow, tmp_path, "serverless", slots=2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("env/parks", 0.0) for r in rows) >= 1  # devices were given back during environment waits
    assert all(r["cost/env_wait_held_s"] >= 0.0 for r in rows) and "env_wait_held_s" in cost
    cluster.check_held(cost, sampled)
