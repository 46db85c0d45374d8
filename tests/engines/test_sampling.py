"""Tests for flowrl.engines.sampling: per-row random streams, inverse-CDF sampling, and the property they exist
for: a batch generated whole, split in two halves run in another order, or with its tails migrated and resumed
together elsewhere, gives the same tokens."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from flowrl.engines.chunked_generation import GenChunk, Sampling, Tail, generate_stream, resume_stream
from flowrl.engines.generation import GenOutput, generate
from flowrl.engines.sampling import Sampler, inverse_cdf, mix32, request_seed, row_keys, uniforms
from flowrl.engines.vllm_engine import request_seeds
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PROMPTS = [TOK.encode(s) for s in ["12+30=", "7*8=", "a much longer prompt than the others", "x", "99-1=", "ok"]]
N = 3
KW: dict[str, Any] = dict(n=N, max_tokens=16, min_tokens=2, temperature=0.9, top_p=0.95)


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers: the reference for the tensor version."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0xD35A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def test_the_mixer_is_lowbias32_on_every_32_bit_input() -> None:
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF] + list(range(1000, 1200))
    assert mix32(torch.tensor(xs)).tolist() == [_lowbias32(x) for x in xs]
    assert _lowbias32(1) == mix32(torch.tensor([1])).item() != 1


def test_keys_depend_on_seed_prompt_slot_and_sample_only() -> None:
    keys = row_keys(5, [0, 1, 2, 3], N)  # (12, 2)
    assert keys.shape == (12, 2) and len({tuple(k) for k in keys.tolist()}) == 12
    part = row_keys(5, [3, 1], N)  # the same prompts in another batch, in another order
    assert torch.equal(part, keys.view(4, N, 2)[[3, 1]].reshape(-1, 2))
    assert not torch.equal(row_keys(6, [0, 1, 2, 3], N), keys)


def test_a_rows_uniforms_are_its_own_at_each_step() -> None:
    keys = row_keys(11, range(64), 4)  # (256, 2)
    draws = torch.stack([uniforms(keys, t) for t in range(100)])  # (100, 256)
    assert draws.dtype == torch.float64 and 0.0 < float(draws.min()) and float(draws.max()) < 1.0
    assert torch.equal(uniforms(keys[[7, 3]], 9), draws[9, [7, 3]])  # a row's draw, whatever rows are around
    assert torch.equal(uniforms(keys[:2], torch.tensor([4, 80])), torch.stack([draws[4, 0], draws[80, 1]]))
    # 25,600 fixed draws: their mean and variance are those of U(0, 1) (1/2, 1/12) to sampling error (~0.002)
    assert abs(float(draws.mean()) - 0.5) < 0.01 and abs(float(draws.var()) - 1 / 12) < 0.005
    assert len(set(draws.flatten().tolist())) > 25_500


@pytest.mark.parametrize("vocab", [1, 5, 260, 1000, 32_003])
def test_inverse_cdf_takes_the_token_where_u_falls(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(32, vocab, generator=gen) * 3, dim=-1)
    probs[:, ::3] = 0.0 if vocab > 1 else probs[:, ::3]  # holes: never taken
    u = torch.rand(32, generator=gen, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    got = inverse_cdf(probs, u)
    assert torch.equal(got, want)
    assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_inverse_cdf_hits_each_token_in_proportion_to_its_mass() -> None:
    """u on an even grid of M points: each token is taken p * M times, to one point."""
    probs = torch.tensor([0.5, 0.0, 0.125, 0.25, 0.0, 0.125])
    grid = (torch.arange(4096, dtype=torch.float64) + 0.5) / 4096
    counts = torch.bincount(inverse_cdf(probs.expand(4096, -1), grid), minlength=6)
    assert counts.tolist() == [2048, 0, 512, 1024, 0, 512]


def test_a_rows_token_does_not_depend_on_the_other_rows() -> None:
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(0))
    keys = row_keys(3, range(4), 3)
    sampler = Sampler(0.8, 0.9, 1, eos=2)
    tok, lp = sampler(logits, 0, keys)
    rows = [9, 2, 5]
    sub_tok, sub_lp = sampler(logits[rows], torch.tensor([0, 0, 0]), keys[rows])
    assert torch.equal(sub_tok, tok[rows]) and torch.equal(sub_lp, lp[rows])
    assert not bool((tok == 2).any())  # EOS is banned before min_tokens


# -- generation: whole, split, migrated ----------------------------------------------------------------------


@contextmanager
def _eos_bias(module: Any, bias: float) -> Iterator[None]:
    """Shift the EOS logit so a random tiny model stops after varied lengths."""

    def hook(_mod: nn.Module, _inp: Any, out: Tensor) -> Tensor:
        out = out.clone()
        out[..., TOK.eos_id] += bias
        return out

    handle = module.get_output_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _policy(family: str) -> Any:
    return build_model(ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}), seed=3).module


def _rows(out: GenOutput, rows: Sequence[int]) -> tuple[list[list[int]], Tensor]:
    """Some rows' responses (their tokens, unpadded) and log-probs, for comparing outputs of different widths."""
    lens = out.response_lens.tolist()
    return [out.response_ids[r, : lens[r]].tolist() for r in rows], out.logprobs[list(rows)]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_batch_split_in_two_halves_in_another_order_samples_alike(family: str) -> None:
    module = _policy(family)
    with _eos_bias(module, 4.0):
        whole = generate(module, TOK, PROMPTS, seed=7, **KW)
        # the second half first, each half's prompts reversed, each knowing its prompts' slots in the whole
        second = generate(module, TOK, PROMPTS[5:2:-1], seed=7, prompt_slots=[5, 4, 3], **KW)
        first = generate(module, TOK, PROMPTS[2::-1], seed=7, prompt_slots=[2, 1, 0], share_prefix=False, **KW)
    lens = whole.response_lens
    assert len(set(lens.tolist())) > 2  # varied lengths: rows finished and were dropped at different steps
    for part, slots in ((second, [5, 4, 3]), (first, [2, 1, 0])):
        rows = [s * N + j for s in slots for j in range(N)]
        got_ids, got_lp = _rows(part, range(len(rows)))
        want_ids, want_lp = _rows(whole, rows)
        assert got_ids == want_ids
        width = min(got_lp.shape[1], want_lp.shape[1])
        assert (got_lp[:, :width] - want_lp[:, :width]).abs().max() <= 1e-5  # other padding, other rounding
    other_seed = generate(module, TOK, PROMPTS, seed=8, **KW)
    assert not torch.equal(other_seed.response_ids[:, :4], whole.response_ids[:, :4])


