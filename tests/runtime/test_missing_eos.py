"""A reward model's `missing_eos_penalty` (TRL's name): a response cut off before EOS scores that much less, in the
plain score and in fuse-gen-inference's growing score alike; the key belongs to reward models only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.errors import FlowError
from flowrl.runtime.batch import Batch
from flowrl.runtime.worker import ModelWorker, ended_with

FLOW = """
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=" }}
model ref : reference {{ source = actor }}
model rm : reward_model {{ source = actor{rm} }}
data prompts = jsonl("data.jsonl") {{ batch = 1 }}
use grpo(reward = rm, group = 2, max_tokens = 2)
"""


def _graph(tmp_path: Path, rm: str) -> flowrl.Graph:
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+2="}\n')
    (tmp_path / "f.flow").write_text(FLOW.format(rm=rm))
    return flowrl.load(str(tmp_path / "f.flow"))


def test_cut_off_responses_score_the_penalty_less(tmp_path: Path) -> None:
    plain = ModelWorker([_graph(tmp_path, "").model("rm")], _graph(tmp_path, "").models, seed=0)
    graph = _graph(tmp_path, ", missing_eos_penalty = 2.5")
    penalised = ModelWorker([graph.model("rm")], graph.models, seed=0)
    tok = plain.models["rm"].tokenizer
    prompt = torch.tensor([[tok.bos_id, *tok.encode("1+2=")]] * 3)
    three, eos, pad = tok.encode("3")[0], tok.eos_id, tok.pad_id
    response_ids = torch.tensor([[three, eos, pad], [three, three, three], [three, three, pad]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    assert ended_with(response_ids, response_mask, eos).tolist() == [True, False, False]
    rollout = Batch(3, {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "response_ids": response_ids,
                        "response_mask": response_mask})
    before = plain.score("rm", rollout, {})["scores"]
    after = penalised.score("rm", rollout, {})["scores"]
    torch.testing.assert_close(before - after, torch.tensor([0.0, 2.5, 2.5]))


def test_the_penalty_is_a_reward_models_key(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+2="}\n')
    text = FLOW.format(rm="").replace('charset = "0123456789+=" }', 'charset = "0123456789+=", '
                                      'missing_eos_penalty = 1.0 }', 1)
    (tmp_path / "f.flow").write_text(text)
    with pytest.raises(FlowError) as err:  # at check time, at the key
        flowrl.load(str(tmp_path / "f.flow"))
    d = err.value.diagnostics[0]
    assert "missing_eos_penalty is a reward model's, and `actor` is a policy" in d.message
    assert d.loc is not None and d.loc.line == 2 and d.source_line is not None
