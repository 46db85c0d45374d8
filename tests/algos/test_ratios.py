"""Worked values for the recipes' losses (flowrl.algos.ratios and losses): GSPO's sequence ratio, CISPO's clipped
stop-gradient weight and Dr. GRPO's constant normaliser, against the papers' definitions and verl's core_algos.

References (written down here so that each number below can be checked by hand):
- GSPO, Zheng et al. 2025 (arXiv:2507.18071), eq. 7 and 13: s_i = exp((1/|y_i|) sum_t log(pi/pi_old)(y_i,t)),
  s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], clipped to [1 - eps_low, 1 + eps_high] = [1 - 3e-4, 1 + 4e-4];
  verl/trainer/ppo/core_algos.py `compute_policy_loss_gspo` (volcengine/verl b178a3cd5): log s_i,t =
  clamp(log_prob - sg(log_prob) + sg(mean log-ratio), max=10), loss = max(-A s, -A clip(s)), aggregated
  "seq-mean-token-mean".
- CISPO, MiniMax-M1 (arXiv:2506.13585), eq. 4-5: J = (1/sum|o_i|) sum_i sum_t sg(r_hat_i,t) A_i,t log pi(o_i,t),
  r_hat = clip(r, 1 - eps_low, 1 + eps_high); verl `compute_policy_loss_cispo`: pg_losses =
  -sg(clamp(ratio, 1 - low, 1 + high)) * advantages * log_prob, pg_clipfrac = mean(ratio != clipped_ratio).
- Dr. GRPO, Liu et al. 2025 (arXiv:2503.20783), section 3.2: A_i = R_i - mean(R) (no std), the token sum over a
  constant instead of 1/|o_i|; verl `agg_loss(..., "seq-mean-token-sum-norm", loss_scale_factor=N)` =
  sum(loss * mask) / N.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algos import (
    AGG_MODES,
    RATIO_LEVELS,
    ROLLOUT_LOSSES,
    aggregate,
    cispo_loss,
    grpo_advantages,
    importance_log_ratio,
    policy_loss,
    ppo_clip_loss,
    sequence_log_ratio,
)
from flowrl.ir import signatures

# --- GSPO -----------------------------------------------------------------------------------------------------
# Two responses; row 1's last token is padding. Token log-ratios d = logp - old:
#   row 0: [0.1, -0.2, 0.4]  -> mean 0.1     -> s_0 = e^0.1     = 1.1051709
#   row 1: [1e-4, -3e-4, pad] -> mean -1e-4  -> s_1 = e^-0.0001 = 0.9999000
# A = [1, -1], eps = 3e-4 / 4e-4, so the clip range is [0.9997, 1.0004]:
#   row 0: max(-1 * 1.1051709, -1 * 1.0004) = -1.0004 (clipped: no gradient) on each of its 3 tokens
#   row 1: max(0.9999000, 0.9999000) = 0.9999000 on each of its 2 tokens (inside the range)
# seq-mean-token-mean: (-1.0004 + 0.9999000) / 2 = -0.00024999750
# clipfrac: 3 of 5 tokens; ratio_mean: (3 * 1.1051709 + 2 * 0.9999000) / 5 = 1.0630626
# ppo_kl = mean(old - logp) = -(0.1 - 0.2 + 0.4 + 1e-4 - 3e-4) / 5 = -0.05996
# gradient: row 0's tokens 0; each of row 1's: (1/2 seqs)(1/2 tokens) * (-A) * s_1 = 0.24997500
G_OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]], dtype=torch.float64)
G_D = torch.tensor([[0.1, -0.2, 0.4], [1e-4, -3e-4, 0.0]], dtype=torch.float64)
G_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
G_ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)


def test_gspo_sequence_ratio_is_the_exp_of_the_mean_token_log_ratio() -> None:
    logp = G_OLD + G_D
    seq = sequence_log_ratio(logp, G_OLD, G_MASK)
    torch.testing.assert_close(seq, torch.tensor([0.1, -1e-4], dtype=torch.float64))
    ratio = importance_log_ratio(logp, G_OLD, G_MASK, "sequence").exp()
    torch.testing.assert_close(ratio[0], torch.full((3,), math.exp(0.1), dtype=torch.float64))
    torch.testing.assert_close(ratio[1, :2], torch.full((2,), math.exp(-1e-4), dtype=torch.float64))
    # the token level is PPO's own ratio
    torch.testing.assert_close(importance_log_ratio(logp, G_OLD, G_MASK, "token"), G_D)


def test_gspo_worked_values() -> None:
    logp = (G_OLD + G_D).requires_grad_()
    loss, m = ppo_clip_loss(logp, G_OLD, G_ADV, G_MASK, clip=3e-4, clip_high=4e-4, agg="seq-mean-token-mean",
                            ratio="sequence")
    assert float(loss.detach()) == pytest.approx(-0.00024999750, abs=1e-12)
    assert m["clipfrac"] == pytest.approx(0.6)
    assert m["ratio_mean"] == pytest.approx(1.0630626, abs=1e-7)
    assert m["ppo_kl"] == pytest.approx(-0.05996)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [0.249975, 0.249975, 0.0]],
                                                       dtype=torch.float64), atol=1e-8, rtol=0)


def test_gspo_clips_whole_sequences_where_the_token_ratio_clips_tokens() -> None:
    """Row 0 at the token level, A = 1, clip 0.2: the token clip keeps the gradient of each token whose own ratio
    is in range (e^0.1 = 1.105, e^-0.2 = 0.819) and drops the one above 1.2 (e^0.4 = 1.49), where the sequence
    clip dropped all three (test_gspo_worked_values)."""
    logp = (G_OLD + G_D).requires_grad_()
    loss, _ = ppo_clip_loss(logp, G_OLD, G_ADV, G_MASK, clip=0.2, agg="seq-mean-token-mean", ratio="token")
    loss.backward()
    assert logp.grad is not None
    # token 2's ratio e^0.4 = 1.49 > 1.2 with A > 0: clipped, no gradient; tokens 0 and 1 keep -A r / (2 * 3)
    torch.testing.assert_close(logp.grad[0], torch.tensor([-math.exp(0.1) / 6, -math.exp(-0.2) / 6, 0.0],
                                                          dtype=torch.float64))


def _verl_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """verl's compute_policy_loss_gspo (core_algos.py), transcribed line for line, with its agg_loss
    "seq-mean-token-mean" (global_batch_size = the rows with tokens)."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    seq_mask = torch.sum(response_mask, dim=-1)
    seq_losses = torch.sum(pg_losses * response_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_equals_verls_compute_policy_loss_gspo(eps: tuple[float, float]) -> None:
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 2
    logp0 = old + torch.randn(6, 5, generator=g, dtype=torch.float64) * 1e-3  # stale by one small update
    adv = torch.randn(6, 1, generator=g, dtype=torch.float64).expand(6, 5)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]).double()
    ours_x, theirs_x = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
    ours, _ = ppo_clip_loss(ours_x, old, adv, mask, clip=eps[0], clip_high=eps[1], agg="seq-mean-token-mean",
                            ratio="sequence")
    theirs = _verl_gspo(old, theirs_x, adv, mask, *eps)
    torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)
    ours.backward()
    theirs.backward()
    assert ours_x.grad is not None and theirs_x.grad is not None
    torch.testing.assert_close(ours_x.grad * mask, theirs_x.grad * mask, atol=1e-9, rtol=0)


