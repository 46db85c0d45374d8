"""The recipes learn the arithmetic example: examples/grpo_arith.flow with `use grpo(...)` swapped for `gspo` or
`dr_grpo` (the same line, one word changed) on the local backend: the mean reward over the last 10 steps is clearly
above the first 10's. The runs are cut where the seed's curve has already risen (bench/RESULTS_recipes.md, seed 0:
gspo 0.05 -> 0.57 at step 150, dr_grpo 0.05 -> 0.55 at step 200; the whole 300 steps: 0.72, 0.67), which keeps the
suite short. `cispo` trains exactly as grpo does on this flow (one optimizer step per rollout; tested bit for bit in
tests/backends/test_recipes.py), and grpo's run is tests/examples/test_examples_learn.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowrl
from flowrl import run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arith.flow"


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "steps"), [("gspo", 150), ("dr_grpo", 200)])
def test_a_recipe_learns_the_arithmetic_example(tmp_path: Path, recipe: str, steps: int) -> None:
    flow = EXAMPLE.with_name(f".{tmp_path.name}_{recipe}.flow")  # next to the example's data
    flow.write_text(EXAMPLE.read_text().replace("use grpo(", f"use {recipe}("))
    try:
        graph = flowrl.load(str(flow), {"run.steps": steps})
    finally:
        flow.unlink()
    assert graph.template == recipe
    rewards = [r["reward_mean"] for r in run(graph, out_dir=tmp_path).metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.3, f"{recipe}: reward {first:.3f} -> {last:.3f}"
