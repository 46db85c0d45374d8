"""Models built from local Hugging Face checkpoints (flowrl.models.build) beyond a plain causal LM.

A reward model (or critic) whose `hf:` source is a trained reward model's checkpoint, a one-label
`...ForSequenceClassification` as TRL's RewardTrainer saves it, scores with the checkpoint's `score` head, giving
the checkpoint's own reward (loaded as a causal LM, the head was dropped and a random one scored); a causal LM's
checkpoint still gets a fresh value head. A tokenizer whose pad, BOS or EOS id is past the model's embeddings is
named when the model is built (it was an IndexError inside a forward)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.models.build import ModelSpec, ValueModel, build_model
from flowrl.models.sources import hf_positions, hf_score_head

CHARSET = "0123456789+="


def reward_checkpoint(path: Path, labels: int = 1) -> Any:
    """A 2-layer GPT2ForSequenceClassification with `labels` labels and a character tokenizer, saved to `path`;
    the model, in eval mode."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    n = len(CHARSET)
    vocab = {c: i for i, c in enumerate(CHARSET)} | {"<eos>": n, "<unk>": n + 1, "<pad>": n + 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=2, n_positions=64, eos_token_id=n,
                        pad_token_id=n + 2)
    config.num_labels = labels
    model = GPT2ForSequenceClassification(config)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize(("config", "scores"), [
    ({"architectures": ["GPT2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}, True),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}, True),
    ({"architectures": ["GPT2ForSequenceClassification"], "id2label": {"0": "NEG", "1": "POS"}}, False),
    ({"architectures": ["GPT2ForSequenceClassification"]}, False),  # transformers' default: two labels
    ({"architectures": ["GPT2LMHeadModel"], "id2label": {"0": "LABEL_0"}}, False),
    ({"model_type": "gpt2"}, False),
])
def test_a_one_label_sequence_classifier_is_a_reward_checkpoint(tmp_path: Path, config: dict[str, object],
                                                                 scores: bool) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert hf_score_head(str(tmp_path)) is scores
    assert hf_score_head(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("role", ["reward_model", "critic"])
def test_a_reward_checkpoint_scores_with_its_own_head(tmp_path: Path, role: str) -> None:
    hf = reward_checkpoint(tmp_path)
    built = build_model(ModelSpec(f"hf:{tmp_path}", role=role), seed=0)
    assert built.kind == "value" and isinstance(built.module, ValueModel)
    head = built.module.value_head
    assert torch.equal(head.weight, hf.score.weight) and torch.equal(head.bias, torch.zeros(1))
    ids = torch.tensor([[1, 2, 10, 3, 11, 4, 12], [9, 9, 10, 9, 11, 1, 12]])  # no padding: HF scores the last
    with torch.no_grad():
        ours = built.module(ids)[:, -1]  # (B,)
        theirs = hf(ids).logits[:, 0]  # (B,)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_two_label_classifier_or_a_causal_lm_gets_a_fresh_head(tmp_path: Path) -> None:
    hf = reward_checkpoint(tmp_path / "two", labels=2)
    built = build_model(ModelSpec(f"hf:{tmp_path / 'two'}", role="reward_model"), seed=0)
    assert isinstance(built.module, ValueModel)
    assert not torch.equal(built.module.value_head.weight, hf.score.weight[:1])
    policy = build_model(ModelSpec(f"hf:{tmp_path / 'two'}"), seed=0)  # a policy loads the causal LM as ever
    assert policy.kind == "causal_lm"


def test_a_special_token_past_the_models_embeddings_is_named(tmp_path: Path) -> None:
    """A pad token added to the tokenizer and not to the model (`<pad>` is id 14 of a 14-row embedding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    reward_checkpoint(tmp_path)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(CHARSET) + 2, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as e:
        build_model(ModelSpec(f"hf:{tmp_path}"), seed=0)
    assert str(e.value) == (
        f"cannot load hf:{tmp_path}: its tokenizer's pad token '<pad>' has id 14, and the model has 14 token "
        "embeddings (ids 0..13); resize the model's embeddings to the tokenizer "
        "(`model.resize_token_embeddings(len(tokenizer))`) and save it again, or give the tokenizer a pad token the "
        "model has")


@pytest.mark.parametrize(("value", "want"), [(64, 64), (True, None), (0, None), (-8, None), ("64", None)])
def test_hf_positions_reads_only_a_positive_int(tmp_path: Path, value: object, want: int | None) -> None:
    """A config.json's positions become the model's context: `true` (an int to Python), 0 or a string is none."""
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": value}))
    assert hf_positions(str(tmp_path)) == want