def test_gspo_on_policy_gradient_is_the_token_mean_policy_gradient() -> None:
    """One optimizer step on the rollout (pass on-policy-logp): every ratio is 1, so GSPO's gradient is GRPO's
    with the same aggregation: -A / (|y_i| B) on each token."""
    logp = (G_OLD + G_D).requires_grad_()
    loss, m = policy_loss(logp, None, G_ADV, G_MASK, agg="seq-mean-token-mean", ratio="sequence", clip=3e-4,
                          clip_high=4e-4)
    loss.backward()
    assert logp.grad is not None and m["clipfrac"] == 0.0 and m["pg_ratio_mean"] == 1.0
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.25, 0.25, 0.0]],
                                                       dtype=torch.float64))


# --- CISPO ----------------------------------------------------------------------------------------------------
# One response, three tokens, old_logp = 0 so that r = pi: r = [0.5, 1.5, 7.0], A = [1, -1, 2] (token-level).
# clip = 1 (lower bound 1 - 1 = 0), clip_high = 4 (upper bound 5): w = sg(clip(r)) = [0.5, 1.5, 5.0]
#   l_t = -w A log r: [-0.5 * 1 * ln 0.5, -1.5 * -1 * ln 1.5, -5 * 2 * ln 7] = [0.3465736, 0.6081977, -19.4591015]
#   token-mean: -18.5043302 / 3 = -6.1681101; gradient -w A / 3 = [-1/6, 0.5, -10/3]: every token has one
#   clipfrac: token 2's weight was clamped (7 -> 5): 1/3
C_R = torch.tensor([[0.5, 1.5, 7.0]], dtype=torch.float64)
C_ADV = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
C_MASK = torch.ones(1, 3, dtype=torch.float64)


