"""Tests for flowrl.models: tokenizers, tiny/HF model construction, value models and backbone copying."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.models.build import LoadedModel, ModelSpec, ValueModel, build_model, cache_kw, copy_backbone
from flowrl.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TINY = {"layers": 2, "dim": 32, "heads": 2}


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    # Specials and out-of-range ids (padded model vocab) carry no text; broken UTF-8 is replaced, not raised.
    assert tok.decode([tok.bos_id or 0, *ids, tok.eos_id, tok.pad_id, 300]) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tiny_models_follow_config(family: str) -> None:
    loaded = build_model(ModelSpec(f"tiny:{family}", {"layers": 3, "dim": 48, "heads": 4, "context": 128}), seed=0)
    lm: Any = loaded.module
    cfg = lm.config
    assert loaded.kind == "causal_lm"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (3, 48, 4)
    assert cfg.vocab_size == ByteTokenizer().vocab_size
    assert cfg.max_position_embeddings == 128
    assert not lm.training
    logits = lm(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size)


def test_vocab_can_grow_but_never_shrink_below_tokenizer() -> None:
    big: Any = build_model(ModelSpec("tiny:gpt2", {**TINY, "vocab": 320}), seed=0).module
    small: Any = build_model(ModelSpec("tiny:gpt2", {**TINY, "vocab": 100}), seed=0).module
    assert big.config.vocab_size == 320
    assert small.config.vocab_size == 259


def test_seed_controls_init_without_touching_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_model(ModelSpec("tiny:gpt2", TINY), seed=7).module
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_model(ModelSpec("tiny:gpt2", TINY), seed=7).module
    c = build_model(ModelSpec("tiny:gpt2", TINY), seed=8).module
    wa, wb, wc = (m.state_dict()["transformer.h.0.attn.c_attn.weight"] for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("role", ["critic", "reward_model"])
def test_value_model_shapes(family: str, role: str) -> None:
    loaded = build_model(ModelSpec(f"tiny:{family}", TINY, role=role), seed=0)
    assert loaded.kind == "value"
    assert isinstance(loaded.module, ValueModel)
    ids = torch.randint(0, 256, (3, 5))
    mask = torch.ones_like(ids)
    values = loaded.module(input_ids=ids, attention_mask=mask)
    assert values.shape == (3, 5)
    # No LM head rides along inside the critic.
    assert not any("lm_head" in name for name, _ in loaded.module.named_parameters())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_copy_backbone_policy_to_critic_and_reference(family: str) -> None:
    policy: Any = build_model(ModelSpec(f"tiny:{family}", TINY), seed=1).module
    critic: Any = build_model(ModelSpec(f"tiny:{family}", TINY, role="critic"), seed=2).module
    reference: Any = build_model(ModelSpec(f"tiny:{family}", TINY, role="reference"), seed=3).module
    head_before = critic.value_head.weight.clone()
    assert copy_backbone(critic, policy) > 0
    assert copy_backbone(reference, policy) > 0
    base = policy.base_model.state_dict()
    for name, tensor in critic.backbone.state_dict().items():
        assert torch.equal(tensor, base[name]), name
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, policy.state_dict()[name]), name
    assert torch.equal(critic.value_head.weight, head_before)
    # Same weights -> same hidden states, so the critic is the policy's backbone plus a head.
    ids = torch.randint(0, 256, (2, 6))
    hidden = policy.base_model(input_ids=ids).last_hidden_state
    expected = critic.value_head(hidden).squeeze(-1)
    assert torch.allclose(critic(input_ids=ids), expected, atol=1e-6)


def test_copy_backbone_rejects_mismatched_shapes() -> None:
    policy = build_model(ModelSpec("tiny:gpt2", TINY), seed=1).module
    other = build_model(ModelSpec("tiny:gpt2", {**TINY, "dim": 64}, role="critic"), seed=2).module
    with pytest.raises(ValueError, match="no matching source"):
        copy_backbone(other, policy)


def test_reference_is_frozen_and_in_eval() -> None:
    ref = build_model(ModelSpec("tiny:llama", TINY, role="reference"), seed=0).module
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    policy = build_model(ModelSpec("tiny:llama", TINY), seed=0).module
    assert all(p.requires_grad for p in policy.parameters())


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (ModelSpec("gpt2"), "unknown model source 'gpt2'.*tiny:gpt2.*tiny:llama.*hf:"),
        (ModelSpec("tiny:mamba", TINY), "unknown model source"),
        (ModelSpec("hf:"), "unknown model source"),
        (ModelSpec("tiny:gpt2", TINY, role="judge"), "unknown model role"),
        (ModelSpec("tiny:gpt2", TINY, dtype="int8"), "unknown dtype"),
        (ModelSpec("tiny:llama", {"layers": 1, "dim": 12, "heads": 4}), "even head size"),
        (ModelSpec("hf:/nonexistent/model"), "cannot load hf:/nonexistent/model: directory not found"),
        (ModelSpec("tiny:gpt2", {**TINY, "width": 3}), "unknown tiny model keys"),
        (ModelSpec("tiny:gpt2", {**TINY, "heads": 3}), "not divisible"),
        (ModelSpec("tiny:gpt2", {**TINY, "layers": 0}), "positive int"),
    ],
)
def test_bad_specs_raise_clear_errors(spec: ModelSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(spec, seed=0)


def test_a_tiny_model_without_a_shape_takes_the_languages_defaults() -> None:
    """docs/language.md promises defaults for `layers`, `dim`, `heads`: `build_model` uses the same ones."""
    from flowrl.ir.signatures import MODEL_KEYS

    cfg = build_model(ModelSpec("tiny:gpt2"), seed=0).module.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head) == (MODEL_KEYS["layers"][1], MODEL_KEYS["dim"][1],
                                                     MODEL_KEYS["heads"][1]) == (2, 64, 4)


def test_an_hf_directory_without_config_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        build_model(ModelSpec(f"hf:{tmp_path}"), seed=0)


def _save_tiny_hf_checkpoint(path: Path) -> list[str]:
    """A real on-disk HF checkpoint (tokenizer + GPT-2 weights) built entirely in code."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "hello", "world", "foo", "bar"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(words), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                     bos_token_id=None, eos_token_id=1, pad_token_id=0)  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return words


