"""The recipes learn the arithmetic example: examples/grpo_arith.flow with `use grpo(...)` swapped for `gspo`,
`dr_grpo` or `cispo` (the same line, one word changed), its 300 steps on the local backend: the mean reward over
the last 10 steps is clearly above the first 10's (measured 0.05 -> 0.67..0.72: bench/RESULTS_recipes.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowrl
from flowrl import run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arith.flow"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gspo", "dr_grpo", "cispo"])
def test_a_recipe_learns_the_arithmetic_example(tmp_path: Path, recipe: str) -> None:
    flow = EXAMPLE.with_name(f".{tmp_path.name}_{recipe}.flow")  # next to the example's data
    flow.write_text(EXAMPLE.read_text().replace("use grpo(", f"use {recipe}("))
    try:
        graph = flowrl.load(str(flow))
    finally:
        flow.unlink()
    assert graph.template == recipe
    rewards = [r["reward_mean"] for r in run(graph, out_dir=tmp_path).metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.3, f"{recipe}: reward {first:.3f} -> {last:.3f}"
