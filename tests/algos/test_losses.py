"""Golden-number and invariance tests for flowrl.algos.losses; expected values were worked out by hand."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from flowrl.algos import AGG_MODES, aggregate, kl, policy_loss, ppo_clip_loss, value_loss
from flowrl.algos.losses import _ppo_clip_token_loss

ATOL = 1e-5


def close(
    actual: torch.Tensor, expected: float | list[float] | list[list[float]], atol: float = ATOL
) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- KL ---------------------------------------------------------------------------------------------------

LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-1.2, -1.5, -0.5])


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("k1", "kl"), [0.2, -0.5, 0.0]),
        (("k2", "mse"), [0.02, 0.125, 0.0]),
        (("k3", "low_var_kl"), [0.018731, 0.148721, 0.0]),  # exp(-d) + d - 1
    ],
)
def test_kl_golden(kinds: tuple[str, str], expected: list[float]) -> None:
    for kind in kinds:
        close(kl(LOGP, REF, kind), expected)


def test_kl_default_is_k3() -> None:
    torch.testing.assert_close(kl(LOGP, REF), kl(LOGP, REF, "k3"))


def test_k3_clamped() -> None:
    # d = -30 -> clamped to -20 -> exp(20) - 21, then the output clamps to 10; d = 30 -> 19 -> 10.
    out = kl(torch.tensor([-30.0, 30.0]), torch.tensor([0.0, 0.0]), "k3")
    close(out, [10.0, 10.0])
    assert torch.isfinite(out).all()


def test_kl_unknown_kind() -> None:
    with pytest.raises(ValueError) as err:
        kl(LOGP, REF, "k4")
    for name in ("k1", "k2", "k3", "kl", "mse", "low_var_kl"):
        assert name in str(err.value)


# --- aggregation ------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),  # (1+2+3+4) / 4
        ("seq-mean-token-mean", 3.0),  # (6/3 + 4/1) / 2
        ("seq-mean-token-sum", 5.0),  # (6 + 4) / 2
        ("seq-mean-token-sum-norm", 2.5),  # 10 / L, L = 4
    ],
)
def test_aggregate_golden(mode: str, expected: float) -> None:
    close(aggregate(LOSS, MASK, mode), expected)


def test_aggregate_default_is_token_mean() -> None:
    close(aggregate(LOSS, MASK), 2.5)


def test_aggregate_overrides() -> None:
    close(aggregate(LOSS, MASK, "token-mean", num_tokens=10), 1.0)
    close(aggregate(LOSS, MASK, "seq-mean-token-sum", num_seqs=5), 2.0)
    close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", horizon=8), 1.25)


def test_aggregate_empty_rows_and_nan_padding() -> None:
    loss = torch.tensor([[1.0, float("nan")], [float("inf"), 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    close(aggregate(loss, mask, "seq-mean-token-mean"), 0.5)  # (1 + 0) / 2: the empty row counts as 0
    out = aggregate(loss, mask, "token-mean")
    out.backward()
    close(out, 1.0)
    assert loss.grad is not None and torch.isfinite(loss.grad).all()
    close(aggregate(loss.detach(), torch.zeros(2, 2), "token-mean"), 0.0)


def test_aggregate_unknown_mode() -> None:
    with pytest.raises(ValueError) as err:
        aggregate(LOSS, MASK, "token-sum")
    for mode in AGG_MODES:
        assert mode in str(err.value)


# --- PPO clip ---------------------------------------------------------------------------------------------

ADV = torch.tensor([[1.0, -1.0, 2.0, -2.0, -1.0]])
RATIO = torch.tensor([[1.5, 0.5, 0.9, 4.0, 10.0]])
PLAIN = [-1.2, 0.8, -1.8, 8.0, 10.0]
DUAL = [-1.2, 0.8, -1.8, 6.0, 3.0]


@pytest.mark.parametrize(("dual_clip", "expected"), [(None, PLAIN), (3.0, DUAL)])
def test_ppo_token_loss_golden(dual_clip: float | None, expected: list[float]) -> None:
    logp, old = RATIO.log(), torch.zeros_like(RATIO)
    token_loss, ratio, clipped = _ppo_clip_token_loss(logp, old, ADV, 0.2, None, dual_clip)
    close(token_loss, [expected])
    close(ratio, RATIO.tolist())
    assert clipped.tolist() == [[True, True, False, False, False]]
    # The public function, one token at a time through the mask.
    for t, value in enumerate(expected):
        mask = torch.zeros_like(RATIO)
        mask[0, t] = 1
        loss, _ = ppo_clip_loss(logp, old, ADV, mask, clip=0.2, dual_clip=dual_clip)
        close(loss, value)


def test_ppo_metrics() -> None:
    logp, old = RATIO.log(), torch.zeros_like(RATIO)
    loss, metrics = ppo_clip_loss(logp, old, ADV, torch.ones_like(RATIO))
    close(loss, sum(PLAIN) / 5)
    assert set(metrics) == {"clipfrac", "ppo_kl", "ratio_mean"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["clipfrac"] == pytest.approx(0.4)
    assert metrics["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIO[0].tolist()) / 5)
    assert metrics["ratio_mean"] == pytest.approx(16.9 / 5)


def test_ppo_clip_high() -> None:
    logp, old = torch.tensor([[math.log(1.5), math.log(0.5)]]), torch.zeros(1, 2)
    token_loss, _, _ = _ppo_clip_token_loss(logp, old, torch.tensor([[1.0, -1.0]]), 0.2, 0.28)
    close(token_loss, [[-1.28, 0.8]])  # upper bound moves to 1.28, lower stays at 0.8


def test_ppo_sequence_advantage_broadcast() -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 4)
    a, _ = ppo_clip_loss(logp, old, adv, mask)
    b, _ = ppo_clip_loss(logp, old, adv[:, None].expand(3, 4), mask)
    torch.testing.assert_close(a, b)


def test_ppo_gradient_only_to_logp() -> None:
    logp = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, 3, requires_grad=True)
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(2, 3))
    loss.backward()
    assert logp.grad is not None
    assert old.grad is None and adv.grad is None


def test_ppo_bad_dual_clip() -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), dual_clip=1.0)


# --- value loss -------------------------------------------------------------------------------------------

V = torch.tensor([[1.0, 0.0, 1.2]])
V_OLD = torch.tensor([[0.5, 0.5, 0.5]])
RET = torch.tensor([[0.0, 1.0, 1.0]])


def test_value_loss_golden() -> None:
    # Squared errors: unclipped [1, 1, 0.04]; clipped (V -> [0.7, 0.3, 0.7]) [0.49, 0.49, 0.09].
    loss, metrics = value_loss(V, V_OLD, RET, torch.ones(1, 3), clip=0.2)
    close(loss, 0.5 * (1 + 1 + 0.09) / 3)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["vpred_mean"] == pytest.approx(2.2 / 3)
    loss, metrics = value_loss(V, V_OLD, RET, torch.ones(1, 3), clip=None)
    close(loss, 0.5 * (1 + 1 + 0.04) / 3)
    assert metrics["vf_clipfrac"] == 0.0


def test_value_gradient_only_to_values() -> None:
    v = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3, requires_grad=True)
    ret = torch.randn(2, 3, requires_grad=True)
    loss, _ = value_loss(v, old, ret, torch.ones(2, 3))
    loss.backward()
    assert v.grad is not None
    assert old.grad is None and ret.grad is None


# --- micro-batch invariance -------------------------------------------------------------------------------

B, T = 8, 6
LossFn = Callable[..., torch.Tensor]  # (batch, x, rows, agg, **denominators) -> scalar loss
SPLITS = {"pairs": [2, 2, 2, 2], "3+5": [3, 5], "singles": [1] * 8}


def _random_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([6, 3, 1, 6, 0, 4, 2, 5])  # right padding, one row with no valid token
    return {
        "logp": -torch.rand(B, T, generator=g) * 3,
        "old": -torch.rand(B, T, generator=g) * 3,
        "adv": torch.randn(B, T, generator=g),
        "values": torch.randn(B, T, generator=g),
        "old_values": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
        "mask": (torch.arange(T)[None, :] < lengths[:, None]).float(),
    }


def _policy(
    batch: dict[str, torch.Tensor], x: torch.Tensor, rows: slice, agg: str, **kw: float
) -> torch.Tensor:
    return ppo_clip_loss(x, batch["old"][rows], batch["adv"][rows], batch["mask"][rows], agg=agg, **kw)[0]


def _value(
    batch: dict[str, torch.Tensor], x: torch.Tensor, rows: slice, agg: str, **kw: float
) -> torch.Tensor:
    return value_loss(
        x, batch["old_values"][rows], batch["returns"][rows], batch["mask"][rows], agg=agg, **kw
    )[0]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(("fn", "key"), [(_policy, "logp"), (_value, "values")], ids=["ppo", "value"])
def test_micro_batch_sum_equals_whole(fn: LossFn, key: str, agg: str, split: str) -> None:
    batch = _random_batch()
    whole_x = batch[key].clone().requires_grad_()
    whole = fn(batch, whole_x, slice(0, B), agg)
    whole.backward()

    # Each micro-batch gets the whole mini-batch's denominators, then losses and gradients accumulate.
    kw = {"num_tokens": batch["mask"].sum().item(), "num_seqs": B, "horizon": T}
    total = torch.zeros(())
    grads = []
    start = 0
    for size in SPLITS[split]:
        rows = slice(start, start + size)
        x = batch[key][rows].clone().requires_grad_()
        loss = fn(batch, x, rows, agg, **kw)
        loss.backward()
        total = total + loss.detach()
        assert x.grad is not None
        grads.append(x.grad)
        start += size

    torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=0)
    assert whole_x.grad is not None
    torch.testing.assert_close(torch.cat(grads), whole_x.grad, atol=1e-6, rtol=0)


# ---- the policy update's whole objective (policy_loss) ------------------------------------------------------
# One sample, three tokens, the last masked; worked by hand (token-mean over the 2 valid tokens):
#   logp = [ln .5, ln .2, ln .9], old = [ln .4, ln .25, ln .9], ref = [ln .5, ln .1, ln .3], A = 1, clip 0.2
#   rho = [1.25, 0.8, 1]: token 0 clips at 1.2 (-A*1.25 = -1.25 < -1.2, so max = -1.2), token 1 keeps -0.8
#   pg = (-1.2 - 0.8) / 2 = -1.0, clipfrac = 1/2
#   k3(logp, ref) = exp(ref - logp) - (ref - logp) - 1: token 0: 0; token 1: 0.5 - ln .5 - 1 = 0.193147...
#   kl_loss = 0.193147 / 2 = 0.0965736; entropy bonus: token-mean of [1.0, 3.0] = 2.0
PL_LOGP = [math.log(0.5), math.log(0.2), math.log(0.9)]
PL_OLD = [math.log(0.4), math.log(0.25), math.log(0.9)]
PL_REF = [math.log(0.5), math.log(0.1), math.log(0.3)]
PL_K3_1 = 0.5 - math.log(0.5) - 1.0


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_policy_loss_adds_the_kl_penalty_and_the_entropy_bonus_to_ppo_clip() -> None:
    mask = _t([1.0, 1.0, 0.0])
    loss, m = policy_loss(_t(PL_LOGP), _t(PL_OLD), torch.tensor([1.0], dtype=torch.float64), mask, ref_logp=_t(PL_REF),
                          entropy=_t([1.0, 3.0, 7.0]), clip=0.2, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)
    assert m["pg_loss"] == pytest.approx(-1.0)
    assert m["clipfrac"] == pytest.approx(0.5)
    assert m["kl_loss"] == pytest.approx(PL_K3_1 / 2)
    assert m["entropy"] == pytest.approx(2.0)
    assert float(loss) == pytest.approx(-1.0 + 0.1 * PL_K3_1 / 2 - 0.01 * 2.0)
    assert "kl_mean" not in m  # old log-probs given: the controller measures the KL from its own forwards


def test_policy_loss_without_penalties_is_ppo_clip() -> None:
    mask = _t([1.0, 1.0, 0.0])
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, m = policy_loss(_t(PL_LOGP), _t(PL_OLD), adv, mask, ref_logp=_t(PL_REF), clip=0.2)
    want, pg = ppo_clip_loss(_t(PL_LOGP), _t(PL_OLD), adv, mask, clip=0.2)
    assert float(loss) == float(want) and m["pg_ratio_mean"] == pg["ratio_mean"] and "kl_loss" not in m


def test_policy_loss_on_policy_measures_the_k1_kl_to_the_reference() -> None:
    """No old log-probs (pass on-policy-logp): the ratio is 1, so the loss is -A; kl_mean is the k1 token mean."""
    mask = _t([1.0, 1.0, 0.0])
    loss, m = policy_loss(_t(PL_LOGP), None, torch.tensor([2.0], dtype=torch.float64), mask, ref_logp=_t(PL_REF),
                          num_tokens=2.0)
    assert float(loss) == pytest.approx(-2.0) and m["clipfrac"] == 0.0
    assert m["kl_mean"] == pytest.approx((0.0 + (math.log(0.2) - math.log(0.1))) / 2)
