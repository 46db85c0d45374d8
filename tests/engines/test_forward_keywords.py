"""The teacher-forced forwards (flowrl.engines.forward) take the rollout's four tensors and their keywords as one
signature would: a wrong count or an unknown keyword is a TypeError naming what is taken, not silently ignored."""

from __future__ import annotations

import pytest
import torch

from flowrl.engines.forward import forward_entropy, forward_logprobs, forward_logprobs_entropy, forward_values
from flowrl.models.build import ModelSpec, build_model

IDS = torch.tensor([[1, 5, 6]]), torch.tensor([[1, 1, 1]]), torch.tensor([[7, 8]]), torch.tensor([[1, 1]])


def test_a_forward_names_the_keywords_it_takes() -> None:
    module = build_model(ModelSpec("tiny:gpt2", {"layers": 1, "dim": 16, "heads": 2}), seed=0).module
    with pytest.raises(TypeError, match=r"unexpected keyword 'temprature'; this forward takes \['micro_batch', "
                                        r"'temperature', 'with_grad'\]"):
        forward_logprobs(module, *IDS, temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unexpected keyword 'temperature'; this forward takes \['micro_batch', "
                                        r"'with_grad'\]"):
        forward_values(module, *IDS, temperature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"a forward takes \(prompt_ids, prompt_mask, response_ids, response_mask\), "
                                        r"got 3 tensors"):
        forward_entropy(module, *IDS[:3])
    logp, entropy = forward_logprobs_entropy(module, *IDS, temperature=0.5, micro_batch=1)
    assert torch.equal(logp, forward_logprobs(module, *IDS, temperature=0.5))
    assert torch.equal(entropy, forward_entropy(module, *IDS, temperature=0.5))
