"""Worked-value tests for flowrl.algos.turns: turn returns, turn-level GRPO/RLOO and per-token rewards over
multi-turn trajectories (observation tokens inside the response, per-turn rewards at each turn's last action)."""

from __future__ import annotations

import pytest
import torch

from flowrl.algos import (
    grpo_advantages,
    last_valid_index,
    rloo_advantages,
    token_rewards,
    turn_advantages,
    turn_returns,
    turn_rloo_advantages,
)

ATOL = 1e-5
_ = -1  # a pad's turn

# One group of four trajectories, T = 8. a = action token (loss_mask 1), o = observation (loss_mask 0).
#   A: a a a                    1 turn,  r = [0],        s = 1 -> G = [1]
#   B: a a o o a a              2 turns, r = [0.5, 0],   s = 1 -> G = [1.5, 1]
#   C: a o a o a a o            3 turns, r = [0, 0, 1],  s = 0 -> G = [1, 1, 1]
#   D: o a a o a                2 turns, r = [-0.5, 0],  s = 0 -> G = [-0.5, 0]   (a reset observation first)
TURN_INDEX = torch.tensor([
    [0, 0, 0, _, _, _, _, _],
    [0, 0, 0, 0, 1, 1, _, _],
    [0, 0, 1, 1, 2, 2, 2, _],
    [0, 0, 0, 0, 1, _, _, _],
])
LOSS_MASK = torch.tensor([
    [1, 1, 1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 1, 0, 0],
    [1, 0, 1, 0, 1, 1, 0, 0],
    [0, 1, 1, 0, 1, 0, 0, 0],
])
TURN_REWARDS = torch.tensor([
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
    [0.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
])
SCORES = torch.tensor([1.0, 1.0, 0.0, 0.0])


def close(actual: torch.Tensor, expected: list[list[float]] | list[float], atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_turn_returns_worked_values() -> None:
    g = turn_returns(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES)
    close(g, [
        [1.0, 1.0, 1.0, 0, 0, 0, 0, 0],
        [1.5, 1.5, 0, 0, 1.0, 1.0, 0, 0],
        [1.0, 0, 1.0, 0, 1.0, 1.0, 0, 0],
        [0, -0.5, -0.5, 0, 0.0, 0, 0, 0],
    ])


def test_turn_advantages_worked_values() -> None:
    # Total returns G_0 = [1, 1.5, 1, -0.5]: mean 0.75; centred [0.25, 0.75, 0.25, -1.25], squares sum 2.25,
    # unbiased var 2.25 / 3 = 0.75, std 0.8660254. Turn k's advantage is (G_k - 0.75) / 0.8660254:
    #   A: 0.25 / .866 = 0.288675;  B: 0.75 / .866 = 0.866025, 0.25 / .866 = 0.288675;  C: 0.288675 on all turns;
    #   D: -1.25 / .866 = -1.443376, -0.75 / .866 = -0.866025.
    a = turn_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 4, eps=0.0)
    p, q, r, s, u = 0.288675, 0.866025, -1.443376, -0.866025, 0.0
    close(a, [
        [p, p, p, u, u, u, u, u],
        [q, q, u, u, p, p, u, u],
        [p, u, p, u, p, p, u, u],
        [u, r, r, u, s, u, u, u],
    ])
    # Dr.GRPO: centred only.
    c = turn_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 4, norm_std=False)
    close(c, [
        [0.25, 0.25, 0.25, 0, 0, 0, 0, 0],
        [0.75, 0.75, 0, 0, 0.25, 0.25, 0, 0],
        [0.25, 0, 0.25, 0, 0.25, 0.25, 0, 0],
        [0, -1.25, -1.25, 0, -0.75, 0, 0, 0],
    ])


def test_turn_rloo_worked_values() -> None:
    # Sum of G_0 = 3; leave-one-out baselines: A (3 - 1) / 3 = 0.666667, B (3 - 1.5) / 3 = 0.5,
    # C 0.666667, D (3 + 0.5) / 3 = 1.166667.
    a = turn_rloo_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 4)
    p, u = 1 / 3, 0.0
    close(a, [
        [p, p, p, u, u, u, u, u],
        [1.0, 1.0, u, u, 0.5, 0.5, u, u],
        [p, u, p, u, p, p, u, u],
        [u, -5 / 3, -5 / 3, u, -7 / 6, u, u, u],
    ])


def test_baseline_does_not_depend_on_when_a_trajectory_stopped() -> None:
    """C goes on for two more zero-reward turns: its total return is the same, so every advantage already
    there is unchanged (a per-turn-index baseline would move all of C's and the others' later turns)."""
    longer_index = torch.cat([TURN_INDEX, torch.full((4, 4), -1)], dim=1)  # (4, 12)
    longer_mask = torch.cat([LOSS_MASK, torch.zeros(4, 4, dtype=torch.long)], dim=1)
    longer_rewards = torch.cat([TURN_REWARDS, torch.zeros(4, 4)], dim=1)
    longer_index[2, 7:11] = torch.tensor([3, 3, 4, 4])  # C: o a (turn 3), o a (turn 4)
    longer_mask[2, 7:11] = torch.tensor([0, 1, 0, 1])
    before = turn_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 4)
    after = turn_advantages(longer_rewards, longer_index, longer_mask, SCORES, 4)
    torch.testing.assert_close(after[:, :8], before)
    close(after[2, [8, 10]], [-0.866025, -0.866025])  # the new turns earned nothing: G = 0, (0 - 0.75) / 0.866


