"""Tests for flowrl.engines.training: optimisation, micro-batch accumulation, clipping and checkpoints."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from flowrl.engines.forward import forward_logprobs
from flowrl.engines.training import TrainEngine
from flowrl.models.build import ModelSpec, build_model

TINY = {"layers": 2, "dim": 32, "heads": 2}
Batch = tuple[Tensor, Tensor, Tensor, Tensor]


def _policy(seed: int = 0) -> Any:
    return build_model(ModelSpec("tiny:gpt2", TINY), seed=seed).module


def _batch(rows: int = 8, seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses, as the generation engine lays them out."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, 256, (rows, 6), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[::2, :2] = 0  # ragged prompts
    response_ids = torch.randint(0, 256, (rows, 5), generator=gen)
    response_mask = torch.ones_like(response_ids)
    response_mask[1::3, 3:] = 0  # ragged responses
    return prompt_ids, prompt_mask, response_ids, response_mask


def _split(batch: Batch, size: int) -> list[Batch]:
    rows = batch[0].shape[0]
    return [(batch[0][i : i + size], batch[1][i : i + size], batch[2][i : i + size], batch[3][i : i + size])
            for i in range(0, rows, size)]  # fmt: skip


def _nll_loss(module: nn.Module, total_tokens: int) -> Any:
    """Token-mean NLL of the mini-batch, scaled per micro-batch so the micro losses sum to it."""

    def loss_fn(mb: Batch) -> tuple[Tensor, dict[str, float]]:
        logprobs = forward_logprobs(module, *mb, with_grad=True)  # (b, T)
        loss = -(logprobs * mb[3]).sum() / total_tokens
        return loss, {"tokens": float(mb[3].sum()), "pg_loss": float(loss.detach())}

    return loss_fn


def _grab_grads(engine: TrainEngine) -> list[list[Tensor]]:
    """Snapshot gradients right before each optimizer.step (the engine clears them afterwards)."""
    seen: list[list[Tensor]] = []

    def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        seen.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in engine.params])

    engine.optimizer.register_step_pre_hook(hook)
    return seen


def test_loss_decreases_on_toy_objective() -> None:
    module = _policy()
    engine = TrainEngine(module, lr=1e-2)
    batch = _batch()
    loss_fn = _nll_loss(module, int(batch[3].sum()))
    losses = [engine.step([batch], loss_fn)["loss"] for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    assert engine.steps == 15


def test_micro_batches_accumulate_to_full_batch_gradient() -> None:
    batch = _batch()
    tokens = int(batch[3].sum())
    one, many = _policy(seed=4), _policy(seed=4)
    eng_one, eng_many = TrainEngine(one, lr=1e-3), TrainEngine(many, lr=1e-3)
    grads_one, grads_many = _grab_grads(eng_one), _grab_grads(eng_many)
    m_one = eng_one.step([batch], _nll_loss(one, tokens))
    m_many = eng_many.step(_split(batch, 3), _nll_loss(many, tokens))
    assert m_one["loss"] == pytest.approx(m_many["loss"], rel=1e-5)
    assert m_one["grad_norm"] == pytest.approx(m_many["grad_norm"], rel=1e-4)
    for g1, g2 in zip(grads_one[0], grads_many[0], strict=True):
        assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4)
    # Per-micro-batch metrics are averaged (3 micro-batches of (3, 3, 2) rows); shares of the mini-batch's loss
    # (training.SHARES) add up to the one-batch value.
    assert m_many["tokens"] == pytest.approx(tokens / 3)
    assert m_many["pg_loss"] == pytest.approx(m_one["pg_loss"], rel=1e-5)
    assert set(m_many) >= {"loss", "grad_norm", "lr", "tokens"}


def test_grad_norm_is_reported_before_clipping_and_clipped() -> None:
    module = _policy()
    engine = TrainEngine(module, lr=1e-3, max_grad_norm=1e-3)
    grads = _grab_grads(engine)
    batch = _batch()
    metrics = engine.step([batch], _nll_loss(module, int(batch[3].sum())))
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads[0]]))
    assert metrics["grad_norm"] > 1e-2
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)
    assert metrics["lr"] == 1e-3 and metrics["skipped"] == 0.0
    assert all(p.grad is None for p in engine.params)  # zero_grad(set_to_none=True) after the step


def test_non_finite_gradients_skip_the_update() -> None:
    module = _policy()
    engine = TrainEngine(module, lr=1e-2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    batch = _batch()
    base = _nll_loss(module, int(batch[3].sum()))

    def nan_loss(mb: Batch) -> tuple[Tensor, dict[str, float]]:
        loss, metrics = base(mb)
        return loss * float("nan"), metrics

    metrics = engine.step([batch], nan_loss)
    assert metrics["skipped"] == 1.0 and engine.steps == 0
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key])


def test_state_dict_round_trip_resumes_identically() -> None:
    batch = _batch()
    tokens = int(batch[3].sum())
    src = _policy(seed=1)
    eng_src = TrainEngine(src, lr=5e-3, weight_decay=0.01)
    for _ in range(2):
        eng_src.step([batch], _nll_loss(src, tokens))
    buf = io.BytesIO()
    torch.save(eng_src.state_dict(), buf)
    buf.seek(0)

    dst = _policy(seed=2)  # different init: everything must come from the checkpoint
    eng_dst = TrainEngine(dst, lr=5e-3, weight_decay=0.01)
    eng_dst.load_state_dict(torch.load(buf, weights_only=True))
    assert eng_dst.steps == 2
    assert eng_dst.optimizer.state_dict()["state"][0]["step"] == 2
    m_src = eng_src.step([batch], _nll_loss(src, tokens))
    m_dst = eng_dst.step([batch], _nll_loss(dst, tokens))
    assert m_src["loss"] == pytest.approx(m_dst["loss"], rel=1e-6)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-7), name


def test_rejects_frozen_module_and_empty_step() -> None:
    frozen = build_model(ModelSpec("tiny:gpt2", TINY, role="reference"), seed=0).module
    with pytest.raises(ValueError, match="no trainable parameters"):
        TrainEngine(frozen, lr=1e-3)
    engine = TrainEngine(_policy(), lr=1e-3)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        engine.step([], _nll_loss(engine.module, 1))
    engine.set_lr(3e-4)
    assert engine.lr == 3e-4
