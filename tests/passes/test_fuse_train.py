"""fuse-train: when it fuses, each refusal, idempotence, the interleaved schedule and equal numbers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl.dsl
from flowrl.backends.threads import ThreadBackend
from flowrl.ir.graph import Graph
from flowrl.passes.fuse_train import fuse_train
from flowrl.runtime.batch import Batch
from flowrl.runtime.schedule import interleave
from flowrl.runtime.worker import ModelWorker

from .conftest import assert_same_numbers, passes, run_steps

PLACED = """placement {
    pool a { gpus = 1 }
    pool b { gpus = 1 }
    actor, ref, rm -> a
    critic -> b
}"""
LATE_INPUT = """actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv)
    late = critic.values(rollout)
    critic.update(rollout, values = late, returns = adv)"""
ONE_UPDATE = "actor.update(rollout, old_logp = old_logp, ref_logp = ref_logp, advantages = adv)"


def stage(g: Graph) -> dict[str, tuple[Any, ...]]:
    return {n.id: (n.attrs["fusion"], n.attrs["fusion_kind"], n.attrs["schedule"])
            for n in g.nodes if n.attrs.get("fusion", "").startswith("train:")}  # type: ignore[union-attr]


def test_interleaves_independent_updates_in_one_worker_group(ppo: Callable[..., Graph]) -> None:
    g, notes = fuse_train(ppo())
    fused = ("train:actor+critic", "intra-stage", "interleave")
    assert stage(g) == {"actor.update": fused, "critic.update": fused}
    assert notes == ["actor.update + critic.update: one training stage, interleave in worker group colocated"]


def placed(ppo: Callable[..., Graph], folder: Path) -> Graph:
    """The PPO flow with the critic on a worker group of its own."""
    ppo()
    path = folder / "flow.flow"
    path.write_text(path.read_text() + PLACED)
    return flowrl.dsl.load(path)


def test_runs_updates_on_different_groups_concurrently(ppo: Callable[..., Graph], tmp_path: Path) -> None:
    g, notes = fuse_train(placed(ppo, tmp_path))
    fused = ("train:actor+critic", "intra-stage", "concurrent")
    assert stage(g) == {"actor.update": fused, "critic.update": fused}
    assert notes == ["actor.update + critic.update: one training stage, concurrent on a, b"]


def _same_model_twice(g: Graph) -> Graph:
    twice = [replace(n, id="actor.update2", model="actor") if n.id == "critic.update" else n for n in g.nodes]
    return g.with_nodes(twice)


REFUSALS: list[tuple[str, dict[str, Any], Callable[[Graph], Graph], str]] = [
    ("same model", {}, _same_model_twice, "actor.update2: not fused with actor.update: both update actor"),
    ("late input", dict(body=LATE_INPUT), lambda g: g,
     "critic.update: not fused with actor.update: critic.update needs late, computed after actor.update"),
    ("engine", dict(critic_extra=', engine = "deepspeed"'), lambda g: g,
     "critic.update: not fused with actor.update: critic trains with engine 'deepspeed'"),
    ("one update", dict(body=ONE_UPDATE), lambda g: g, "not fused: the step has 1 update"),
]


@pytest.mark.parametrize(("build", "edit", "note"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refuses(ppo: Callable[..., Graph], build: dict[str, Any], edit: Callable[[Graph], Graph],
                 note: str) -> None:
    g = edit(ppo(**build))
    out, notes = fuse_train(g)
    assert out == g and notes == [note]


def test_idempotent(ppo: Callable[..., Graph]) -> None:
    once = passes(ppo(), "fuse-train")
    twice = passes(once, "fuse-train")
    assert twice.nodes == once.nodes and [p.changed for p in twice.passes] == [True, False]


# -- the runtime: runtime/schedule.py, ModelWorker.update_fused, the controller ---------------------------


def test_interleave_takes_turns_and_lets_the_longer_task_finish() -> None:
    def task(name: str, units: int) -> Callable[[Callable[[str], None]], str]:
        def run(turn: Callable[[str], None]) -> str:
            for i in range(units):
                turn(f"{name}:{i}")
            return name

        return run

    results, order = interleave([task("a", 3), task("b", 1), task("c", 2)])
    assert results == ["a", "b", "c"]
    assert order == ["a:0", "b:0", "c:0", "a:1", "c:1", "a:2"]


def test_interleave_reraises_after_the_others_finish() -> None:
    done: list[str] = []

    def bad(turn: Callable[[str], None]) -> None:
        turn("bad:0")
        raise RuntimeError("boom")

    def good(turn: Callable[[str], None]) -> None:
        for i in range(3):
            turn(f"good:{i}")
        done.append("good")

    with pytest.raises(RuntimeError, match="boom"):
        interleave([bad, good])
    assert done == ["good"]


def _workers(g: Graph) -> tuple[ModelWorker, ModelWorker]:
    return (ModelWorker(g.models, g.models, seed=1), ModelWorker(g.models, g.models, seed=1))


def _batch(size: int = 6, width: int = 5) -> Batch:
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(width)[None] < torch.randint(1, width + 1, (size, 1), generator=gen)).long()
    return Batch(size, {
        "prompt_ids": torch.randint(0, 12, (size, 4), generator=gen), "prompt_mask": torch.ones(size, 4).long(),
        "response_ids": torch.randint(0, 12, (size, width), generator=gen), "response_mask": mask,
        "old_logp": -torch.rand(size, width, generator=gen), "advantages": torch.randn(size, width, generator=gen),
        "values": torch.randn(size, width, generator=gen), "returns": torch.randn(size, width, generator=gen),
    })


def test_update_fused_interleaves_micro_batches_with_the_results_of_plain_updates(ppo: Callable[..., Graph]) -> None:
    fused, plain = _workers(ppo())
    batch, attrs = _batch(), [{"micro_batch": 2}, {"micro_batch": 3, "clip": 0.2}]
    out = fused.update_fused(["actor", "critic"], [batch, batch], attrs, step_seeds=[1, 2])
    assert out["order"] == ["actor:0", "critic:0", "actor:1", "critic:1", "actor:2"]
    want = [plain.update("actor", batch, attrs[0], step_seed=1), plain.update("critic", batch, attrs[1], step_seed=2)]
    assert out["results"] == want
    for name in ("actor", "critic"):
        for a, b in zip(fused.models[name].module.parameters(), plain.models[name].module.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_run_computes_the_same_numbers_with_and_without_it(ppo: Callable[..., Graph]) -> None:
    g = ppo()
    on = run_steps(passes(g, "fuse-train"), backend=ThreadBackend(world=1))
    assert on[0].metrics["fusion/train_turns"] == 2
    assert_same_numbers(on, run_steps(passes(g), backend=ThreadBackend(world=1)), tol=0.0, later=0.0)


def test_the_local_backend_runs_the_updates_one_by_one_and_says_why(ppo: Callable[..., Graph]) -> None:
    # its one rank is the controller's own thread: interleaving would need threads whose torch thread teams slow
    # the controller (measured 2x on PPO steps); the numbers are the same either way
    g = ppo()
    on = run_steps(passes(g, "fuse-train"))
    assert all(r.metrics["fusion/fallback"] == 1.0 and "fusion/train_turns" not in r.metrics for r in on)
    assert_same_numbers(on, run_steps(passes(g)), tol=0.0, later=0.0)


def test_concurrent_schedule_computes_the_same_numbers(ppo: Callable[..., Graph], tmp_path: Path) -> None:
    g = placed(ppo, tmp_path)
    assert_same_numbers(run_steps(passes(g, "fuse-train")), run_steps(passes(g)), tol=0.0, later=0.0)