def test_one_turn_each_equals_the_grpo_and_rloo_broadcast() -> None:
    g = torch.Generator().manual_seed(7)
    b, t = 12, 9
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (B, T) right-padded, one action span
    index = torch.where(mask > 0, torch.zeros_like(mask), torch.full_like(mask, -1))
    turn_reward = torch.randn(b, generator=g)
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = turn_reward
    scores = torch.randn(b, generator=g)
    group = torch.tensor([3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]) * 1000  # shuffled ids, groups of four
    grpo = grpo_advantages(scores + turn_reward, group)[:, None] * mask  # (B, T)
    torch.testing.assert_close(turn_advantages(rewards, index, mask, scores, group), grpo)
    rloo = rloo_advantages(scores + turn_reward, group)[:, None] * mask
    torch.testing.assert_close(turn_rloo_advantages(rewards, index, mask, scores, group), rloo)


def test_singleton_group_keeps_the_return() -> None:
    a = turn_advantages(TURN_REWARDS[1:2], TURN_INDEX[1:2], LOSS_MASK[1:2], SCORES[1:2], 1)
    close(a, [[1.5, 1.5, 0, 0, 1.0, 1.0, 0, 0]])
    r = turn_rloo_advantages(TURN_REWARDS[1:2], TURN_INDEX[1:2], LOSS_MASK[1:2], SCORES[1:2], 1)
    close(r, [[1.5, 1.5, 0, 0, 1.0, 1.0, 0, 0]])


def test_bad_group_is_refused() -> None:
    with pytest.raises(ValueError, match="group size 3 must be >= 1 and divide the batch size 4"):
        turn_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 3)


def test_token_rewards_put_the_score_on_the_last_action_token() -> None:
    # B's last action token is at 5 (mask.sum() - 1 = 3 would be an observation); D's at 4.
    close(last_valid_index(LOSS_MASK), [2, 5, 5, 4])
    assert last_valid_index(torch.zeros(1, 3)).tolist() == [0]
    r = token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), LOSS_MASK, TURN_REWARDS)
    close(r, [
        [0, 0, 1.0, 0, 0, 0, 0, 0],
        [0, 0.5, 0, 0, 0, 2.0, 0, 0],
        [0, 0, 0, 0, 0, 4.0, 0, 0],  # turn 2's reward 1 and the score 3 on the same token
        [0, 0, -0.5, 0, 4.0, 0, 0, 0],
    ])
    # No valid token: no reward anywhere.
    close(token_rewards(torch.tensor([5.0]), torch.zeros(1, 3)), [[0.0, 0.0, 0.0]])


def test_nothing_is_trained_through() -> None:
    scores = SCORES.clone().requires_grad_(True)
    rewards = TURN_REWARDS.clone().requires_grad_(True)
    assert not turn_advantages(rewards, TURN_INDEX, LOSS_MASK, scores, 4).requires_grad
    assert not turn_rloo_advantages(rewards, TURN_INDEX, LOSS_MASK, scores, 4).requires_grad
    assert not token_rewards(scores, LOSS_MASK, rewards).requires_grad


def test_a_group_with_equal_total_returns_is_centred_not_blown_up() -> None:
    """Four games lost the same way (three misses at -0.1, score 0): every total is -0.3, std 0. Turn k's
    return is -0.3 + 0.1 k, so against b = -0.3 the turns get 0, 0.1, 0.2 (centred only): dividing by
    std + eps = 1e-6 would give 1e5 and 2e5."""
    index = torch.tensor([[0, 0, 1, 1, 2, 2]]).repeat(4, 1)
    mask = torch.tensor([[1, 0, 1, 0, 1, 0]]).repeat(4, 1)
    rewards = torch.tensor([[-0.1, 0, -0.1, 0, -0.1, 0]]).repeat(4, 1)
    a = turn_advantages(rewards, index, mask, torch.zeros(4), 4)
    close(a, [[0.0, 0, 0.1, 0, 0.2, 0]] * 4)
    # One game scored 0.4 more: totals [-0.3, -0.3, -0.3, 0.1], mean -0.2, unbiased std sqrt(0.12 / 3) = 0.2.
    # Row 0: G = [-0.3, -0.2, -0.1] -> [-0.5, 0, 0.5]; row 3: G = [0.1, 0.2, 0.3] -> [1.5, 2, 2.5].
    b = turn_advantages(rewards, index, mask, torch.tensor([0.0, 0.0, 0.0, 0.4]), 4, eps=0.0)
    close(b[[0, 3]][:, [0, 2, 4]], [[-0.5, 0.0, 0.5], [1.5, 2.0, 2.5]])


def test_pads_read_as_turn_0_change_nothing() -> None:
    """Batch.concat pads turn_index with 0 when it merges ranks' rollouts of different widths: a pad has
    loss_mask 0 and no reward, so it still counts for nothing."""
    zero_pads = torch.where(TURN_INDEX < 0, torch.zeros_like(TURN_INDEX), TURN_INDEX)
    torch.testing.assert_close(turn_advantages(TURN_REWARDS, zero_pads, LOSS_MASK, SCORES, 4),
                               turn_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 4))
    torch.testing.assert_close(turn_rloo_advantages(TURN_REWARDS, zero_pads, LOSS_MASK, SCORES, 4),
                               turn_rloo_advantages(TURN_REWARDS, TURN_INDEX, LOSS_MASK, SCORES, 4))
