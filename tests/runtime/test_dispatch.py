"""Dispatch planning and merging for the ray backend (pure functions: no Ray instance needed)."""

from __future__ import annotations

import pytest
import torch

from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch


def _prompts(n: int) -> Batch:
    return Batch(n, {}, {"prompt": [f"{i}+1=" for i in range(n)]})


def _rollout(n: int, width: int = 3) -> Batch:
    mask = torch.ones(n, width, dtype=torch.long)
    mask[0, -1] = 0
    return Batch(n, {"response_mask": mask, "response_ids": torch.arange(n * width).view(n, width),
                     "group_id": torch.arange(n) // 2}, {}, "response_ids")


def test_split_gives_each_rank_a_contiguous_shard_and_the_step_seed() -> None:
    p = dispatch.plan("generate", ("actor", _prompts(5), {}), {"step_seed": 123}, "split", 2)
    assert [c.rank for c in p.calls] == [0, 1]
    assert [c.args[1].meta["prompt"] for c in p.calls] == [["0+1=", "1+1="], ["2+1=", "3+1=", "4+1="]]
    assert [c.offset for c in p.calls] == [0, 2]
    seeds = [c.kwargs["step_seed"] for c in p.calls]
    assert seeds == [123, 123]  # samples are keyed by their prompts' slots (engines/sampling.py), not by rank


def test_split_of_generate_renumbers_each_ranks_prompt_groups() -> None:
    p = dispatch.plan("generate", ("actor", _prompts(3), {}), {"step_seed": 1}, "split", 2)  # 2 + 1 prompts
    # each rank numbers its prompts from 0 (two samples per prompt here)
    r0 = Batch(4, {"group_id": torch.tensor([0, 0, 1, 1])}, {})
    r1 = Batch(2, {"group_id": torch.tensor([0, 0])}, {})
    merged = dispatch.merge(p, [r0, r1])
    assert merged["group_id"].tolist() == [0, 0, 1, 1, 2, 2]


def test_split_results_concatenate_in_rank_order() -> None:
    p = dispatch.plan("logprobs", ("actor", _rollout(4), {}), {}, "split", 2)
    parts = [c.args[1].derive("logp", logp=c.args[1]["response_ids"].float()) for c in p.calls]
    merged = dispatch.merge(p, parts)
    assert torch.equal(merged["logp"], _rollout(4)["response_ids"].float())


def test_broadcast_sends_the_whole_input_once_and_returns_rank_zeros_result() -> None:
    batch = _rollout(4)
    p = dispatch.plan("logprobs", ("actor", batch, {}), {}, "broadcast", 3)
    assert [c.rank for c in p.calls] == [0, 1, 2]
    assert all(c.args[1] is batch for c in p.calls)
    assert 1 in p.shared  # the batch goes into the object store once, not once per rank
    assert dispatch.merge(p, ["r0", "r1", "r2"]) == "r0"


def test_rank0_runs_only_rank_zero() -> None:
    p = dispatch.plan("logprobs", ("actor", _rollout(4), {}), {}, "rank0", 4)
    assert [c.rank for c in p.calls] == [0]


def test_one_rank_passes_the_call_through_unchanged() -> None:
    batch = _rollout(4)
    p = dispatch.plan("generate", ("actor", batch, {}), {"step_seed": 7}, "split", 1)
    assert len(p.calls) == 1 and p.calls[0].args[1] is batch and p.calls[0].kwargs == {"step_seed": 7}
    out = {"loss": 0.5}
    assert dispatch.merge(p, [out]) is out


def test_update_metrics_add_loss_shares_and_token_weight_means() -> None:
    p = dispatch.plan("update", ("actor", _rollout(4), {}), {"step_seed": 1}, "split", 2)
    assert [c.tokens for c in p.calls] == [(5.0,), (6.0,)]
    merged = dispatch.merge(p, [{"loss": 0.25, "pg_loss": 0.1, "clipfrac": 0.0, "grad_norm": 2.0},
                                {"loss": 0.5, "pg_loss": 0.2, "clipfrac": 1.0, "grad_norm": 2.0}])
    assert merged["loss"] == pytest.approx(0.75) and merged["pg_loss"] == pytest.approx(0.3)
    assert merged["clipfrac"] == pytest.approx(6 / 11) and merged["grad_norm"] == pytest.approx(2.0)


def test_updates_that_cannot_be_data_parallel_are_refused() -> None:
    with pytest.raises(dispatch.DispatchError, match="stale weights"):
        dispatch.plan("update", ("actor", _rollout(4), {}), {}, "rank0", 2)
    with pytest.raises(dispatch.DispatchError, match="cannot split an update batch of 3 samples over 2 ranks"):
        dispatch.plan("update", ("actor", _rollout(3), {"mini_batches": 2}), {}, "split", 2)
    with pytest.raises(dispatch.DispatchError, match="unknown dispatch mode"):
        dispatch.plan("logprobs", ("actor", _rollout(3), {}), {}, "scatter", 2)


def test_a_fused_update_splits_every_models_batch_and_reduces_each_models_metrics() -> None:
    actor, critic = _rollout(4), _rollout(6)
    p = dispatch.plan("update_fused", (["actor", "critic"], [actor, critic], [{}, {}]), {"step_seeds": [1, 2]},
                      "split", 2)
    assert [[b.size for b in c.args[1]] for c in p.calls] == [[2, 3], [2, 3]]
    assert p.calls[0].tokens == (5.0, 8.0) and p.calls[1].tokens == (6.0, 9.0)
    merged = dispatch.merge(p, [{"results": [{"loss": 1.0}, {"vf_loss": 2.0}], "order": ["actor", "critic"]},
                                {"results": [{"loss": 3.0}, {"vf_loss": 4.0}], "order": ["actor", "critic"]}])
    assert merged == {"results": [{"loss": 4.0}, {"vf_loss": 6.0}], "order": ["actor", "critic"]}
