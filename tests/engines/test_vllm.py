"""Tests for flowrl.engines.vllm_engine that need neither vLLM nor a GPU: the output conversion and import safety.

`to_gen_output` reads vLLM's RequestOutput/CompletionOutput objects; the dataclasses below have the fields it reads
with vLLM's names and types (`Logprob` as in vllm/logprobs.py). They are inputs to the conversion under test, not
stand-ins for vLLM's engine; sampling with vLLM itself is only checked on a GPU machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from flowrl.engines.generation import GenOutput, generate
from flowrl.engines.vllm_engine import VLLMGenerator, to_gen_output
from flowrl.models.build import ModelSpec, build_model
from flowrl.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PAD = TOK.pad_id


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def _completion(index: int, tokens: list[int], logprobs: list[float]) -> CompletionOutput:
    steps = [{tok: Logprob(lp, rank=1)} for tok, lp in zip(tokens, logprobs, strict=True)]
    return CompletionOutput(index, "", tuple(tokens), sum(logprobs), steps, "stop")


def test_layout_matches_the_torch_engine() -> None:
    prompts = [[5, 6, 7], [8]]
    outputs = [
        # Completions out of index order: rows must follow CompletionOutput.index.
        RequestOutput("0", None, prompts[0], [_completion(1, [11], [-0.5]), _completion(0, [9, 10, TOK.eos_id], [-1.0, -2.0, -3.0])]),
        RequestOutput("1", None, prompts[1], [_completion(0, [12, 13], [-0.25, -0.75]), _completion(1, [14], [-4.0])]),
    ]  # fmt: skip
    out = to_gen_output(prompts, outputs, n=2, pad_id=PAD)
    assert out.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [PAD, PAD, 8], [PAD, PAD, 8]]  # left-padded
    assert out.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert out.response_ids.tolist() == [[9, 10, TOK.eos_id], [11, PAD, PAD], [12, 13, PAD], [14, PAD, PAD]]
    assert out.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]  # EOS included
    assert out.response_lens.tolist() == [3, 1, 2, 1]
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.logprobs.tolist() == [[-1.0, -2.0, -3.0], [-0.5, 0, 0], [-0.25, -0.75, 0], [-4.0, 0, 0]]
    assert [t.dtype for t in (out.prompt_ids, out.response_ids, out.logprobs)] == [torch.long, torch.long, torch.float32]


def test_torch_engine_output_round_trips_through_the_conversion() -> None:
    """Write a torch-engine rollout as vLLM would report it; converting it back must give the same tensors."""
    module = build_model(ModelSpec("tiny:gpt2", {"layers": 1, "dim": 32, "heads": 2}), seed=0).module
    prompts = [TOK.encode(s) for s in ["hello world", "hi", "a longer prompt"]]
    ref = generate(module, TOK, prompts, n=2, max_tokens=6, generator=torch.Generator().manual_seed(0))
    outputs = []
    for p, prompt in enumerate(prompts):
        completions = []
        for k in range(2):
            row = p * 2 + k
            size = int(ref.response_lens[row])
            completions.append(_completion(k, ref.response_ids[row, :size].tolist(), ref.logprobs[row, :size].tolist()))
        outputs.append(RequestOutput(str(p), None, prompt, completions))
    out = to_gen_output(prompts, outputs, n=2, pad_id=PAD)
    for field in GenOutput.__dataclass_fields__:
        assert torch.equal(getattr(out, field), getattr(ref, field)), field


def test_bare_float_logprobs_are_accepted() -> None:
    outputs = [RequestOutput("0", None, [1], [CompletionOutput(0, "", [2, 3], None, [{2: -0.5}, {3: -1.5, 7: -0.1}])])]
    assert to_gen_output([[1]], outputs, n=1, pad_id=PAD).logprobs.tolist() == [[-0.5, -1.5]]


@pytest.mark.parametrize(
    ("outputs", "n", "message"),
    [
        ([], 1, "vLLM returned 0 outputs for 1 prompts"),
        ([RequestOutput("0", None, [1], [_completion(0, [2], [-1.0])])], 2,
         "vLLM returned 1 completions for prompt 0, expected n=2"),
        ([RequestOutput("0", None, [1], [CompletionOutput(0, "", [2], None, None)])], 1,
         r"vLLM returned no log-prob per generated token \(SamplingParams\(logprobs=0\) missing\?\)"),
        ([RequestOutput("0", None, [1], [CompletionOutput(0, "", [2], None, [{5: Logprob(-1.0)}])])], 1,
         "vLLM's logprobs for a position do not include the sampled token 2"),
    ],
)  # fmt: skip
def test_malformed_outputs_are_reported(outputs: list[RequestOutput], n: int, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        to_gen_output([[1]], outputs, n=n, pad_id=PAD)


def test_generator_without_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing the module above needed no vLLM either
    with pytest.raises(ImportError, match=r"engine \"vllm\" needs vLLM, which is not installed: "
                                          r"pip install 'flowrl\[vllm\]'"):  # fmt: skip
        VLLMGenerator("hf:/models/policy", TOK)


def test_generator_needs_an_hf_source() -> None:
    with pytest.raises(ValueError, match="VLLMGenerator needs an hf: source .* got 'tiny:gpt2'"):
        VLLMGenerator("tiny:gpt2", TOK)
