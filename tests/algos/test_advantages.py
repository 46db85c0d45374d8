"""Golden-number tests for flowrl.algos.advantages; every expected value was worked out by hand."""

from __future__ import annotations

import pytest
import torch

from flowrl.algos import gae, grpo_advantages, reinforce_pp_returns, rloo_advantages, whiten

ATOL = 1e-5

G0 = [1.0, 0.0, 0.0, 1.0]
G1 = [0.5, 1.0, 0.0, 0.0]
G2 = [1.0, 1.0, 1.0, 1.0]
SCORES = torch.tensor(G0 + G1 + G2)  # (12,) three groups of four


def close(actual: torch.Tensor, expected: list[float] | list[list[float]], atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- GRPO -------------------------------------------------------------------------------------------------


def test_grpo_golden() -> None:
    a = grpo_advantages(SCORES, 4)
    close(a[:4], [0.866024, -0.866024, -0.866024, 0.866024])
    close(a[4:8], [0.261116, 1.30558, -0.783348, -0.783348])
    close(a[8:], [0.0, 0.0, 0.0, 0.0])


def test_grpo_eps() -> None:
    a = grpo_advantages(SCORES, 4, eps=1e-4)
    close(a[:4], [0.865875, -0.865875, -0.865875, 0.865875])
    close(a[4:8], [0.261062, 1.30531, -0.783186, -0.783186])


def test_dr_grpo_no_std() -> None:
    a = grpo_advantages(SCORES, 4, norm_std=False)
    close(a[:4], [0.5, -0.5, -0.5, 0.5])
    close(a[4:8], [0.125, 0.625, -0.375, -0.375])
    close(a[8:], [0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_group_ids_shuffled(norm_std: bool) -> None:
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([7] * 4 + [3] * 4 + [42] * 4)  # arbitrary, unsorted id values
    expected = grpo_advantages(SCORES, 4, norm_std=norm_std)
    a = grpo_advantages(SCORES[perm], ids[perm], norm_std=norm_std)
    torch.testing.assert_close(a, expected[perm], atol=ATOL, rtol=0)


def test_grpo_singleton_group_keeps_score() -> None:
    # verl convention: mean 0, std 1 for a group of one.
    a = grpo_advantages(torch.tensor([0.7, 1.0, 0.0]), torch.tensor([5, 9, 9]))
    close(a, [0.7 / (1 + 1e-6), 0.707106, -0.707106])


def test_grpo_bad_group() -> None:
    with pytest.raises(ValueError, match="divide"):
        grpo_advantages(SCORES, 5)
    with pytest.raises(ValueError, match="shape"):
        grpo_advantages(SCORES, torch.zeros(11, dtype=torch.long))


# --- RLOO -------------------------------------------------------------------------------------------------


def test_rloo_golden() -> None:
    a = rloo_advantages(SCORES, 4)
    close(a[:4], [0.666667, -0.666667, -0.666667, 0.666667])
    close(a[4:8], [0.166667, 0.833333, -0.5, -0.5])
    close(a[8:], [0.0, 0.0, 0.0, 0.0])


def test_rloo_ids_and_singleton() -> None:
    # Group 9 = [1, 0]: each baseline is the other score. Group 5 is a singleton: verl leaves A = r.
    a = rloo_advantages(torch.tensor([1.0, 0.7, 0.0]), torch.tensor([9, 5, 9]))
    close(a, [1.0, 0.7, -1.0])


# --- REINFORCE++ ------------------------------------------------------------------------------------------


def test_reinforce_pp_golden() -> None:
    # G2 = 2; G1 = 1 + 0.5*2 = 2; G0 = 0 + 0.5*2 = 1; padded position -> 0.
    r = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    close(reinforce_pp_returns(r, m, gamma=0.5), [[1.0, 2.0, 2.0, 0.0]])


def test_reinforce_pp_masked_reward_ignored() -> None:
    # A reward sitting on a masked token neither counts nor gets a return; gamma=1 -> plain suffix sums.
    r = torch.tensor([[1.0, 5.0, 2.0, 3.0]])
    m = torch.tensor([[1, 0, 1, 0]])
    close(reinforce_pp_returns(r, m), [[3.0, 0.0, 2.0, 0.0]])


# --- GAE --------------------------------------------------------------------------------------------------


def test_gae_golden_right_padded() -> None:
    # t=2: 1 + 0 - 0.3 = 0.7; t=1: (0.3 - 0.4) + 0.95*0.7 = 0.565; t=0: (0.4 - 0.5) + 0.95*0.565 = 0.43675.
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.4, 0.3, 0.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    a, ret = gae(r, v, m, gamma=1.0, lam=0.95)
    close(a[:, :3], [[0.43675, 0.565, 0.7]])
    close(ret[:, :3], [[0.93675, 0.965, 1.0]])
    # Masked positions (here trailing padding) get advantage 0 and return 0.
    close(a[:, 3], [0.0])
    close(ret[:, 3], [0.0])

    w = whiten(a, m)
    close(w, [[-0.991344, -0.017092, 1.008436, 0.0]])
    w_pop = whiten(a, m, unbiased=False)
    close(w_pop, [[-1.214144, -0.020934, 1.235077, 0.0]])


def test_gae_interior_mask_carries_forward() -> None:
    # t=3: 1 - 0.2 = 0.8; t=2: (0.2 - 0.3) + 0.95*0.8 = 0.66; t=1 masked: V_next stays 0.3, A stays 0.66;
    # t=0: (0.3 - 0.5) + 0.95*0.66 = 0.427.
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.4, 0.3, 0.2]])
    m = torch.tensor([[1, 0, 1, 1]])
    a, ret = gae(r, v, m, gamma=1.0, lam=0.95)
    close(a[:, [0, 2, 3]], [[0.427, 0.66, 0.8]])
    close(ret[:, [0, 2, 3]], [[0.927, 0.96, 1.0]])
    # The masked token holds nothing (verl would store the carried 0.66 there): nothing may train on it.
    close(a[:, 1], [0.0])
    close(ret[:, 1], [0.0])


