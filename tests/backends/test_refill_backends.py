"""Dynamic sampling gives the same numbers on every backend: the filter's draws (generation split over two ranks on
the threads and process backends, over the Ray backend's actors, over the serverless backend's instances) sample
with the seed of (seed, step, draw, node), so the same seed draws the same prompts, samples the same responses and
keeps the same groups as the local backend. The local run is the reference, made once for the module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.ir.graph import Graph

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 3e-3{rep} }}
model ref : reference {{ source = actor{rep} }}
reward scored = "first.one"
data prompts = jsonl("data.jsonl") {{ batch = 4 }}
use dapo(reward = scored, group = 4, max_tokens = 3, batch = 3, max_gen_batches = 4, kl_coef = 0.01)
run {{ steps = 3, seed = 7 }}
"""
TOL = 1e-4  # reductions in another order (other ranks, other batch shapes) move the numbers by ~1e-6
HOW_IT_RAN = ("time/", "fusion/", "cost/", "scale/", "migrate/", "prefill/", "async/")


def _graph(folder: Path, replicas: int) -> Graph:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "first.py").write_text("def one(prompt, response, **_):\n    return 1.0 if response[:1] == '1' else 0.0\n")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = f", replicas = {replicas}" if replicas > 1 else ""
    (folder / "f.flow").write_text(FLOW.format(rep=rep))
    return flowrl.load(str(folder / "f.flow"))


def _clean(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(HOW_IT_RAN) and k not in ("step_time_s", "tokens_per_s")}
            for r in rows]


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("local")
    rows = _clean(flowrl.run(_graph(folder, 1), out_dir=folder / "run", backend="local").metrics)
    assert any(r["filter/gen_rounds"] > 1 for r in rows)  # the loop drew more prompts
    return rows


def _same(rows: list[dict[str, Any]], want: list[dict[str, Any]], case: str) -> None:
    assert len(rows) == len(want)
    for got, expected in zip(rows, want, strict=True):
        assert got.keys() == expected.keys(), (case, sorted(set(got) ^ set(expected)))
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (case, got["step"], key)


@pytest.mark.parametrize("backend", ["threads", "process"])
def test_two_ranks_give_the_local_numbers(backend: str, tmp_path: Path, local: list[dict[str, Any]]) -> None:
    graph = _graph(tmp_path, 2)
    assert {w.ranks for w in graph.worker_groups} == {2}
    _same(_clean(flowrl.run(graph, out_dir=tmp_path / "run", backend=backend).metrics), local, backend)


@pytest.mark.ray
@pytest.mark.parametrize("backend", ["ray", "serverless"])
def test_ray_and_serverless_give_the_local_numbers(backend: str, tmp_path: Path, local: list[dict[str, Any]],
                                                   ray_session: Any) -> None:
    if backend == "serverless":
        from flowrl.backends.serverless.backend import ServerlessBackend

        runner: Any = ServerlessBackend(ablate={"scale"})
    else:
        runner = backend
    rows = flowrl.run(_graph(tmp_path, 1), out_dir=tmp_path / "run", backend=runner).metrics
    _same(_clean(rows), local, backend)
