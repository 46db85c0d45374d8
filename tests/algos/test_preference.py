"""SFT, Bradley-Terry and DPO losses (flowrl.algos.preference) against values worked out from their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algos.preference import bradley_terry_loss, dpo_loss, sequence_logp, sft_loss

# One pair: log π(y_w) = -1.0, log π_ref(y_w) = -1.5, log π(y_l) = -2.0, log π_ref(y_l) = -1.8, so
# h = 0.5 - (-0.2) = 0.7 and, with β = 0.1, β h = 0.07.
PAIR = dict(chosen_logp=torch.tensor([-1.0]), rejected_logp=torch.tensor([-2.0]),
            ref_chosen_logp=torch.tensor([-1.5]), ref_rejected_logp=torch.tensor([-1.8]))


def test_dpo_sigmoid_worked_value() -> None:
    loss, m = dpo_loss(**PAIR, beta=0.1)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-0.07)))  # 0.658760
    assert float(loss) == pytest.approx(0.6587596, abs=1e-6)
    assert m["rewards/chosen"] == pytest.approx(0.05)
    assert m["rewards/rejected"] == pytest.approx(-0.02)
    assert m["rewards/margins"] == pytest.approx(0.07)
    assert m["rewards/accuracies"] == 1.0


def test_cdpo_label_smoothing_worked_value() -> None:
    loss, _ = dpo_loss(**PAIR, beta=0.1, label_smoothing=0.1)
    # 0.9 * 0.658760 + 0.1 * log(1 + e^0.07) = 0.592884 + 0.072876
    assert float(loss) == pytest.approx(0.6657596, abs=1e-6)


def test_ipo_worked_value() -> None:
    loss, _ = dpo_loss(**PAIR, beta=0.1, kind="ipo")
    assert float(loss) == pytest.approx((0.7 - 5.0) ** 2)  # 18.49


def test_simpo_needs_no_reference() -> None:
    loss, m = dpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), beta=0.1, kind="simpo", gamma=0.5)
    assert float(loss) == pytest.approx(0.9130153, abs=1e-6)  # -log σ(0.1 * 1.0 - 0.5)
    assert m["rewards/margins"] == pytest.approx(0.1)


def test_dpo_refuses_a_missing_reference_and_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="needs the reference"):
        dpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]))
    with pytest.raises(ValueError, match="unknown DPO loss 'kto'"):
        dpo_loss(**PAIR, kind="kto")


def test_dpo_gradient_pushes_chosen_up_and_rejected_down() -> None:
    chosen = torch.tensor([-1.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(chosen, rejected, PAIR["ref_chosen_logp"], PAIR["ref_rejected_logp"], beta=0.1)
    loss.backward()
    assert chosen.grad is not None and rejected.grad is not None
    # d/dh of -log σ(βh) = -β σ(-βh)
    g = 0.1 / (1 + math.exp(0.07))
    assert float(chosen.grad) == pytest.approx(-g)
    assert float(rejected.grad) == pytest.approx(g)


def test_bradley_terry_worked_values() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.5, 1.0])  # differences 1, -0.5, 0
    loss, m = bradley_terry_loss(chosen, rejected)
    # -log σ(1) = 0.313262, -log σ(-0.5) = 0.974077, -log σ(0) = 0.693147
    assert float(loss) == pytest.approx(0.6601620, abs=1e-6)
    assert m["accuracy"] == pytest.approx(1 / 3)
    assert m["margin"] == pytest.approx(0.5 / 3)
    with_margin, _ = bradley_terry_loss(chosen, rejected, margin=0.5)
    assert float(with_margin) == pytest.approx(0.9204719, abs=1e-6)


def test_sft_loss_is_the_mean_nll_of_response_tokens() -> None:
    logp = torch.tensor([[-0.5, -1.0, -9.0], [-2.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, m = sft_loss(logp, mask)
    assert float(loss) == pytest.approx((0.5 + 1.0 + 2.0) / 3)
    assert m["ppl"] == pytest.approx(math.exp(3.5 / 3))


def test_sequence_logp_sum_and_mean_skip_pads() -> None:
    logp = torch.tensor([[-1.0, -2.0, float("-inf")], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sequence_logp(logp, mask).tolist() == [-3.0, -3.0]
    assert sequence_logp(logp, mask, mean=True).tolist() == [-1.5, -3.0]
