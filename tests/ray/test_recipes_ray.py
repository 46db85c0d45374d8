"""The recipes (`gspo`, `dr_grpo`, `cispo`) on the Ray backend (two ranks, data parallel) and the serverless backend
(generation over the pool's instances): the local backend's numbers with the same seed, the reference model
unbuilt (kl_coef = 0). The flows and the comparison are tests/backends/test_recipes.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import flowrl
from tests.backends.test_recipes import RECIPES, assert_same, clean, graph_of, local_numbers

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_ray_two_ranks_give_the_local_numbers(recipe: str, tmp_path: Path) -> None:
    rows = clean(flowrl.run(graph_of(recipe, replicas=2), out_dir=tmp_path / "ray", backend="ray").metrics)
    assert_same(rows, local_numbers(recipe, tmp_path), f"{recipe}/ray")


@pytest.mark.parametrize("recipe", RECIPES)
def test_serverless_gives_the_local_numbers(recipe: str, tmp_path: Path) -> None:
    from flowrl.backends.serverless.backend import ServerlessBackend

    run = flowrl.run(graph_of(recipe), out_dir=tmp_path / "serverless", backend=ServerlessBackend(ablate={"scale"}))
    rows: list[dict[str, Any]] = clean(run.metrics)
    assert_same(rows, local_numbers(recipe, tmp_path), f"{recipe}/serverless")
