"""A policy update on multi-turn rollouts (ModelWorker.update): the loss runs over `loss_mask`, not the attention
mask, and its denominators count action tokens only, so observation tokens inside a response are never trained on."""

from __future__ import annotations

import pytest
import torch

from flowrl.algos import denominators, policy_loss
from flowrl.engines.forward import forward_logprobs_entropy
from flowrl.ir.graph import Loc, ModelDecl
from flowrl.runtime.batch import Batch
from flowrl.runtime.worker import ModelWorker

DECL = ModelDecl("actor", "policy", "tiny:gpt2", Loc("t.flow", 1, 1),
                 config={"layers": 1, "dim": 32, "heads": 2}, trainable=True, lr=1e-2)
ATTRS = {"agg": "token-mean", "max_grad_norm": 0.0}  # no clipping: grad_norm is the loss's own


def rollout() -> Batch:
    """Four trajectories, T = 8: action spans and observation spans (loss_mask 0, response_mask 1), then pads."""
    g = torch.Generator().manual_seed(4)
    response_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1],
                                  [1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 1, 1],
                              [1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 1, 0]])
    return Batch(4, {
        "prompt_ids": torch.randint(40, 60, (4, 3), generator=g), "prompt_mask": torch.ones(4, 3, dtype=torch.long),
        "response_ids": torch.randint(40, 60, (4, 8), generator=g) * response_mask,
        "response_mask": response_mask, "loss_mask": loss_mask,
        "advantages": torch.randn(4, 8, generator=g) * loss_mask,
    })


def update(batch: Batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    worker = ModelWorker([DECL], [DECL], seed=0)
    metrics = worker.update("actor", batch, ATTRS, step_seed=1)
    return metrics, worker.weights("actor")


def test_the_update_trains_on_action_tokens_only() -> None:
    batch = rollout()
    metrics, weights = update(batch)
    # The loss the update reports is the policy loss over loss_mask with denominators counted on it.
    module = ModelWorker([DECL], [DECL], seed=0).models["actor"].module
    logp, _ = forward_logprobs_entropy(module, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                       batch["response_mask"])
    want, _ = policy_loss(logp, None, batch["advantages"], batch["loss_mask"].float(),
                          **denominators(batch["response_mask"], batch["loss_mask"]))
    assert metrics["pg_loss"] == pytest.approx(float(want), abs=1e-6)
    # Garbage advantages at observation tokens change nothing: neither the loss nor the step.
    garbage = Batch(batch.size, {**batch.tensors, "advantages": torch.where(
        batch["loss_mask"] > 0, batch["advantages"], torch.full((4, 8), 1e3))})
    metrics_g, weights_g = update(garbage)
    assert metrics_g["pg_loss"] == metrics["pg_loss"] and metrics_g["grad_norm"] == metrics["grad_norm"]
    assert all(torch.equal(weights[k], weights_g[k]) for k in weights)


def test_without_a_loss_mask_the_response_mask_is_trained_on_as_before() -> None:
    batch = rollout()
    plain = Batch(batch.size, {k: v for k, v in batch.tensors.items() if k != "loss_mask"})
    same = Batch(batch.size, {**plain.tensors, "loss_mask": batch["response_mask"]})
    metrics, weights = update(plain)
    metrics_s, weights_s = update(same)
    assert metrics == metrics_s and all(torch.equal(weights[k], weights_s[k]) for k in weights)
    holey, _ = update(batch)
    assert holey["pg_loss"] != metrics["pg_loss"]  # the loss mask is what decides
