"""Split placement: the actor generates in pool `rollout` and trains in pool `train`; after each update the
rollout group gets the new weights (weight sync), so the run computes what the colocated local run does."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import flowrl
from flowrl.backends.ray import RayBackend
from flowrl.ir.graph import Graph
from flowrl.runtime.controller import Controller

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

SPLIT = """placement {
    pool rollout { gpus = 1 }
    pool train   { gpus = 1 }
    actor.generate -> rollout
    actor.update, ref -> train
}"""


class _NoHook(RayBackend):
    """The backend as a controller without the after_update hook sees it: only the test calls the hook."""

    after_update = None  # type: ignore[assignment]


def _weights(backend: RayBackend, group: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = ray.get(backend.groups[group].actors[0].run.remote("weights", "actor"))
    return out


def test_split_placement_syncs_weights_and_matches_the_local_run(
        tiny: Callable[..., Graph], tmp_path: Path, local_metrics: Callable[..., Any],
        same_metrics: Callable[..., None], use_backend: Callable[[Any], None]) -> None:
    # Partial credit: step 1's rewards differ within a group, so the update moves the weights (with exact match
    # every 2-token answer of this tiny model scores 0, the gradient is 0 and nothing would be stale).
    graph = tiny(placement=SPLIT, reward="arith_partial")
    assert [(g.name, g.models) for g in graph.worker_groups] == [("rollout", ("actor",)), ("train", ("actor", "ref"))]
    backend = _NoHook()
    use_backend(backend)
    seen: list[dict[str, Any]] = []

    def on_step(step: int, row: dict[str, Any]) -> None:
        # Between steps: this step's update is done and the next generate has not run yet.
        behind, trained = _weights(backend, "rollout"), _weights(backend, "train")
        seen.append({"stale": any(not torch.equal(behind[k], trained[k]) for k in trained)})
        if step == 2:
            return  # no after_update: step 3's generate must pull the weights itself
        took = RayBackend.after_update(backend, "actor", "train")  # what the controller calls after the update
        synced = _weights(backend, "rollout")
        seen[-1].update(took=took, equal=all(torch.equal(synced[k], trained[k]) for k in trained),
                        again=RayBackend.after_update(backend, "actor", "train"))

    remote = flowrl.run(graph, out_dir=tmp_path, backend="ray", on_step=on_step)
    same_metrics(local_metrics(reward="arith_partial"), remote.metrics)
    assert remote.metrics[0]["actor/grad_norm"] > 0  # the precondition of "stale" below
    assert [s["stale"] for s in seen] == [True, True, True]  # each update happened in `train` only
    assert [(s["took"] > 0, s["equal"], s["again"]) for s in (seen[0], seen[2])] == [(True, True, 0.0)] * 2
    assert backend.sync is not None and backend.sync.count["actor"] == 3  # 2 pushes + 1 pull before step 3


@pytest.mark.skipif("after_update" not in inspect.signature(Controller).parameters,
                    reason="this controller does not call the backend's after_update hook yet")
def test_the_controller_times_each_sync_as_its_own_node(tiny: Callable[..., Graph], tmp_path: Path,
                                                         local_metrics: Callable[..., Any],
                                                         same_metrics: Callable[..., None]) -> None:
    remote = flowrl.run(tiny(placement=SPLIT, steps=2), out_dir=tmp_path, backend="ray")
    same_metrics(local_metrics(steps=2), remote.metrics)
    assert all(row["time/sync.actor"] > 0 for row in remote.metrics)
    events = json.loads((tmp_path / "trace.json").read_text(encoding="utf-8"))["traceEvents"]
    assert [(e["args"]["step"], e["cat"]) for e in events if e.get("name") == "sync.actor"] == [(1, "sync"), (2, "sync")]
