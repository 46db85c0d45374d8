"""Tests for flowrl.engines.prefill: generation from prefixes computed once (here, or elsewhere and handed over)
samples what plain generation samples."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from flowrl.engines.chunked_generation import GenChunk, Sampling, Tail, generate_stream, resume_stream
from flowrl.engines.generation import GenOutput, generate
from flowrl.engines.prefill import Prefixes, compute_prefixes, match, merge
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
SYSTEM = TOK.encode("You are a careful calculator. ")
FEW_SHOT = TOK.encode("Q: 2+2? A: 4. Q: 3+5? A: 8. ")
PROMPTS = [SYSTEM + TOK.encode(q) for q in ("1+1?", "12+30?", "7?")] + \
          [FEW_SHOT + TOK.encode(q) for q in ("9+9?", "100+1?")] + [TOK.encode("no preamble here")]
KW: dict[str, Any] = dict(n=3, max_tokens=20, min_tokens=1, temperature=0.9, top_p=0.95)


def _policy(family: str) -> Any:
    return build_model(ModelSpec(f"tiny:{family}", {"layers": 2, "dim": 32, "heads": 2}), seed=1).module


def _prefixes(module: Any) -> Prefixes:
    with torch.inference_mode():
        return compute_prefixes(module, [tuple(SYSTEM), tuple(FEW_SHOT)], TOK.pad_id, torch.device("cpu"))


def _same(got: GenOutput, want: GenOutput) -> None:
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.prompt_ids, want.prompt_ids) and torch.equal(got.prompt_mask, want.prompt_mask)
    assert (got.logprobs - want.logprobs).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("share", [True, False])
def test_generation_from_prefixes_samples_what_plain_generation_does(family: str, share: bool) -> None:
    module = _policy(family)
    want = generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(4), share_prefix=share, **KW)
    pre = _prefixes(module)
    fed: list[tuple[int, ...]] = []
    hook = module.register_forward_pre_hook(lambda _m, _a, kw: fed.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    got = generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(4), share_prefix=share,
                   prefixes=pre, **KW)
    hook.remove()
    _same(got, want)
    # the prefill ran the prompts' rests only: as wide as the longest prompt without its prefix
    rests = [len(p) - len(FEW_SHOT if p[: len(FEW_SHOT)] == FEW_SHOT else SYSTEM if p[: len(SYSTEM)] == SYSTEM
                          else []) for p in PROMPTS]
    assert fed[0] == ((len(PROMPTS) if share else 3 * len(PROMPTS)), max(rests))
    assert max(rests) < max(len(p) for p in PROMPTS)
    assert int(want.response_mask.sum(1).min()) < int(want.response_mask.sum(1).max())  # ragged: rows dropped


def test_prefixes_handed_over_pickled_and_merged_sample_the_same() -> None:
    """What another process computed (pickled, as Ray moves it), two sources merged, a prefix nobody uses."""
    module = _policy("gpt2")
    both = _prefixes(module)
    with torch.inference_mode():
        unused = compute_prefixes(module, [tuple(TOK.encode("unused opening"))], TOK.pad_id, torch.device("cpu"))
    handed = merge([pickle.loads(pickle.dumps(both.select([1]))), unused, both.select([0])])
    assert handed is not None and handed.tokens == [tuple(FEW_SHOT), tuple(TOK.encode("unused opening")),
                                                    tuple(SYSTEM)]
    assert handed.nbytes > 0 and merge([]) is None
    want = generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(9), **KW)
    _same(generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(9), prefixes=handed, **KW), want)


def test_stream_and_tail_from_prefixes_equal_generate() -> None:
    """generate_stream from prefixes = generate from prefixes, also when its tail moves and is resumed elsewhere
    (the exported cache holds the prefix rows)."""
    module, sampling = _policy("gpt2"), Sampling(20, 1, 0.9, 0.95)
    pre = _prefixes(module)
    want = generate(module, TOK, PROMPTS, generator=torch.Generator().manual_seed(2), prefixes=pre, **KW)
    rows, width = len(PROMPTS) * 3, 20
    ids = torch.full((rows, width), TOK.pad_id)
    lp = torch.zeros(rows, width)
    tails: list[Tail] = []

    class ExportAfter:
        seen = 0

        def progress(self, remaining: int) -> None:
            self.seen += 1

        def should_export(self) -> bool:
            return self.seen >= 4

    def place(item: GenChunk) -> None:
        w = item.response_ids.shape[1]
        ids[item.samples, :w], lp[item.samples, :w] = item.response_ids, item.logprobs

    for item in generate_stream(module, TOK, PROMPTS, n=3, sampling=sampling, chunk=2, prefixes=pre,
                                generator=torch.Generator().manual_seed(2), control=ExportAfter()):
        if isinstance(item, Tail):
            tails.append(item)
        else:
            place(item)
    assert len(tails) == 1 and tails[0].samples.numel() > 0
    for item in resume_stream(module, TOK, tails, sampling=sampling, chunk=2):
        assert isinstance(item, GenChunk)
        place(item)
    w = want.response_ids.shape[1]
    assert torch.equal(ids[:, :w], want.response_ids)
    assert (lp[:, :w] - want.logprobs).abs().max() <= 1e-5  # resumed rows decode in another batch


def test_match_takes_the_longest_prefix_a_prompt_outlasts() -> None:
    module = _policy("gpt2")
    with torch.inference_mode():
        pre = compute_prefixes(module, [(1, 2), (1, 2, 3), (1, 2, 3, 4)], TOK.pad_id, torch.device("cpu"))
    # (1, 2, 3, 4) is the whole of the second prompt: it keeps a token of its own, so the shorter prefix serves
    assert match([[1, 2, 3, 4, 5], [1, 2, 3, 4], [1, 2], [9, 1, 2, 3]], pre) == [2, 1, -1, -1]
