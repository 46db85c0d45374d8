"""Multi-turn rollouts on the Ray backend (issue 26): two ranks sample what the local backend samples, with
environments of random latency running in each rank's warm pool (tests/runtime/envs_mod.py's SlowEcho)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl import backends
from flowrl.runtime.batch import Batch

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]
ENVS = Path(__file__).resolve().parents[1] / "runtime" / "envs_mod.py"
FLOW = """\
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3,
                       context = 64 }
model ref : reference { source = actor }
data prompts = jsonl("data.jsonl") { batch = 4 }
env game = "envs_mod.SlowEcho" { max_turns = 3, stop = "+", workers = 1, timeout = 10 }
use grpo(group = 2, max_tokens = 4, env = game)
"""


def _rollouts(tmp: Path, backend: str, overrides: dict[str, str]) -> dict[str, Any]:
    tmp.mkdir()
    (tmp / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}", "answer": a + b}) + "\n"
                                            for a in range(3) for b in range(2)))
    (tmp / "envs_mod.py").write_text(ENVS.read_text())
    (tmp / "game.flow").write_text(FLOW)
    graph = flowrl.load(str(tmp / "game.flow"), overrides=overrides)
    be = backends.make(backend)
    groups = be.start(graph, seed=0, device="cpu")
    try:
        gen = graph.node("rollout")
        texts = ["0+1", "2+2", "1+0", "2+1"]
        prompts = Batch(4, {}, {"prompt": texts, "answer": [0] * 4, "prompt_slot": list(range(4))})
        out = groups[gen.worker_group].call("generate", "actor", prompts, dict(gen.attrs), step_seed=11).result()
    finally:
        be.shutdown()
    real = out["response_mask"].bool()
    return {"ids": [out["response_ids"][r][real[r]].tolist() for r in range(out.size)],
            "loss": [out["loss_mask"][r][real[r]].tolist() for r in range(out.size)],
            "return": out["env_return"].tolist(), "group": out["group_id"].tolist()}


def test_ray_ranks_sample_what_the_local_backend_samples(tmp_path: Path) -> None:
    local = _rollouts(tmp_path / "local", "local", {})
    assert sum(map(len, local["ids"])) > 0
    assert _rollouts(tmp_path / "ray", "ray", {"actor.replicas": "2", "ref.replicas": "2"}) == local


def test_a_serverless_run_with_an_env_gives_the_local_runs_numbers(tmp_path: Path) -> None:
    """Generation on elastic instances (up to two): the trajectories, so the rollout's numbers, are the local ones."""
    keys = ("gen_tokens", "response_len_mean", "reward_mean", "env/turns_mean", "env/tool_calls_mean",
            "env/return_mean", "env/errors", "env/timeouts")
    runs = {}
    for backend, overrides in (("local", {}), ("serverless", {"actor.replicas": "1..2"})):
        tmp = tmp_path / backend
        tmp.mkdir()
        (tmp / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}", "answer": a + b}) + "\n"
                                                for a in range(3) for b in range(2)))
        (tmp / "envs_mod.py").write_text(ENVS.read_text())
        (tmp / "game.flow").write_text(FLOW + "run { steps = 2, seed = 1 }\n")
        res = flowrl.run(flowrl.load(str(tmp / "game.flow"), overrides=overrides), out_dir=tmp / "out",
                         backend=backend)
        runs[backend] = [{k: row[k] for k in (*keys, "env/prefill_tokens_mean")} for row in res.metrics]
    assert len(runs["serverless"]) == len(runs["local"]) == 2
    for served, local in zip(runs["serverless"], runs["local"], strict=True):
        # an instance that gave its device back while environments ran re-prefilled its rows on resuming
        assert served.pop("env/prefill_tokens_mean") >= local.pop("env/prefill_tokens_mean") - 1e-5
        assert served == pytest.approx(local, abs=1e-5)