def _gae_reference(r: list[float], v: list[float], n: int, gamma: float, lam: float) -> list[float]:
    """Textbook GAE on the first n (valid) tokens of one row, terminal after the last one."""
    adv = [0.0] * n
    running = 0.0
    for t in reversed(range(n)):
        next_v = v[t + 1] if t + 1 < n else 0.0
        delta = r[t] + gamma * next_v - v[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


def test_gae_matches_loop_reference() -> None:
    g = torch.Generator().manual_seed(1234)
    b, t_len, gamma, lam = 6, 9, 0.99, 0.9
    lengths = [9, 1, 5, 7, 3, 8]
    r = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    v = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    m = (torch.arange(t_len)[None, :] < torch.tensor(lengths)[:, None]).long()  # right-padded
    a, ret = gae(r, v, m, gamma, lam)
    for i, n in enumerate(lengths):
        ref = _gae_reference(r[i].tolist(), v[i].tolist(), n, gamma, lam)
        torch.testing.assert_close(a[i, :n], torch.tensor(ref, dtype=a.dtype), atol=1e-10, rtol=0)
        torch.testing.assert_close(ret[i, :n], a[i, :n] + v[i, :n])
        assert torch.all(a[i, n:] == 0)


def test_gae_does_not_track_grad() -> None:
    v = torch.rand(2, 3, requires_grad=True)
    a, ret = gae(torch.rand(2, 3), v, torch.ones(2, 3), 1.0, 1.0)
    assert not a.requires_grad and not ret.requires_grad


# --- whiten -----------------------------------------------------------------------------------------------


def test_whiten_shift_mean_false_keeps_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased var 1 -> (x - 2) * 1 + 2 = x on valid entries.
    close(whiten(x, m, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]], atol=1e-6)


def test_whiten_degenerate_masks() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0]])
    close(whiten(x, torch.zeros(1, 3)), [[0.0, 0.0, 0.0]])
    close(whiten(x, torch.tensor([[0, 1, 0]])), [[0.0, 0.0, 0.0]])
