"""Tests for flowrl.engines.generation and flowrl.engines.forward: layout, sampling rules, KV-cache correctness."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import flowrl.engines.generation as gen_mod
from flowrl.engines.forward import (
    forward_entropy,
    forward_logprobs,
    forward_logprobs_entropy,
    forward_values,
    positions_from_mask,
)
from flowrl.engines.generation import GenOutput, generate
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PAD, EOS = TOK.pad_id, TOK.eos_id
TINY = {"layers": 2, "dim": 32, "heads": 2}
PROMPTS = [TOK.encode(s) for s in ["hello world", "hi", "a somewhat longer prompt", "xyz"]]


def _policy(family: str = "gpt2", seed: int = 0) -> Any:
    # Any: HF attribute access (config, get_output_embeddings) is invisible to mypy through nn.Module.
    return build_model(ModelSpec(f"tiny:{family}", TINY), seed=seed).module


@contextmanager
def _eos_bias(module: Any, bias: float) -> Iterator[None]:
    """Shift the EOS logit so random tiny models actually stop (or never stop, for a negative bias)."""

    def hook(_mod: nn.Module, _inp: Any, out: Tensor) -> Tensor:
        out = out.clone()
        out[..., EOS] += bias
        return out

    handle = module.get_output_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class _EosAfterMultiple(nn.Module):
    """Wraps an LM: EOS wins right after any input token divisible by `every` (deterministic varied lengths)."""

    def __init__(self, lm: nn.Module, every: int) -> None:
        super().__init__()
        self.module = lm  # the name `cache_kw` looks through, as for DeepSpeed's wrapper
        self.config = lm.config
        self.every = every

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
        out = self.module(input_ids=input_ids, **kwargs)
        logits = out.logits  # (B, k, V): aligned with the last k inputs
        trigger = input_ids[:, -logits.shape[1] :] % self.every == 0
        logits[..., EOS] += trigger.to(logits.dtype) * 100.0
        return out


class _FixedLogits(nn.Module):
    """A 'model' whose next-token distribution never changes (for checking the sampler's statistics)."""

    row: Tensor

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.register_buffer("row", logits)

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
        return SimpleNamespace(logits=self.row.expand(input_ids.shape[0], input_ids.shape[1], -1))


def _uncached_greedy(module: nn.Module, prompt: list[int], max_tokens: int, min_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for step in range(max_tokens):
            logits = module(input_ids=ids).logits[0, -1].clone()
            if step < min_tokens:
                logits[EOS] = float("-inf")
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == EOS:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def _rows(out: GenOutput) -> list[list[int]]:
    return [out.response_ids[i, : int(out.response_lens[i])].tolist() for i in range(out.response_ids.shape[0])]


def test_layout_padding_and_masks() -> None:
    module = _policy()
    with _eos_bias(module, 4.0):
        out = generate(module, TOK, PROMPTS, n=3, max_tokens=12, generator=torch.Generator().manual_seed(0))
    rows, width = 12, max(len(p) for p in PROMPTS)
    assert out.prompt_ids.shape == out.prompt_mask.shape == (rows, width)
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for i in range(rows):
        prompt = PROMPTS[i // 3]
        pad = width - len(prompt)
        assert out.prompt_ids[i, pad:].tolist() == prompt
        assert out.prompt_ids[i, :pad].eq(PAD).all() and out.prompt_mask[i, :pad].eq(0).all()
        assert out.prompt_mask[i, pad:].eq(1).all()
    length = out.response_ids.shape[1]
    assert out.response_mask.shape == out.logprobs.shape == (rows, length)
    assert length == int(out.response_lens.max()) <= 12
    ended = 0
    for i in range(rows):
        n_i = int(out.response_lens[i])
        assert out.response_mask[i, :n_i].eq(1).all() and out.response_mask[i, n_i:].eq(0).all()
        assert out.response_ids[i, n_i:].eq(PAD).all()
        assert out.logprobs[i, n_i:].eq(0).all() and out.logprobs[i, :n_i].le(0).all()
        assert EOS not in out.response_ids[i, : n_i - 1].tolist()
        if n_i < 12:
            assert int(out.response_ids[i, n_i - 1]) == EOS
            ended += 1
    assert 0 < ended < rows  # the bias makes some (not all) rows stop early
    assert isinstance(TOK.decode(out.response_ids[0].tolist()), str)


def test_min_tokens_bans_early_eos() -> None:
    module = _policy("llama")
    with _eos_bias(module, 10.0):  # EOS is ~all the mass once allowed
        out = generate(module, TOK, PROMPTS, n=2, max_tokens=10, min_tokens=4,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert out.response_lens.ge(5).all()
    assert not out.response_ids[:, :4].eq(EOS).any()
    assert out.response_ids[:, 4].eq(EOS).all()


def test_max_tokens_caps_length() -> None:
    module = _policy()
    with _eos_bias(module, -100.0):
        out = generate(module, TOK, PROMPTS, n=2, max_tokens=7, generator=torch.Generator().manual_seed(0))
    assert out.response_ids.shape == (8, 7)
    assert out.response_lens.eq(7).all() and out.response_mask.eq(1).all()


def _count_compactions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record each time generate drops finished rows from the KV cache (one entry per layer)."""
    calls: list[int] = []
    original = gen_mod._BufferedLayer.batch_select_indices

    def spy(self: Any, indices: Tensor) -> None:
        calls.append(len(indices))
        original(self, indices)

    monkeypatch.setattr(gen_mod._BufferedLayer, "batch_select_indices", spy)
    return calls


@pytest.mark.parametrize(("family", "seed", "every"), [("gpt2", 1, 5), ("llama", 3, 7)])
def test_greedy_cached_left_padded_equals_uncached_single_prompt(
    family: str, seed: int, every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Different prompt lengths -> left padding; EOS after tokens divisible by `every` -> ragged stops, which
    # also exercises dropping finished rows from the cache mid-decode.
    compactions = _count_compactions(monkeypatch)
    module = _EosAfterMultiple(_policy(family, seed=seed), every=every)
    prompts = [*PROMPTS, TOK.encode("q"), TOK.encode("another prompt of medium size")]
    out = generate(module, TOK, prompts, n=2, max_tokens=24, min_tokens=2, temperature=0.0)
    expected = [_uncached_greedy(module, p, 24, 2) for p in prompts]
    got = _rows(out)
    assert got[0::2] == expected and got[1::2] == expected
    lens = {len(e) for e in expected}
    assert len(lens) > 1 and 24 in lens  # genuinely ragged, with at least one row running to the cap
    assert compactions


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_share_prefix_on_and_off_give_identical_samples(family: str) -> None:
    module = _policy(family)
    kwargs: dict[str, Any] = dict(n=4, max_tokens=16, min_tokens=1, temperature=0.8, top_p=0.9)
    with _eos_bias(module, 3.0):
        shared = generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(5), **kwargs)
        plain = generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(5), share_prefix=False,
                         **kwargs)  # fmt: skip
    assert torch.equal(shared.response_ids, plain.response_ids)
    assert torch.equal(shared.response_mask, plain.response_mask)
    assert torch.equal(shared.prompt_ids, plain.prompt_ids)
    assert torch.allclose(shared.logprobs, plain.logprobs, atol=1e-5)


def test_same_seed_same_output_different_seed_different_output() -> None:
    module = _policy()

    def run(seed: int) -> GenOutput:
        return generate(module, TOK, PROMPTS, n=2, max_tokens=12, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_logprobs_match_sampling_logprobs(
    family: str, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    compactions = _count_compactions(monkeypatch)
    module = _policy(family)
    with _eos_bias(module, 4.0):
        out = generate(module, TOK, PROMPTS, n=3, max_tokens=14, temperature=temperature,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert compactions  # ragged: finished rows were dropped from the cache before others were scored
        args = (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
        full = forward_logprobs(module, *args, temperature=temperature)
        chunked = forward_logprobs(module, *args, temperature=temperature, micro_batch=5)
    assert full.shape == out.logprobs.shape
    assert full[out.response_mask == 0].eq(0).all()
    assert torch.allclose(full, out.logprobs, atol=1e-5)
    assert torch.allclose(chunked, full, atol=1e-6)


def test_greedy_logprobs_are_untempered() -> None:
    module = _policy()
    out = generate(module, TOK, PROMPTS, max_tokens=6, temperature=0.0)
    scored = forward_logprobs(module, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                              temperature=0.0)  # fmt: skip
    assert torch.allclose(scored, out.logprobs, atol=1e-5)


def test_entropy_and_joint_forward() -> None:
    module = _policy()
    out = generate(module, TOK, PROMPTS, n=2, max_tokens=8, generator=torch.Generator().manual_seed(0))
    args = (module, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    entropy = forward_entropy(*args)
    logprobs, entropy2 = forward_logprobs_entropy(*args)
    assert torch.allclose(entropy, entropy2) and torch.allclose(logprobs, forward_logprobs(*args))
    live = out.response_mask.bool()
    # A near-uniform random model: entropy close to log(V), never above it.
    assert entropy[live].gt(0).all() and entropy[live].le(torch.log(torch.tensor(259.0)) + 1e-4).all()


def test_with_grad_controls_autograd() -> None:
    module = _policy()
    out = generate(module, TOK, PROMPTS[:2], max_tokens=5, generator=torch.Generator().manual_seed(0))
    args = (module, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    assert not forward_logprobs(*args).requires_grad
    lp = forward_logprobs(*args, with_grad=True, micro_batch=1)
    lp.sum().backward()
    assert module.get_input_embeddings().weight.grad is not None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_values_reads_state_before_each_token(family: str) -> None:
    critic: Any = build_model(ModelSpec(f"tiny:{family}", TINY, role="critic"), seed=0).module
    policy = _policy(family)
    with _eos_bias(policy, 3.0):
        out = generate(policy, TOK, PROMPTS, n=2, max_tokens=10, generator=torch.Generator().manual_seed(0))
    args = (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    values = forward_values(critic, *args)
    assert values.shape == out.response_ids.shape
    assert values[out.response_mask == 0].eq(0).all()
    assert torch.allclose(forward_values(critic, *args, micro_batch=3), values, atol=1e-6)
    # Row 0 alone, unpadded: value t sits at the hidden state of the token before response token t.
    width, n0 = out.prompt_ids.shape[1], int(out.response_lens[0])
    prompt = out.prompt_ids[0][out.prompt_mask[0].bool()]
    seq = torch.cat([prompt, out.response_ids[0, :n0]])[None]
    with torch.no_grad():
        alone = critic(input_ids=seq)[0]
    start = len(prompt) - 1
    assert torch.allclose(values[0, :n0], alone[start : start + n0], atol=1e-5)
    assert width >= len(prompt)


def test_sampler_statistics_and_top_p() -> None:
    probs = torch.tensor([0.6, 0.25, 0.15])
    row = torch.full((259,), float("-inf"))
    row[:3] = probs.log()
    module = _FixedLogits(row)
    gen = torch.Generator().manual_seed(0)
    draws = 4000
    out = generate(module, TOK, [[1]], n=draws, max_tokens=1, generator=gen)
    freq = torch.bincount(out.response_ids[:, 0], minlength=3)[:3].float() / draws
    assert torch.allclose(freq, probs, atol=0.03)
    # top_p=0.8 keeps {0, 1} (mass before token 2 is 0.85 >= 0.8), renormalised.
    out = generate(module, TOK, [[1]], n=draws, max_tokens=1, top_p=0.8, generator=gen)
    freq = torch.bincount(out.response_ids[:, 0], minlength=3)[:3].float() / draws
    assert freq[2] == 0 and abs(float(freq[0]) - 0.6 / 0.85) < 0.03
    # A vanishing top_p is greedy.
    out = generate(module, TOK, [[1]], n=50, max_tokens=1, top_p=1e-6, generator=gen)
    assert out.response_ids.eq(0).all()


def test_positions_skip_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompts=[]), "at least one prompt"),
        (dict(prompts=[[1], []]), "empty prompt"),
        (dict(n=0), "n must be"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=9), "min_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    call: dict[str, Any] = dict(prompts=[[1, 2]], n=1, max_tokens=4)
    call.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(_FixedLogits(torch.zeros(259)), TOK, call.pop("prompts"), **call)