class _ExportAfter:
    """A stream control that asks for the tail after `steps` decode steps."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen = steps, 0

    def progress(self, remaining: int) -> None:
        self.seen += 1

    def should_export(self) -> bool:
        return self.seen >= self.steps


def test_tails_migrated_from_two_sources_and_resumed_together_sample_alike() -> None:
    """Two sources (the halves, as two instances hold them) stop after 3 and 5 steps; one sink resumes both
    tails, the later source's first, in one batch whose rows are at different steps."""
    module = _policy("gpt2")
    sampling = Sampling(KW["max_tokens"], KW["min_tokens"], KW["temperature"], KW["top_p"])
    rows, width = len(PROMPTS) * N, KW["max_tokens"]
    ids = torch.full((rows, width), TOK.pad_id)
    lp = torch.zeros(rows, width)

    def place(item: GenChunk | Tail) -> None:
        assert isinstance(item, GenChunk)
        w = item.response_ids.shape[1]
        ids[item.samples, :w], lp[item.samples, :w] = item.response_ids, item.logprobs

    with _eos_bias(module, 4.0):
        whole = generate(module, TOK, PROMPTS, seed=7, **KW)
        tails: list[Tail] = []
        for half, first, after in ((PROMPTS[:3], 0, 3), (PROMPTS[3:], 3, 5)):
            for item in generate_stream(module, TOK, half, n=N, sampling=sampling, chunk=2, seed=7,
                                        prompt_slots=range(first, first + 3), first_sample=first * N,
                                        control=_ExportAfter(after)):
                tails.append(item) if isinstance(item, Tail) else place(item)
        assert len(tails) == 2 and all(t.samples.numel() > 0 for t in tails)
        assert tails[0].steps.unique().tolist() != tails[1].steps.unique().tolist()
        for item in resume_stream(module, TOK, tails[::-1], sampling=sampling, chunk=2):
            place(item)
    w = whole.response_ids.shape[1]
    assert torch.equal(ids[:, :w], whole.response_ids) and not bool(ids[:, w:].ne(TOK.pad_id).any())
    assert (lp[:, :w] - whole.logprobs).abs().max() <= 1e-5


def test_vllm_request_seeds_follow_the_prompts_slot() -> None:
    """vLLM is not run here (it needs CUDA); its per-request seeds come from (seed, slot) as the torch streams."""
    seeds = request_seeds(7, [0, 1, 2, 3], 4)
    assert request_seeds(7, [3, 1], 2) == [seeds[3], seeds[1]]
    assert seeds == [request_seed(7, s) for s in range(4)] and len(set(seeds)) == 4
    assert all(0 <= s < 2**31 for s in seeds if s is not None)
    assert request_seeds(None, None, 2) == [None, None]
