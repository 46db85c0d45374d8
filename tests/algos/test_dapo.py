"""DAPO's group filter and soft overlong punishment (flowrl.algos.dapo) on worked values.

The punishment's values are worked out by hand from the paper's piecewise definition (Yu et al. 2025, arXiv
2503.14476, eq. 13: 0 up to L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache within the buffer, -1 past L_max)
and checked against verl's formula (verl/workers/reward_manager/dapo.py: `min(-exceed_len / overlong_buffer_len *
overlong_penalty_factor, 0)` with `exceed_len = valid_response_length - (max_resp_len - overlong_buffer_len)`). The
filter's against verl's rule (recipe/dapo/dapo_ray_trainer.py: a prompt's group is kept when `np.std` of its
metric is above 0 or it holds one sample)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.algos.dapo import KEEP, all_equal_groups, kept_groups, overlong_penalty
from flowrl.ir.signatures import KEEP_GROUPS


def test_the_paper_s_buffer_worked_by_hand() -> None:
    # L_max = 20480 = 16384 + 4096 (the paper's), P = 1
    lengths = torch.tensor([100, 16384, 16385, 17408, 18432, 19456, 20480])
    want = [0.0, 0.0, -1 / 4096, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 20480, 4096, 1.0).tolist() == pytest.approx(want)


def test_a_small_buffer_and_factor_worked_by_hand() -> None:
    # L_max = 20, L = 4, P = 0.5: expected length 16; each token past it costs 0.5 / 4 = 0.125
    lengths = torch.tensor([1, 15, 16, 17, 18, 19, 20])
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert overlong_penalty(lengths, 20, 0, 0.5).tolist() == [0.0] * 7  # no buffer: off


def _verl(length: int, max_resp_len: int, buffer: int, factor: float) -> float:
    exceed_len = length - (max_resp_len - buffer)
    return min(-exceed_len / buffer * factor, 0)


@pytest.mark.parametrize(("max_tokens", "buffer", "factor"), [(20, 4, 1.0), (64, 16, 0.5), (7, 6, 2.0), (256, 1, 1.0)])
def test_every_length_a_generation_can_give_is_punished_as_verl_does(max_tokens: int, buffer: int,
                                                                     factor: float) -> None:
    lengths = torch.arange(1, max_tokens + 1)
    got = overlong_penalty(lengths, max_tokens, buffer, factor).tolist()
    assert got == pytest.approx([_verl(n, max_tokens, buffer, factor) for n in range(1, max_tokens + 1)], abs=1e-6)
    assert overlong_penalty(torch.tensor([max_tokens + 5]), max_tokens, buffer, factor).tolist() == [-factor]


def test_the_filter_keeps_mixed_groups_and_groups_of_one_in_order() -> None:
    #                    group 7: all 1     group 2: mixed      group 5: all 0      group 0: one sample
    returns = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([7, 7, 7, 2, 2, 5, 5, 5, 5, 0])
    ids, equal, sizes = all_equal_groups(returns, groups)
    assert (ids.tolist(), equal.tolist(), sizes.tolist()) == ([7, 2, 5, 0], [True, False, True, True], [3, 2, 4, 1])
    kept, dropped = kept_groups(returns, groups, "mixed")
    assert (kept.tolist(), dropped) == ([2, 0], 2)
    kept, dropped = kept_groups(returns, groups, "all")
    assert (kept.tolist(), dropped) == ([7, 2, 5, 0], 0)
    # verl's rule on the same groups keeps the same ones
    verl = [g for g in (7, 2, 5, 0) if np.std(returns[groups == g].numpy()) > 0 or int((groups == g).sum()) == 1]
    assert verl == [2, 0]


def test_equal_floats_are_equal_where_numpy_s_std_is_not_zero() -> None:
    returns = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert np.std(returns.numpy()) > 0  # a float mean of equal values: verl would keep this group
    kept, dropped = kept_groups(returns, torch.tensor([3, 3, 3]))
    assert (kept.tolist(), dropped) == ([], 1)  # its advantages are all 0: dropped here


def test_the_choices_are_the_language_s() -> None:
    assert KEEP == KEEP_GROUPS
    with pytest.raises(ValueError, match="keep = 'some'"):
        kept_groups(torch.zeros(2), torch.zeros(2, dtype=torch.long), "some")
