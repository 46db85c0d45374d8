"""Loss masks with holes (observation tokens inside a multi-turn response): GAE, REINFORCE++ returns and every
loss aggregation equal the same computation on the compacted action-only sequences, and nothing depends on
the values at masked positions (worked values by hand, and equality on random inputs)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from flowrl.algos import AGG_MODES, denominators, gae, policy_loss, reinforce_pp_returns, value_loss

ATOL = 1e-5


def close(actual: torch.Tensor, expected: list[list[float]] | list[float] | float, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def holey_mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    """(B, T) 0/1: random action spans separated by observation spans, then right padding; every row has an
    action token and some rows have holes."""
    mask = (torch.rand(b, t, generator=gen) < 0.6).long()
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = mask * (torch.arange(t)[None, :] < lengths[:, None])
    mask[:, 0] = 1
    assert bool(((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any())  # there are holes, not just padding
    return mask


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The action tokens of each row moved to its front, right-padded with 0: (B, W) values and (B, W) mask,
    W = the most action tokens in a row."""
    width = int(mask.sum(1).max())
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    out_mask = torch.zeros(x.shape[0], width, dtype=mask.dtype)
    for i in range(x.shape[0]):
        keep = x[i][mask[i] > 0]
        out[i, : len(keep)] = keep
        out_mask[i, : len(keep)] = 1
    return out, out_mask


def scatter_back(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The inverse of `compact`: (B, W) values back at the action positions of `mask` (B, T), 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=x.dtype)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        out[i][mask[i] > 0] = x[i, :n]
    return out


# --- GAE and REINFORCE++ over holes --------------------------------------------------------------------------


