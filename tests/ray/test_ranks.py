"""A worker group of 2 ranks: what each dispatch mode sends where, and a data-parallel update that equals the
one-rank update on the same batch (global loss denominators + gradient all-reduce)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

from flowrl.backends.ray import RayBackend, RayWorkerGroup
from flowrl.ir.graph import Graph
from flowrl.runtime.batch import Batch
from flowrl.runtime.worker import ModelWorker

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]
SEED = 3
UPDATE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "temperature", "group_id")


@pytest.fixture(scope="module")
def ranks(ray_session: Any, tiny: Callable[..., Graph]) -> Iterator[tuple[Graph, RayWorkerGroup, ModelWorker]]:
    """(graph, a started group of 2 ranks, a local one-rank worker holding the same initial models)."""
    graph = tiny(replicas=2)
    backend = RayBackend()
    group = backend.start(graph, seed=SEED, device="cpu")["colocated"]
    assert isinstance(group, RayWorkerGroup) and group.world == 2
    local = ModelWorker([graph.model("actor"), graph.model("ref")], graph.models, seed=SEED, device="cpu")
    yield graph, group, local
    assert backend.after_update("actor", "colocated") == 0.0  # colocated: nothing to send, weights are in place
    backend.shutdown()


def _prompts(n: int) -> Batch:
    return Batch(n, {}, {"prompt": [f"{i}+{n - i}=" for i in range(n)]})


def _calls(group: RayWorkerGroup) -> list[int]:
    return [s["calls"] for s in group.stats()]


def _attrs(graph: Graph, op: str) -> dict[str, Any]:
    return dict(next(n for n in graph.nodes if n.op == op).attrs)


def test_generate_per_dispatch_mode(ranks: tuple[Graph, RayWorkerGroup, ModelWorker]) -> None:
    graph, group, local = ranks
    attrs, prompts = _attrs(graph, "generate"), _prompts(4)
    want = local.generate("actor", prompts, attrs, step_seed=11)

    before = _calls(group)
    one = group.call("generate", "actor", prompts, attrs, dispatch="rank0", step_seed=11).result()
    assert [a - b for a, b in zip(_calls(group), before, strict=True)] == [1, 0]  # rank 1 never ran
    both = group.call("generate", "actor", prompts, attrs, dispatch="broadcast", step_seed=11).result()
    assert [a - b for a, b in zip(_calls(group), before, strict=True)] == [2, 1]
    for got in (one, both):  # a whole-batch call on rank 0 samples exactly like the one local rank
        assert torch.equal(got["response_ids"], want["response_ids"])

    split = group.call("generate", "actor", prompts, attrs, dispatch="split", step_seed=11).result()
    assert [a - b for a, b in zip(_calls(group), before, strict=True)] == [3, 2]
    assert split.size == want.size and split.meta["prompt"] == want.meta["prompt"]
    assert split["group_id"].tolist() == want["group_id"].tolist()  # prompt groups renumbered across ranks
    half = local.generate("actor", prompts.slice(0, 2), attrs, step_seed=11)  # rank 0: first half, step seed
    assert torch.equal(split["response_ids"][: half.size, : half["response_ids"].shape[1]], half["response_ids"])


def test_split_and_broadcast_logprobs_equal_the_one_rank_logprobs(
        ranks: tuple[Graph, RayWorkerGroup, ModelWorker]) -> None:
    graph, group, local = ranks
    rollout = local.generate("actor", _prompts(3), _attrs(graph, "generate"), step_seed=5)
    want = local.logprobs("actor", rollout, {})["logp"]
    for mode in ("split", "broadcast"):
        got = group.call("logprobs", "actor", rollout, {}, dispatch=mode).result()
        assert got.size == rollout.size
        torch.testing.assert_close(got["logp"], want, atol=1e-5, rtol=0)


def test_two_rank_update_equals_the_one_rank_update(ranks: tuple[Graph, RayWorkerGroup, ModelWorker]) -> None:
    graph, group, local = ranks
    rollout = local.generate("actor", _prompts(4), _attrs(graph, "generate"), step_seed=7)  # 16 samples
    gen = torch.Generator().manual_seed(0)
    batch = Batch(rollout.size, {
        **{k: rollout[k] for k in UPDATE_KEYS},
        "old_logp": local.logprobs("actor", rollout, {})["logp"],
        "ref_logp": local.logprobs("ref", rollout, {})["logp"],
        "advantages": torch.randn(rollout.size, generator=gen),
    })
    base = _attrs(graph, "update")
    # With micro-batches the all-reduce runs once per optimizer step, after accumulation. (The per-micro-batch
    # metrics, pg_loss and the like, are averaged over micro-batches by the engine, so only `loss` is compared.)
    for attrs, keys in ((base, ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "clipfrac")),
                        ({**base, "micro_batch": 3}, ("loss", "grad_norm"))):
        want = local.update("actor", batch, attrs, step_seed=9)
        got = group.call("update", "actor", batch, attrs, dispatch="split", step_seed=9).result()
        for key in keys:
            assert got[key] == pytest.approx(want[key], abs=1e-5), key
        weights = local.weights("actor")
        for rank in range(group.world):  # every rank took the same step
            theirs = ray.get(group.actors[rank].run.remote("weights", "actor"))
            for name, w in weights.items():
                torch.testing.assert_close(theirs[name], w, atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")


def test_two_rank_fused_update_equals_the_one_rank_fused_update(
        ranks: tuple[Graph, RayWorkerGroup, ModelWorker]) -> None:
    """fuse-train's one-call update of several models (`update_fused`), data parallel over the 2 ranks."""
    graph, group, local = ranks
    rollout = local.generate("actor", _prompts(4), _attrs(graph, "generate"), step_seed=8)
    batch = Batch(rollout.size, {**{k: rollout[k] for k in UPDATE_KEYS},
                                 "old_logp": local.logprobs("actor", rollout, {})["logp"],
                                 "advantages": torch.linspace(-1, 1, rollout.size)})
    attrs = {**_attrs(graph, "update"), "kl_coef": 0.0, "micro_batch": 4}
    want = local.update_fused(["actor"], [batch], [attrs], step_seeds=[4])
    got = group.call("update_fused", ["actor"], [batch], [attrs], dispatch="split", step_seeds=[4]).result()
    for key in ("loss", "grad_norm"):
        assert got["results"][0][key] == pytest.approx(want["results"][0][key], abs=1e-5), key
    theirs = ray.get(group.actors[1].run.remote("weights", "actor"))
    for name, w in local.weights("actor").items():
        torch.testing.assert_close(theirs[name], w, atol=1e-5, rtol=0, msg=name)
