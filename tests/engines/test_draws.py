"""Tests for the decode loop's cheap sampling (flowrl.engines.sampling, issue 34 item 9): `Draws` hands out the
same uniforms as hashing each step, and the flat search small vocabularies use takes the tokens of the two-level
one; so `generate` keeps its samples (the split tests in test_sampling.py hold them across batches)."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines import sampling
from flowrl.engines.generation import generate
from flowrl.engines.sampling import Draws, Sampler, inverse_cdf, row_keys, uniforms
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer


def test_draws_are_the_hashed_uniforms_across_blocks_and_dropped_rows() -> None:
    keys = row_keys(9, range(5), 3)  # (15, 2)
    start = torch.arange(15) * 7  # rows at different steps (a batch resumed from several tails)
    draws = Draws(keys, start, block=4)
    for t in range(10):  # crosses two block boundaries
        assert torch.equal(draws.at(t), uniforms(keys, start + t))
    keep = torch.tensor([14, 3, 0, 8])
    draws.select(keep)  # mid-block: the table's rows go with their keys
    for t in range(10, 13):
        assert torch.equal(draws.at(t), uniforms(keys[keep], start[keep] + t))
    assert torch.equal(draws.at(2), uniforms(keys[keep], start[keep] + 2))  # back in time: hashed again


def test_a_two_dimensional_step_grid_gives_each_rows_draws() -> None:
    keys = row_keys(3, range(4), 2)
    grid = torch.arange(8)[None, :] + torch.tensor([0, 5, 9, 2, 2, 7, 1, 0])[:, None]  # (8, 8)
    table = uniforms(keys, grid)
    assert table.shape == (8, 8)
    for j in range(8):
        assert torch.equal(table[:, j], uniforms(keys, grid[:, j]))


@pytest.mark.parametrize("vocab", [2, 17, 259, 512])
def test_the_flat_search_takes_the_two_level_searchs_tokens(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(256, vocab, generator=gen) * 3, dim=-1)
    probs[:, 1::4] = 0.0  # holes: never taken by either
    u = torch.rand(256, generator=gen, dtype=torch.float64)
    flat = inverse_cdf(probs, u)
    monkeypatch.setattr(sampling, "FLAT_VOCAB", 0)
    two_level = inverse_cdf(probs, u)
    assert torch.equal(flat, two_level)
    assert bool((probs.gather(1, flat[:, None]) > 0).all())


def test_the_flat_search_never_runs_past_the_vocabulary() -> None:
    probs = torch.zeros(3, 5)
    probs[1, 2] = 1.0
    probs[2, 4] = 1.0
    u = torch.tensor([0.5, 1 - 2.0**-33, 1 - 2.0**-33], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [4, 2, 4]  # an all-zero row (no mass) stays in range


def test_sample_with_drawn_uniforms_is_call_with_keys() -> None:
    logits = torch.randn(12, 259, generator=torch.Generator().manual_seed(1))
    keys = row_keys(4, range(4), 3)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (0.0, 1.0)):
        sampler = Sampler(temperature, top_p, 2, eos=2)
        for step in (0, 5):
            want = sampler(logits, step, keys)
            got = sampler.sample(logits, step, uniforms(keys, step) if temperature > 0 else None)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_generate_samples_what_the_per_step_hash_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate` with its block-hashed draws and its bookkeeping skipped while no row can finish, against the
    same loop hashing every step (Draws with one-step blocks)."""
    tok = ByteTokenizer()
    module = build_model(ModelSpec("tiny:gpt2", {"layers": 2, "dim": 32, "heads": 2}), seed=5).module
    prompts = [tok.encode(s) for s in ("12+30=", "7*8=", "a longer prompt", "x")]
    kw = dict(n=3, max_tokens=40, min_tokens=3, temperature=0.9, top_p=0.95, seed=11)
    fast = generate(module, tok, prompts, **kw)  # type: ignore[arg-type]

    class OneStep(Draws):
        def __init__(self, keys: torch.Tensor, start: torch.Tensor | int = 0, block: int = 32) -> None:
            super().__init__(keys, start, block=1)

    monkeypatch.setattr("flowrl.engines.generation.Draws", OneStep)
    slow = generate(module, tok, prompts, **kw)  # type: ignore[arg-type]
    assert torch.equal(fast.response_ids, slow.response_ids)
    assert torch.equal(fast.response_mask, slow.response_mask)
    assert torch.equal(fast.logprobs, slow.logprobs)
    assert bool((fast.response_lens >= 3).all())
