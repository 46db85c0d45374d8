"""Off-policy corrections for stale samples (flowrl.algos.behaviour_weights, policy_loss's is_correction), on
values worked by hand from the formulas (AReaL's decoupled PPO, truncated importance sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algos.losses import behaviour_weights, policy_loss

LOG = math.log
PROX = torch.tensor([[LOG(0.5)], [LOG(0.2)]])  # the weights before the update
BEHAV = torch.tensor([[LOG(0.25)], [LOG(0.5)]])  # the weights that generated: w = prox / behav = [2.0, 0.4]
MASK = torch.ones(2, 1)
ADV = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize(("mode", "cap", "want"), [
    ("decoupled", 2.0, [2.0, 0.4]),  # 2.0 <= cap: kept
    ("decoupled", 1.5, [0.0, 0.4]),  # beyond the cap: the token is dropped
    ("tis", 1.5, [1.5, 0.4]),  # beyond the cap: truncated to it
    ("tis", 3.0, [2.0, 0.4]),
    ("none", 1.5, [1.0, 1.0]),
])
def test_behaviour_weights(mode: str, cap: float, want: list[float]) -> None:
    got = behaviour_weights(PROX, BEHAV, mode, cap)
    assert got.squeeze(1).tolist() == pytest.approx(want, rel=1e-6)


def test_unknown_correction_and_bad_cap() -> None:
    with pytest.raises(ValueError, match="unknown is_correction 'areal'"):
        behaviour_weights(PROX, BEHAV, "areal")
    with pytest.raises(ValueError, match="is_cap must be > 0"):
        behaviour_weights(PROX, BEHAV, "tis", 0.0)


# logp = [0.55, 0.1]: ratios to the proximal policy r = [1.1, 0.5]. With clip 0.2, token 1 (A = 1) is unclipped,
# l = -1.1; token 2 (A = -1) is clipped at 0.8, l = max(0.5, 0.8) = 0.8. Token mean of w * l over 2 tokens:
@pytest.mark.parametrize(("mode", "cap", "want", "grad0"), [
    ("none", 2.0, (-1.1 + 0.8) / 2, -1.1 / 2),
    ("decoupled", 2.0, (-2.0 * 1.1 + 0.4 * 0.8) / 2, -2.0 * 1.1 / 2),
    ("decoupled", 1.5, (0.0 + 0.4 * 0.8) / 2, 0.0),
    ("tis", 1.5, (-1.5 * 1.1 + 0.4 * 0.8) / 2, -1.5 * 1.1 / 2),
])
def test_policy_loss_with_a_correction_equals_its_formula(mode: str, cap: float, want: float, grad0: float) -> None:
    logp = torch.tensor([[LOG(0.55)], [LOG(0.1)]], requires_grad=True)
    loss, metrics = policy_loss(logp, PROX, ADV, MASK, behav_logp=BEHAV, is_correction=mode, is_cap=cap, clip=0.2)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert logp.grad is not None
    # d(-w r A)/d logp = -w r A on the unclipped token; the clipped token has no gradient
    assert logp.grad.squeeze(1).tolist() == pytest.approx([grad0, 0.0], abs=1e-6)
    if mode != "none":
        assert metrics["is_weight_mean"] == pytest.approx(float(behaviour_weights(PROX, BEHAV, mode, cap).mean()))
        dropped = "is_dropped" if mode == "decoupled" else "is_truncated"
        assert metrics[dropped] == pytest.approx(0.5 if cap < 2.0 else 0.0)


def test_the_corrections_reduce_to_ppo_clip_when_behaviour_is_proximal() -> None:
    gen = torch.Generator().manual_seed(0)
    logp0 = torch.randn(4, 6, generator=gen) - 2.0
    old = logp0 + 0.1 * torch.randn(4, 6, generator=gen)
    adv = torch.randn(4, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.2).float()
    losses, grads = [], []
    for mode in ("none", "decoupled", "tis"):
        logp = logp0.clone().requires_grad_(True)
        loss, _ = policy_loss(logp, old, adv, mask, behav_logp=old.clone(), is_correction=mode, clip=0.2)
        loss.backward()
        assert logp.grad is not None
        losses.append(float(loss.detach()))
        grads.append(logp.grad.clone())
    assert losses[1] == pytest.approx(losses[0], abs=1e-7) and losses[2] == pytest.approx(losses[0], abs=1e-7)
    assert torch.allclose(grads[1], grads[0], atol=1e-7) and torch.allclose(grads[2], grads[0], atol=1e-7)


def test_one_optimizer_step_uses_the_updates_own_log_probs_as_proximal() -> None:
    """With on-policy-logp's detached old log-probs (old_logp None), the proximal policy is the update's own
    forward: w = exp(logp - behav), the ratio 1."""
    logp = torch.tensor([[LOG(0.5)], [LOG(0.2)]], requires_grad=True)
    loss, metrics = policy_loss(logp, None, ADV, MASK, behav_logp=BEHAV, is_correction="decoupled", is_cap=5.0)
    assert float(loss.detach()) == pytest.approx((-2.0 * 1.0 + 0.4 * 1.0) / 2, rel=1e-6)  # l = -w A at ratio 1
    assert metrics["is_weight_mean"] == pytest.approx(1.2)


def test_a_correction_without_behaviour_log_probs_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs the behaviour policy's log-probs"):
        policy_loss(PROX.clone(), PROX, ADV, MASK, is_correction="tis")
