"""Fixtures for the ray backend tests: ONE Ray instance for the whole session, tiny flows, a step driver, and the
private-head helpers (cluster_head.py) for the tests that join a cluster as a user does."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import flowrl
from flowrl.ir.graph import Graph

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"
TIMES = ("step_time_s", "tokens_per_s")


@pytest.fixture(scope="session")
def cluster() -> ModuleType:
    """tests/ray/cluster_head.py: a private Ray head, `flowrl run` against it (sampled from outside or not), the
    long-tail flow. Loaded by its path, once for the session: it also imports as `tests.ray.cluster_head` where the
    repository root is on the path (`python -m pytest` from it), which a fixture does not depend on."""
    spec = importlib.util.spec_from_file_location("cluster_head", Path(__file__).with_name("cluster_head.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flow_text(*, algo: str = "grpo", replicas: int = 1, placement: str = "", batch: int = 4, steps: int = 3,
               seed: int = 1, max_tokens: int = 2, context: int = 512, reward: str = "arith_exact") -> str:
    """A tiny GRPO or PPO flow (1 layer, dim 32) on the arithmetic data."""
    rep = f", replicas = {replicas}" if replicas != 1 else ""
    critic = f"model critic : critic {{ source = actor, lr = 1e-3{rep} }}\n" if algo == "ppo" else ""
    use = (f"use grpo(reward = correct, group = 4, max_tokens = {max_tokens}, kl_coef = 0.05)" if algo == "grpo"
           else f"use ppo(reward = correct, n = 4, max_tokens = {max_tokens}, kl_coef = 0.05)")
    return (f"flow tiny_{algo}\n"
            f'model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, context = {context}, '
            f'charset = "0123456789+=", lr = 1e-3{rep} }}\n'
            f"model ref : reference {{ source = actor{rep} }}\n{critic}"
            f'reward correct = "flowrl.rewards.{reward}"\n'
            f'data prompts = jsonl("{DATA}") {{ batch = {batch}, shuffle = true }}\n'
            f"{use}\n{placement}\n"
            f"run {{ steps = {steps}, seed = {seed} }}\n")


@pytest.fixture(scope="session")
def flow_text() -> Callable[..., str]:
    return _flow_text


@pytest.fixture(scope="session")
def tiny() -> Callable[..., Graph]:
    def make(**kw: Any) -> Graph:
        return flowrl.compile_flow(_flow_text(**kw), f"/flows/tiny_{kw.get('algo', 'grpo')}.flow")
    return make


def _same_metrics(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 1e-5) -> None:
    """Every metric of every step equal within `tol`, times aside (sync times exist on one side only), and how
    each backend ran a fused stage aside (`fusion/*`: the local backend runs fuse-train's updates one by one)."""
    assert len(a) == len(b) > 0
    aside = ("time/", "cost/", "fusion/")
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(aside) and k not in TIMES}
        assert keys == {k for k in rb if not k.startswith(aside) and k not in TIMES}
        for k in sorted(keys):
            assert abs(float(ra[k]) - float(rb[k])) <= tol, (ra["step"], k, ra[k], rb[k])


@pytest.fixture(scope="session")
def same_metrics() -> Callable[..., None]:
    return _same_metrics


@pytest.fixture(scope="session")
def local_metrics(tiny: Callable[..., Graph], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """The local backend's metrics for `tiny(**kw)`, run once per session (the reference the ray runs match).
    Placement does not change them: the local backend shares a model placed in two groups."""
    from flowrl import run

    cache: dict[str, list[dict[str, Any]]] = {}

    def metrics(**kw: Any) -> list[dict[str, Any]]:
        key = _flow_text(**kw)
        if key not in cache:
            cache[key] = run(tiny(**kw), out_dir=tmp_path_factory.mktemp("local"), backend="local").metrics
        return cache[key]
    return metrics


@pytest.fixture
def use_backend(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """Make `flowrl.run(..., backend="ray")` use this RayBackend instance (to look into it during the run)."""
    from flowrl import backends

    real = backends.make

    def install(backend: Any) -> None:
        monkeypatch.setattr(backends, "make", lambda name, **kw: backend if name == "ray" else real(name, **kw))
    return install
