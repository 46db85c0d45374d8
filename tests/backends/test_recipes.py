"""The recipes (`gspo`, `dr_grpo`, `cispo`) run on every backend and give the local backend's numbers with the same
seed: here the local, thread and process backends with two ranks (a data-parallel update whose losses are scaled by
the whole mini-batch's denominators); tests/ray/test_recipes_ray.py has Ray and serverless. Each runs with its
template's defaults, so kl_coef = 0 and pass drop-reference leaves the reference model unbuilt on every backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.ir.graph import Graph

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"
RECIPES = ("gspo", "dr_grpo", "cispo")
HOW_IT_RAN = ("time/", "fusion/", "cost/", "scale/", "migrate/", "prefill/", "async/")
TOL = 1e-4  # as tests/backends/test_same_metrics.py: reductions in another order move numbers by ~1e-6


def recipe_flow(recipe: str, replicas: int = 1, extra: str = "", engine: str = "") -> str:
    rep = f", replicas = {replicas}" if replicas != 1 else ""
    own = f', engine = "deepspeed", zero_stage = {engine[-1]}' if engine.startswith("deepspeed") else ""
    return (f"flow tiny_{recipe}\n"
            'model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, '
            f'charset = "0123456789+=", lr = 1e-3{rep}{own} }}\n'
            f"model ref : reference {{ source = actor{rep} }}\n"
            'reward correct = "flowrl.rewards.length_target"\n'
            f'data prompts = jsonl("{DATA}") {{ batch = 4, shuffle = true }}\n'
            f"use {recipe}(reward = correct, group = 4, max_tokens = 4{extra})\n"
            "run { steps = 2, seed = 2 }\n")


def graph_of(recipe: str, replicas: int = 1, extra: str = "", engine: str = "") -> Graph:
    return flowrl.compile_flow(recipe_flow(recipe, replicas, extra, engine), f"/flows/tiny_{recipe}.flow")


def clean(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith(HOW_IT_RAN) and k not in ("step_time_s", "tokens_per_s")}
            for r in rows]


def assert_same(rows: list[dict[str, Any]], local: list[dict[str, Any]], case: str) -> None:
    assert len(rows) == len(local)
    for got, want in zip(rows, local, strict=True):
        assert got.keys() == want.keys(), (case, sorted(set(got) ^ set(want)))
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=TOL, abs=TOL), (case, got["step"], key)


_LOCAL: dict[str, list[dict[str, Any]]] = {}


def local_numbers(recipe: str, tmp_path: Path) -> list[dict[str, Any]]:
    if recipe not in _LOCAL:
        _LOCAL[recipe] = clean(flowrl.run(graph_of(recipe), out_dir=tmp_path / "local", backend="local").metrics)
    return _LOCAL[recipe]


@pytest.mark.parametrize("recipe", RECIPES)
def test_runs_kl_free_on_the_local_backend(recipe: str, tmp_path: Path) -> None:
    g = graph_of(recipe)
    assert [w.models for w in g.worker_groups] == [("actor",)]  # the reference is not built
    rows = local_numbers(recipe, tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all("kl_mean" not in r for r in rows)
    assert all(r["actor/grad_norm"] > 0 for r in rows)  # groups with mixed rewards trained


def test_gspo_clips_whole_sequences_once_the_weights_moved(tmp_path: Path) -> None:
    """A second epoch on the rollout trains weights the first moved: GSPO's ratios leave [1 - 3e-4, 1 + 4e-4] and
    whole responses are clipped (the old log-probs forward is kept: on-policy-logp declines with epochs = 2)."""
    g = graph_of("gspo", extra=", epochs = 2")
    assert g.has_node("old_logp")
    rows = flowrl.run(g, out_dir=tmp_path, backend="local").metrics
    assert max(r["actor/clipfrac"] for r in rows) > 0 and max(abs(r["actor/pg_ppo_kl"]) for r in rows) > 0


@pytest.mark.parametrize("backend", ["threads", "process"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_give_the_local_numbers(recipe: str, backend: str, tmp_path: Path) -> None:
    g = graph_of(recipe, replicas=2)
    assert {w.ranks for w in g.worker_groups} == {2}
    rows = clean(flowrl.run(g, out_dir=tmp_path / backend, backend=backend).metrics)
    assert_same(rows, local_numbers(recipe, tmp_path), f"{recipe}/{backend}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_deepspeed_engine_trains_like_torch(recipe: str, tmp_path: Path) -> None:
    """`engine = "deepspeed"` (ZeRO-2 on CPU/gloo) takes the same loss through flowrl.runtime.rollout_loss."""
    rows = flowrl.run(graph_of(recipe, engine="deepspeed2"), out_dir=tmp_path / "ds", backend="local").metrics
    for got, want in zip(rows, local_numbers(recipe, tmp_path), strict=True):
        for key in ("reward_mean", "response_len_mean", "loss", "actor/pg_loss", "actor/clipfrac"):
            assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), (recipe, got["step"], key)


def test_cispo_with_one_step_per_rollout_trains_exactly_as_grpo(tmp_path: Path) -> None:
    """On-policy (one optimizer step per rollout) every importance weight is 1: CISPO's gradient -A grad log pi is
    PPO's at ratio 1, so the run is GRPO's bit for bit; only the loss's value differs (-A log pi, not -A). The two
    part once the weights move within an update (mini_batches, epochs, an asynchronous run)."""
    runs = {}
    for recipe in ("grpo", "cispo"):
        g = flowrl.compile_flow(recipe_flow(recipe, extra=", kl_coef = 0.0"), f"/flows/{recipe}.flow")
        runs[recipe] = clean(flowrl.run(g, out_dir=tmp_path / recipe, backend="local").metrics)
    for a, b in zip(runs["grpo"], runs["cispo"], strict=True):
        assert a.keys() == b.keys()
        assert {k for k in a if a[k] != b[k]} <= {"loss", "actor/loss", "actor/pg_loss"}
        assert a["actor/grad_norm"] == b["actor/grad_norm"] > 0