def test_gae_with_an_observation_span_worked_values() -> None:
    # Tokens: action (turn 0, reward 0.5), 2 observation tokens, 2 actions (the score 1 on the last), a pad.
    # Compacted: r = [0.5, 0, 1], V = [0.5, 0.4, 0.3]; gamma = 0.9, lam = 0.8 (gamma * lam = 0.72):
    # t=2: 1 - 0.3 = 0.7;  t=1: 0 + 0.9 * 0.3 - 0.4 = -0.13, -0.13 + 0.72 * 0.7 = 0.374;
    # t=0: 0.5 + 0.9 * 0.4 - 0.5 = 0.36, 0.36 + 0.72 * 0.374 = 0.62928. Returns = A + V.
    # The observation and pad positions hold rewards and values (7, 9) that must be ignored.
    r = torch.tensor([[0.5, 7.0, 7.0, 0.0, 1.0, 7.0]])
    v = torch.tensor([[0.5, 9.0, 9.0, 0.4, 0.3, 9.0]])
    m = torch.tensor([[1, 0, 0, 1, 1, 0]])
    a, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    close(a, [[0.62928, 0.0, 0.0, 0.374, 0.7, 0.0]])
    close(ret, [[1.12928, 0.0, 0.0, 0.774, 1.0, 0.0]])


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_with_holes_equals_gae_on_the_compacted_actions(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(26)
    b, t = 16, 14
    mask = holey_mask(g, b, t)
    r = torch.randn(b, t, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, generator=g, dtype=torch.float64)
    a, ret = gae(r, v, mask, gamma, lam)
    (r_c, m_c), (v_c, _) = compact(r, mask), compact(v, mask)
    a_c, ret_c = gae(r_c, v_c, m_c, gamma, lam)
    torch.testing.assert_close(a, scatter_back(a_c, mask), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, scatter_back(ret_c, mask), atol=1e-12, rtol=0)
    assert bool((a[mask == 0] == 0).all()) and bool((ret[mask == 0] == 0).all())


def test_gae_without_holes_is_unchanged_on_valid_tokens() -> None:
    """The plain right-padded case: the valid tokens' numbers are exactly (bit for bit) the textbook loop's."""
    g = torch.Generator().manual_seed(3)
    r = torch.randn(4, 6, generator=g)
    v = torch.randn(4, 6, generator=g)
    m = (torch.arange(6)[None, :] < torch.tensor([6, 1, 4, 3])[:, None]).long()
    a, ret = gae(r, v, m, 0.99, 0.95)
    for i, n in enumerate([6, 1, 4, 3]):
        running = torch.zeros((), dtype=r.dtype)
        next_v = torch.zeros((), dtype=r.dtype)
        for step in reversed(range(n)):
            delta = r[i, step] + 0.99 * next_v - v[i, step]
            running = delta + 0.99 * 0.95 * running
            next_v = v[i, step]
            assert a[i, step] == running and ret[i, step] == running + v[i, step]


def test_reinforce_pp_discounts_per_action_across_holes() -> None:
    # Compacted rewards [0.5, 0, 1], gamma 0.9: G = [0.5 + 0.81, 0.9, 1] = [1.31, 0.9, 1].
    r = torch.tensor([[0.5, 7.0, 7.0, 0.0, 1.0, 7.0]])
    m = torch.tensor([[1, 0, 0, 1, 1, 0]])
    close(reinforce_pp_returns(r, m, gamma=0.9), [[1.31, 0.0, 0.0, 0.9, 1.0, 0.0]])
    g = torch.Generator().manual_seed(5)
    mask = holey_mask(g, 10, 12)
    rewards = torch.randn(10, 12, generator=g, dtype=torch.float64)
    r_c, m_c = compact(rewards, mask)
    torch.testing.assert_close(reinforce_pp_returns(rewards, mask, 0.95),
                               scatter_back(reinforce_pp_returns(r_c, m_c, 0.95), mask), atol=1e-12, rtol=0)


# --- losses over holes ---------------------------------------------------------------------------------------

B, T = 6, 10


def _rollout(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = holey_mask(g, B, T)
    return {
        "mask": mask,
        "logp": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "old": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "ref": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        # the behaviour log-probs are 0 on observation tokens (the batch contract's gen_logp)
        "behav": torch.where(mask > 0, -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
                             torch.zeros(B, T, dtype=torch.float64)),
        "adv": torch.randn(B, T, generator=g, dtype=torch.float64),
        "entropy": torch.rand(B, T, generator=g, dtype=torch.float64),
        "values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "returns": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


Objective = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, str, dict[str, float]], torch.Tensor]


def _policy(d: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor, agg: str,
            denoms: dict[str, float]) -> torch.Tensor:
    loss, _ = policy_loss(x, d["old"], d["adv"], mask, ref_logp=d["ref"], behav_logp=d["behav"],
                          is_correction="decoupled", entropy=d["entropy"], clip=0.2, kl_coef=0.1,
                          entropy_coef=0.01, agg=agg, **denoms)
    return loss


def _value(d: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor, agg: str,
           denoms: dict[str, float]) -> torch.Tensor:
    return value_loss(x, d["values"], d["returns"], mask, clip=0.2, agg=agg, **denoms)[0]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(("objective", "trained"), [(_policy, "logp"), (_value, "values")])
def test_loss_ignores_masked_positions(objective: Objective, trained: str, agg: str) -> None:
    """The loss and its gradient do not depend on the trained tensor at observation tokens: garbage there
    (huge log-ratios, -inf log-probs) changes nothing, and their gradient is exactly 0."""
    d = _rollout(11)
    mask = d["mask"]
    denoms = denominators(torch.ones_like(mask), mask)
    x = d[trained].clone().requires_grad_(True)
    loss = objective(d, x, mask, agg, denoms)
    (grad,) = torch.autograd.grad(loss, x)
    garbage = torch.where(mask > 0, d[trained], torch.full_like(d[trained], -1e4))
    garbage[~(mask > 0) & (torch.arange(T)[None, :] % 2 == 0)] = float("-inf")
    y = garbage.clone().requires_grad_(True)
    loss_y = objective(d, y, mask, agg, denoms)
    (grad_y,) = torch.autograd.grad(loss_y, y)
    assert torch.isfinite(loss_y)
    torch.testing.assert_close(loss_y, loss, atol=0, rtol=0)
    torch.testing.assert_close(grad_y, grad, atol=0, rtol=0)
    assert bool((grad[mask == 0] == 0).all()) and bool((grad[mask > 0] != 0).any())


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(("objective", "trained"), [(_policy, "logp"), (_value, "values")])
def test_loss_equals_the_loss_on_compacted_actions(objective: Objective, trained: str, agg: str) -> None:
    """With `denominators` counted on the loss mask, every aggregation mode gives the loss (and gradient) of
    the action-only sequences: observation tokens are neither trained on nor counted."""
    d = _rollout(12)
    mask = d["mask"]
    x = d[trained].clone().requires_grad_(True)
    loss = objective(d, x, mask, agg, denominators(torch.ones_like(mask), mask))
    (grad,) = torch.autograd.grad(loss, x)
    c = {k: compact(v, mask)[0] for k, v in d.items() if k != "mask"}
    m_c = compact(d["mask"], mask)[1]
    x_c = c[trained].clone().requires_grad_(True)
    loss_c = objective(c, x_c, m_c, agg, denominators(m_c))  # compacted: no loss mask, plain width
    (grad_c,) = torch.autograd.grad(loss_c, x_c)
    torch.testing.assert_close(loss, loss_c, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, scatter_back(grad_c, mask), atol=1e-12, rtol=0)


def test_policy_metrics_count_action_tokens_only() -> None:
    d = _rollout(13)
    mask = d["mask"]
    _, metrics = policy_loss(d["logp"], None, d["adv"], mask, ref_logp=d["ref"], behav_logp=d["behav"],
                             is_correction="decoupled", agg="token-mean", **denominators(torch.ones_like(mask), mask))
    c = {k: compact(v, mask)[0] for k, v in d.items() if k != "mask"}
    m_c = compact(mask, mask)[1]
    _, metrics_c = policy_loss(c["logp"], None, c["adv"], m_c, ref_logp=c["ref"], behav_logp=c["behav"],
                               is_correction="decoupled", agg="token-mean", **denominators(m_c))
    assert metrics.keys() == metrics_c.keys()
    for k, v in metrics.items():
        assert v == pytest.approx(metrics_c[k], abs=1e-12), k


def test_denominators() -> None:
    response = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    # without a loss mask: what the trainer always used (tokens, rows, width)
    assert denominators(response) == {"num_tokens": 7.0, "num_seqs": 2.0, "horizon": 6.0}
    loss_mask = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    # 3 + 2 action tokens; the widest row has 3 action tokens; two trajectories are two sequences
    assert denominators(response, loss_mask) == {"num_tokens": 5.0, "num_seqs": 2.0, "horizon": 3.0}