def test_cispo_worked_values() -> None:
    logp = C_R.log().requires_grad_()
    loss, m = cispo_loss(logp, torch.zeros(1, 3, dtype=torch.float64), C_ADV, C_MASK, clip=1.0, clip_high=4.0)
    assert float(loss.detach()) == pytest.approx(-6.1681101, abs=1e-7)
    assert m["clipfrac"] == pytest.approx(1 / 3) and m["ratio_mean"] == pytest.approx(3.0)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 6, 0.5, -10 / 3]], dtype=torch.float64))


def test_cispo_keeps_the_gradient_ppo_clip_drops() -> None:
    """The same tokens under PPO's clip (0.2): token 2 (r = 7, A = 2 > 0) is clipped, its gradient 0; CISPO keeps
    it, weighted by the clipped 5."""
    logp = C_R.log().requires_grad_()
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 3, dtype=torch.float64), C_ADV, C_MASK, clip=0.2)
    loss.backward()
    assert logp.grad is not None and float(logp.grad[0, 2]) == 0.0


def _verl_cispo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """verl's compute_policy_loss_cispo (core_algos.py), transcribed, with agg_loss "token-mean"."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - low, 1 + high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return (pg_losses * response_mask).sum() / response_mask.sum()


@pytest.mark.parametrize("eps", [(1.0, 4.0), (0.2, 0.28)])
def test_cispo_equals_verls_compute_policy_loss_cispo(eps: tuple[float, float]) -> None:
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    logp0 = old + torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 5])[:, None]).double()
    ours_x, theirs_x = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
    ours, _ = cispo_loss(ours_x, old, adv, mask, clip=eps[0], clip_high=eps[1])
    theirs = _verl_cispo(old, theirs_x, adv, mask, *eps)
    torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)
    ours.backward()
    theirs.backward()
    assert ours_x.grad is not None and theirs_x.grad is not None
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, atol=1e-9, rtol=0)


def test_cispo_on_policy_is_reinforce() -> None:
    """With old = logp (one step on the rollout) every weight is 1: the gradient is -A / N per token, PPO's."""
    logp = C_R.log().requires_grad_()
    loss, _ = policy_loss(logp, None, C_ADV, C_MASK, loss="cispo", clip=1.0, clip_high=4.0)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -C_ADV / 3)


# --- Dr. GRPO -------------------------------------------------------------------------------------------------


def test_dr_grpo_advantages_are_the_reward_minus_the_group_mean() -> None:
    # group of 4 with rewards [1, 0, 0, 1] and [1, 1, 1, 0]: means 0.5 and 0.75, no division by the std
    out = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]), group=4, norm_std=False)
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))


