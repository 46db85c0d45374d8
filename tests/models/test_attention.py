"""flowrl.models.attention: the one-query and shared-prefix (cascade) paths equal full attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

import flowrl.engines.generation as gen_mod
import flowrl.models.attention as attn
from flowrl.engines.generation import generate
from flowrl.models.attention import SharedPrefix, attention
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer


def _reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, groups: int) -> Tensor:
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)  # (N, 1, heads, d)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("float_mask", [False, True])
def test_cascade_equals_full_attention(groups: int, drop: bool, float_mask: bool) -> None:
    """4 prompts x 3 samples; prefix of 7 slots (left padding masked), 5 own tokens; GQA; rows dropped."""
    gen = torch.Generator().manual_seed(0)
    units, n, heads, d, plen, own = 4, 3, 4, 8, 7, 5
    kv_heads = heads // groups
    pk, pv = (torch.randn(units, kv_heads, plen, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(units * n, kv_heads, own, d, generator=gen) for _ in range(2))
    q = torch.randn(units * n, heads, 1, d, generator=gen)
    pad = torch.tensor([0, 2, 0, 5]).repeat_interleave(n)  # left padding of each row's prompt
    mask = (torch.arange(plen + own)[None, :] >= pad[:, None])[:, None, None, :]  # (N, 1, 1, P + S)
    prefix = SharedPrefix.grouped(pk, pv, n)
    full_k = torch.cat([pk.repeat_interleave(n, dim=0), k], dim=2)
    full_v = torch.cat([pv.repeat_interleave(n, dim=0), v], dim=2)
    if drop:  # finished rows leave: prompt 1 keeps one sample, prompt 2 none
        rows = torch.tensor([0, 1, 2, 4, 9, 11])
        prefix = prefix.select(rows)
        q, k, v, mask, full_k, full_v = (x[rows] for x in (q, k, v, mask, full_k, full_v))
    expected = _reference(q, full_k, full_v, mask, groups)
    key = k.clone()
    key.flowrl_prefix = prefix  # type: ignore[attr-defined]
    module = SimpleNamespace(num_key_value_groups=groups, training=False)
    given = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min) if float_mask else mask
    got, _ = attention(module, q, key, v, given)  # type: ignore[arg-type]
    assert (got - expected).abs().max() <= 1e-5
    plain, _ = attention(module, q, full_k, full_v, given)  # type: ignore[arg-type]  # the one-query path
    assert (plain - expected).abs().max() <= 1e-5


def test_several_queries_over_a_shared_prefix_see_the_whole_cache() -> None:
    """Not a decode step (two new tokens per row): the prefix is materialised and HF's SDPA runs."""
    gen = torch.Generator().manual_seed(1)
    pk, pv = (torch.randn(2, 2, 5, 4, generator=gen) for _ in range(2))
    k, v, q = (torch.randn(6, 2, 3, 4, generator=gen) for _ in range(3))
    q = q[:, :, 1:]  # (6, 2, 2, 4): the last two of the three own tokens are queries
    mask = torch.ones(6, 1, 2, 8, dtype=torch.bool)
    mask[:, :, 0, -1] = False  # causal among the two new tokens
    key = k.clone()
    key.flowrl_prefix = SharedPrefix.grouped(pk, pv, 3)  # type: ignore[attr-defined]
    module = SimpleNamespace(num_key_value_groups=1, training=False, is_causal=True)
    got, _ = attention(module, q, key, v, mask)  # type: ignore[arg-type]
    full_k = torch.cat([pk.repeat_interleave(3, dim=0), k], dim=2)
    full_v = torch.cat([pv.repeat_interleave(3, dim=0), v], dim=2)
    scores = (q @ full_k.transpose(-1, -2)) / 2.0
    expected = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ full_v).transpose(1, 2)
    assert (got - expected).abs().max() <= 1e-5


def test_generation_keeps_each_prompt_once_and_samples_as_unshared(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = ByteTokenizer()
    module = build_model(ModelSpec("tiny:gpt2", {"layers": 2, "dim": 32, "heads": 2}), seed=0).module
    prompts = [tok.encode(s) for s in ["hello world", "hi", "a somewhat longer prompt"]]
    calls: list[int] = []
    cascade = attn._cascade
    monkeypatch.setattr(attn, "_cascade", lambda *a: calls.append(a[5].keys.shape[0]) or cascade(*a))
    repeats: list[int] = []
    repeat = gen_mod._BufferedLayer.batch_repeat_interleave
    monkeypatch.setattr(gen_mod._BufferedLayer, "batch_repeat_interleave",
                        lambda self, r: repeats.append(r) or repeat(self, r))
    kwargs = dict(n=4, max_tokens=10, min_tokens=10)
    shared = generate(module, tok, prompts, generator=torch.Generator().manual_seed(1), **kwargs)  # type: ignore[arg-type]
    assert repeats == [4, 4]  # both layers kept the 3 prompts once
    assert calls and set(calls) == {3}  # every decode step attended to 3 prompt rows, not 12
    plain = generate(module, tok, prompts, generator=torch.Generator().manual_seed(1), share_prefix=False,
                     **kwargs)  # type: ignore[arg-type]
    assert torch.equal(shared.response_ids, plain.response_ids)
    assert (shared.logprobs - plain.logprobs).abs().max() <= 1e-5