def test_hf_checkpoint_loads_from_local_path(tmp_path: Path) -> None:
    words = _save_tiny_hf_checkpoint(tmp_path)
    loaded = build_model(ModelSpec(f"hf:{tmp_path}"), seed=0)
    assert isinstance(loaded, LoadedModel)
    tok = loaded.tokenizer
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 1, None, len(words))
    assert tok.encode("hello world foo") == [3, 4, 5]
    assert tok.decode([3, 4, 1, 0]) == "hello world"
    lm: Any = loaded.module
    assert lm.config.n_layer == 2
    assert not lm.training
    logits = lm(input_ids=torch.tensor([tok.encode("hello world")])).logits
    assert logits.shape == (1, 2, len(words))

    critic = build_model(ModelSpec(f"hf:{tmp_path}", role="critic"), seed=0)
    assert critic.kind == "value"
    assert critic.module(input_ids=torch.tensor([[3, 4, 5]])).shape == (1, 3)
    assert copy_backbone(critic.module, loaded.module) > 0


def test_hf_tokenizer_pad_falls_back_to_eos(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1, "a": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert tok.pad_id == tok.eos_id == 0


def test_cache_keyword_follows_the_installed_transformers() -> None:
    class Old(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
            return input_ids

    class Wrapped(torch.nn.Module):  # DeepSpeed's engine: forward(*args, **kwargs), the model as `.module`
        def __init__(self, module: torch.nn.Module):
            super().__init__()
            self.module = module

    assert cache_kw(Old(), "kv") == {"past_key_values": "kv"}
    assert cache_kw(Wrapped(Old()), "kv") == {"past_key_values": "kv"}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cached_forwards_raise_no_deprecation_warning(family: str) -> None:
    """Generation and the value model's cached forward hand the cache over by the name this transformers
    takes: no FutureWarning on every run, and no break when the old name is removed."""
    from flowrl.engines.generation import generate

    config = {"layers": 2, "dim": 32, "heads": 4, "context": 64}
    lm = build_model(ModelSpec(f"tiny:{family}", config), seed=0)
    critic = build_model(ModelSpec(f"tiny:{family}", config, role="critic"), seed=0).module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = generate(lm.module, lm.tokenizer, [[1, 2, 3], [4, 5]], n=2, max_tokens=4,
                       generator=torch.Generator().manual_seed(0))
        values = critic(input_ids=torch.tensor([[1, 2, 3]]))
    assert out.response_ids.shape[0] == 4 and values.shape == (1, 3)