def test_dr_grpo_aggregation_is_verls_agg_loss_with_a_loss_scale_factor() -> None:
    # verl: sum(loss * mask) / loss_scale_factor. Losses [[1, 2, 3, 9], [4, 9, 9, 9]], mask 3 + 1 tokens:
    # (1 + 2 + 3 + 4) / 16 = 0.625 with loss_scale_factor = max_tokens = 16 (not / 4, the batch's width)
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=16)) == pytest.approx(0.625)
    assert float(aggregate(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(2.5)


def test_dr_grpo_weighs_every_token_alike_whatever_its_response_length() -> None:
    """GRPO's 1/|o_i| gives a short response's tokens more weight (the length bias Dr. GRPO removes): with
    seq-mean-token-mean a 1-token and a 4-token response's tokens get 1/(2*1) and 1/(2*4); with the token sum
    over a constant 8 both get 1/8."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([-1.0, -1.0])
    grads = {}
    for agg, horizon in (("seq-mean-token-mean", None), ("seq-mean-token-sum-norm", 8.0)):
        logp = torch.full((2, 4), -1.0, requires_grad=True)
        loss, _ = policy_loss(logp, None, adv, mask, agg=agg, horizon=horizon)
        loss.backward()
        assert logp.grad is not None
        grads[agg] = logp.grad
    torch.testing.assert_close(grads["seq-mean-token-mean"][:, 0], torch.tensor([0.5, 0.125]))
    torch.testing.assert_close(grads["seq-mean-token-sum-norm"] * mask, mask / 8)


# --- micro-batches: rows split, sequences whole -----------------------------------------------------------------

SPLITS = {"pairs": [2, 2, 2, 2], "3+5": [3, 5], "singles": [1] * 8}


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([6, 3, 1, 6, 0, 4, 2, 5])
    old = -torch.rand(8, 6, generator=g, dtype=torch.float64) * 3
    return {"old": old, "logp": old + torch.randn(8, 6, generator=g, dtype=torch.float64) * 0.3,
            "adv": torch.randn(8, generator=g, dtype=torch.float64),
            "mask": (torch.arange(6)[None, :] < lengths[:, None]).double()}


def _loss(kind: str, b: dict[str, torch.Tensor], x: torch.Tensor, rows: slice, agg: str,
          **kw: float) -> torch.Tensor:
    if kind == "cispo":
        return cispo_loss(x, b["old"][rows], b["adv"][rows], b["mask"][rows], agg=agg, **kw)[0]
    return ppo_clip_loss(x, b["old"][rows], b["adv"][rows], b["mask"][rows], clip=0.1, agg=agg, ratio="sequence",
                         **kw)[0]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_micro_batch_sum_equals_whole(kind: str, agg: str, split: str) -> None:
    b = _batch()
    whole_x = b["logp"].clone().requires_grad_()
    whole = _loss(kind, b, whole_x, slice(0, 8), agg, horizon=16)
    whole.backward()
    kw = {"num_tokens": float(b["mask"].sum()), "num_seqs": 8, "horizon": 16}
    total, grads, start = torch.zeros((), dtype=torch.float64), [], 0
    for size in SPLITS[split]:
        rows = slice(start, start + size)
        x = b["logp"][rows].clone().requires_grad_()
        loss = _loss(kind, b, x, rows, agg, **kw)
        loss.backward()
        total, start = total + loss.detach(), start + size
        grads.append(x.grad)
    torch.testing.assert_close(total, whole.detach(), atol=1e-9, rtol=0)
    assert whole_x.grad is not None
    torch.testing.assert_close(torch.cat(grads), whole_x.grad, atol=1e-9, rtol=0)


def test_a_sequence_split_across_micro_batches_would_change_its_ratio() -> None:
    """Why micro-batches split rows and never a row: half a response has another mean log-ratio (G_D row 0:
    its first two tokens' mean is -0.05, the whole row's 0.1)."""
    logp = G_OLD + G_D
    half = sequence_log_ratio(logp[:, :2], G_OLD[:, :2], G_MASK[:, :2])
    assert float(half[0]) == pytest.approx(-0.05) and float(sequence_log_ratio(logp, G_OLD, G_MASK)[0]) == \
        pytest.approx(0.1)


# --- names shared with the language -------------------------------------------------------------------------------


def test_the_language_names_the_same_losses_and_ratio_levels() -> None:
    assert signatures.ROLLOUT_LOSSES == ROLLOUT_LOSSES and signatures.RATIO_LEVELS == RATIO_LEVELS
    assert signatures.POLICY_UPDATE.param("ratio") is not None
    assert set(ROLLOUT_LOSSES) <= set(signatures.LOSS_KEYS)


def test_unknown_loss_or_ratio_level_is_an_error() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ppo_clip, cispo"):
        policy_loss(x, None, torch.ones(1), torch.ones(1, 2), loss="gspo")
    with pytest.raises(ValueError, match="token, sequence"):
        importance_log_ratio(x, x, torch.ones(1, 2), "group")
