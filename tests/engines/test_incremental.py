"""IncrementalScorer: scores of samples fed as they grow equal one forward over the finished samples."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines.forward import forward_logprobs, forward_values
from flowrl.engines.incremental import IncrementalScorer
from flowrl.models.build import ModelSpec, build_model

CONFIG = {"layers": 2, "dim": 64, "heads": 4, "charset": "0123456789+="}


def _rollout(rows: int = 6, prompt: int = 7, width: int = 20) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 12, (rows, prompt), generator=gen)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    for i in range(rows):  # left padding of different widths
        prompt_mask[i, : i % 3] = 0
        prompt_ids[i, : i % 3] = 0
    lengths = torch.tensor([3, width, 11, width, 1, 15])[:rows]
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    response_ids = torch.randint(3, 12, (rows, width), generator=gen) * response_mask
    return prompt_ids, prompt_mask, response_ids, response_mask, lengths


def _grow(scorer: IncrementalScorer, rollout: tuple[torch.Tensor, ...], schedule: list[tuple[int, list[int]]]
          ) -> torch.Tensor:
    """Feed `schedule`'s (tokens decoded so far, rows shown) in order; a row is final once it is whole."""
    prompt_ids, prompt_mask, response_ids, _, lengths = rollout
    out = torch.zeros(response_ids.shape)
    for t, rows in schedule:
        idx = torch.tensor(rows)
        now = torch.minimum(lengths[idx], torch.tensor(t))
        mask = (torch.arange(response_ids.shape[1])[None, :] < now[:, None]).long()
        final = now >= lengths[idx]
        got = scorer.feed(idx + 100, prompt_ids[idx], prompt_mask[idx], response_ids[idx] * mask, mask, final)
        for k, row in enumerate(idx[final].tolist()):
            out[row] = got[k]
    return out


# Rows start in two cohorts (0-3 first, 4-5 later), skip feeds, and finish at different times; row 4 is final
# the first time it is seen (it never had a state).
SCHEDULE = [(2, [0, 1, 2, 3]), (5, [1, 2, 3]), (5, [4, 5]), (9, [0, 1, 3, 5]), (14, [1, 2, 3, 5]), (20, [1, 3, 5])]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("role", ["policy", "critic"])
def test_growing_samples_score_what_one_forward_scores(family: str, role: str) -> None:
    module = build_model(ModelSpec(source=f"tiny:{family}", config=CONFIG, role=role), seed=3).module
    rollout = _rollout()
    if role == "policy":
        full = forward_logprobs(module, *rollout[:4], temperature=0.7)
        scorer = IncrementalScorer(module, "logprobs", temperature=0.7)
    else:
        full = forward_values(module, *rollout[:4])
        scorer = IncrementalScorer(module, "values")
    got = _grow(scorer, rollout, SCHEDULE)
    assert (full != 0).sum() == rollout[3].sum()  # sanity: scores exactly at real tokens
    assert torch.allclose(got, full, atol=1e-5, rtol=0)
    assert scorer.held == 0 and scorer.cohorts == []  # every sample finished: no state left


def test_a_cohort_keeps_growing_after_its_longest_sample_left() -> None:
    """Rows 1 and 5 share a cohort; row 5 grows to 15 tokens and finishes (its state dropped) while row 1 is at
    9, so the cohort's scores are wider than any row left; row 1 then grows to 12, still narrower, and on."""
    module = build_model(ModelSpec(source="tiny:gpt2", config=CONFIG, role="policy"), seed=3).module
    rollout = _rollout()
    full = forward_logprobs(module, *rollout[:4])
    got = _grow(IncrementalScorer(module, "logprobs"), rollout, [(9, [1, 5]), (15, [5]), (12, [1]), (20, [1])])
    assert torch.allclose(got[[1, 5]], full[[1, 5]], atol=1e-5, rtol=0)


def test_a_feed_returns_only_the_final_rows_in_their_order() -> None:
    module = build_model(ModelSpec(source="tiny:gpt2", config=CONFIG, role="policy"), seed=3).module
    prompt_ids, prompt_mask, response_ids, response_mask, _ = _rollout()
    scorer = IncrementalScorer(module, "logprobs")
    final = torch.tensor([False, True, False, True, True, False])
    got = scorer.feed(torch.arange(6), prompt_ids, prompt_mask, response_ids, response_mask, final)
    full = forward_logprobs(module, prompt_ids, prompt_mask, response_ids, response_mask)
    assert got.shape == (3, response_ids.shape[1])
    assert torch.allclose(got, full[final], atol=1e-5, rtol=0)
    assert scorer.held == 3


def test_unknown_kind_is_refused() -> None:
    module = build_model(ModelSpec(source="tiny:gpt2", config=CONFIG, role="policy"), seed=3).module
    with pytest.raises(ValueError, match="unknown kind 'entropy'"):
        IncrementalScorer(module, "entropy")
