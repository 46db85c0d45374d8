"""A model's weights as a Hugging Face directory (flowrl.models.export), loaded in a fresh Python that cannot import
flowrl (tests/models/hf_elsewhere.py): `tiny:gpt2` as GPT2LMHeadModel, `tiny:llama` as LlamaForCausalLM and an `hf:`
source as its own architecture give flowrl's logits (1e-5, fp32) and, through `model.generate` from the exported
tokenizer's encoding of text prompts, flowrl's greedy answers; bf16 stays bf16; an `hf:` source's tokenizer files
(chat template included) and generation defaults are carried over. A reward model or critic is a one-label
`...ForSequenceClassification` whose score on the last token is flowrl's value (GPT-2: the head's bias folded into
the final LayerNorm; Llama: off by the bias, kept as `score_bias`, which flowrl's `hf:` loader adds back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.engines.generation import generate
from flowrl.errors import FlowError
from flowrl.models.build import LoadedModel, ModelSpec, ValueModel, build_model
from flowrl.models.export import export_model
from flowrl.runtime.prompts import PromptEncoder
from tests.models.hf_elsewhere import load_elsewhere

CHARSET = "0123456789+="
TINY = {"layers": 2, "dim": 32, "heads": 4, "charset": CHARSET, "context": 64}
PROMPTS = ["1+2=", "9+9=", "3+", "45+67="]
IDS = [[13, 1, 2, 10, 3, 11, 3], [13, 9, 9, 10, 9, 9, 11]]  # <bos> and characters of CHARSET (13: its BOS)
PADDED = [IDS[0][:4] + [12] * 3, IDS[1]]  # right-padded with <pad> (12): transformers scores the last real token
MAX_NEW = 6


def greedy(loaded: LoadedModel, prompts: list[str], max_tokens: int = MAX_NEW) -> list[list[int]]:
    """flowrl's greedy answers (EOS included), from the prompts as flowrl encodes them."""
    ids = PromptEncoder(loaded.tokenizer, 64).ids(prompts, max_tokens)
    out = generate(loaded.module, loaded.tokenizer, ids, max_tokens=max_tokens, temperature=0.0)
    return [row[:n] for row, n in zip(out.response_ids.tolist(), out.response_lens.tolist(), strict=True)]


def trained_like(spec: ModelSpec, seed: int) -> LoadedModel:
    """A built model whose weights are moved off their initial values (every tensor, biases and norms included),
    as training moves them, so nothing exported can pass by being at its init."""
    loaded = build_model(spec, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in loaded.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return loaded


def hf_source(path: Path) -> None:
    """A 2-layer Llama (grouped KV heads, tied embeddings) with a character tokenizer that has a chat template and no
    BOS, and generation defaults of its own, written by `save_pretrained` (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARSET)} | {"<eos>": 12, "<unk>": 13, "<pad>": 14}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                            chat_template=template).save_pretrained(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=15, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True, eos_token_id=12, pad_token_id=14))
    model.generation_config = GenerationConfig(eos_token_id=12, pad_token_id=14, do_sample=True, temperature=0.7,
                                              top_p=0.9)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each case: flowrl's model, its export and what a fresh Python without flowrl read from the export."""
    root = tmp_path_factory.mktemp("export")
    hf_source(root / "source")
    cases = {
        "tiny:gpt2": ModelSpec("tiny:gpt2", TINY),
        "tiny:llama": ModelSpec("tiny:llama", TINY),
        "tiny:gpt2-bytes": ModelSpec("tiny:gpt2", {**TINY, "charset": ""}),
        "hf:llama": ModelSpec(f"hf:{root / 'source'}"),
        "tiny:llama-bf16": ModelSpec("tiny:llama", TINY, dtype="bfloat16"),
        "gpt2-rm": ModelSpec("tiny:gpt2", TINY, role="reward_model"),
        "llama-critic": ModelSpec("tiny:llama", TINY, role="critic"),
    }
    out: dict[str, Any] = {}
    jobs = []
    for i, (name, spec) in enumerate(cases.items()):
        loaded = trained_like(spec, seed=i)
        done = export_model(loaded.module.state_dict(), spec, root / name.replace(":", "_"))
        kind = "classifier" if loaded.kind == "value" else "causal"
        jobs.append({"dir": str(done.path), "kind": kind, "ids": IDS, "texts": PROMPTS,
                     **({"prompts": PROMPTS, "max_new_tokens": MAX_NEW} if kind == "causal" else {})})
        if kind == "classifier":
            jobs.append({"dir": str(done.path), "kind": kind, "ids": PADDED})
        out[name] = {"loaded": loaded, "done": done}
    results = iter(load_elsewhere(jobs, root / "elsewhere"))
    for case in out.values():
        case["there"] = next(results)
        if case["loaded"].kind == "value":
            case["padded"] = next(results)
    out["source"] = root / "source"
    return out


@pytest.mark.parametrize(("case", "arch", "model_type"), [
    ("tiny:gpt2", "GPT2LMHeadModel", "gpt2"), ("tiny:llama", "LlamaForCausalLM", "llama"),
    ("tiny:gpt2-bytes", "GPT2LMHeadModel", "gpt2"), ("hf:llama", "LlamaForCausalLM", "llama")])
def test_a_causal_lm_loads_without_flowrl_with_flowrls_logits_and_greedy_answers(
        exported: dict[str, Any], case: str, arch: str, model_type: str) -> None:
    loaded, done, there = exported[case]["loaded"], exported[case]["done"], exported[case]["there"]
    assert (done.architecture, there["class"], there["config"]["model_type"]) == (arch, arch, model_type)
    assert there["dtype"] == done.dtype == "float32"
    with torch.no_grad():
        ours = loaded.module(torch.tensor(IDS)).logits.float()
    torch.testing.assert_close(there["logits"], ours, atol=1e-5, rtol=1e-5)
    tok = loaded.tokenizer
    assert there["encoded"] == [tok.encode(p) for p in PROMPTS]
    assert there["prompt_ids"] == PromptEncoder(tok, 64).ids(PROMPTS, MAX_NEW)  # BOS first where flowrl puts one
    assert there["answers"] == greedy(loaded, PROMPTS)
    assert there["answer_texts"] == [tok.decode(a) for a in there["answers"]]
    assert any(len(a) > 1 for a in there["answers"])  # answers of more than one token were compared


def test_tiny_tokenizers_keep_flowrls_special_ids(exported: dict[str, Any]) -> None:
    for case in ("tiny:gpt2", "tiny:gpt2-bytes", "tiny:llama"):
        tok, there = exported[case]["loaded"].tokenizer, exported[case]["there"]
        assert there["specials"] == {"bos": ("<bos>", tok.bos_id), "eos": ("<eos>", tok.eos_id),
                                     "pad": ("<pad>", tok.pad_id)}
        generation = json.loads((exported[case]["done"].path / "generation_config.json").read_text(encoding="utf-8"))
        assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == \
            (tok.bos_id, tok.eos_id, tok.pad_id)
        assert (there["config"]["bos_token_id"], there["config"]["eos_token_id"]) == (tok.bos_id, tok.eos_id)


def test_an_hf_source_keeps_its_tokenizer_files_and_generation_defaults(exported: dict[str, Any]) -> None:
    source, done = exported["source"], exported["hf:llama"]["done"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (done.path / name).read_bytes() == (source / name).read_bytes(), name
    generation = json.loads((done.path / "generation_config.json").read_text(encoding="utf-8"))
    assert (generation["do_sample"], generation["temperature"], generation["top_p"]) == (True, 0.7, 0.9)
    assert (generation["eos_token_id"], generation["pad_token_id"], generation.get("bos_token_id")) == (12, 14, None)
    assert sorted(p.name for p in done.path.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]


def test_bf16_stays_bf16(exported: dict[str, Any]) -> None:
    loaded, done, there = (exported["tiny:llama-bf16"][k] for k in ("loaded", "done", "there"))
    assert there["dtype"] == done.dtype == there["config"]["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(done.path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (safe_open has no iter)
    with torch.no_grad():
        ours = loaded.module(torch.tensor(IDS)).logits.float()
    torch.testing.assert_close(there["logits"], ours, atol=2e-2, rtol=2e-2)  # bf16 kernels, not bf16 weights
    assert there["answers"] == greedy(loaded, PROMPTS)


def _last_values(loaded: LoadedModel, ids: list[list[int]]) -> torch.Tensor:
    module = loaded.module
    assert isinstance(module, ValueModel)
    with torch.no_grad():
        return module(torch.tensor(ids))[:, -1].float()  # (B,) the value on each row's last token


def test_a_gpt2_reward_model_scores_exactly_as_flowrl(exported: dict[str, Any]) -> None:
    loaded, done, there = (exported["gpt2-rm"][k] for k in ("loaded", "done", "there"))
    assert isinstance(loaded.module, ValueModel) and abs(float(loaded.module.value_head.bias.detach())) > 1e-3
    assert (there["class"], len(there["config"]["id2label"]), done.notes) == ("GPT2ForSequenceClassification", 1, ())
    assert "score_bias" not in there["config"]  # folded into ln_f's bias
    torch.testing.assert_close(there["logits"][:, 0], _last_values(loaded, IDS), atol=1e-5, rtol=1e-5)


def test_a_llama_critics_bias_is_kept_beside_the_score(exported: dict[str, Any]) -> None:
    loaded, done, there = (exported["llama-critic"][k] for k in ("loaded", "done", "there"))
    assert isinstance(loaded.module, ValueModel)
    bias = float(loaded.module.value_head.bias.detach())
    assert there["class"] == "LlamaForSequenceClassification" and abs(bias) > 1e-3
    assert there["config"]["score_bias"] == pytest.approx(bias)
    assert len(done.notes) == 1 and "config.json keeps it as `score_bias`" in done.notes[0]
    torch.testing.assert_close(there["logits"][:, 0] + bias, _last_values(loaded, IDS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["gpt2-rm", "llama-critic"])
def test_flowrls_hf_loader_reads_an_exported_value_model_back(exported: dict[str, Any], case: str) -> None:
    loaded, done = exported[case]["loaded"], exported[case]["done"]
    for role in ("reward_model", "critic"):
        back = build_model(ModelSpec(f"hf:{done.path}", role=role), seed=123)  # the seed must not matter
        torch.testing.assert_close(_last_values(back, IDS), _last_values(loaded, IDS), atol=1e-5, rtol=1e-5)
    module = loaded.module
    with torch.no_grad():
        ours = torch.stack([module(torch.tensor([PADDED[0][:4]]))[0, -1], module(torch.tensor([PADDED[1]]))[0, -1]])
    there = exported[case]["padded"]
    shift = float(there["config"].get("score_bias", 0.0))
    torch.testing.assert_close(there["logits"][:, 0] + shift, ours.float(), atol=1e-5, rtol=1e-5)


def test_where_it_writes(tmp_path: Path) -> None:
    spec = ModelSpec("tiny:gpt2", TINY)
    weights = build_model(spec, seed=0).module.state_dict()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine", encoding="utf-8")
    for overwrite in (False, True):
        with pytest.raises(FlowError) as e:
            export_model(weights, spec, tmp_path / "busy", overwrite=overwrite)
        want = "it is not empty" if not overwrite else "it is not empty and is not a model directory"
        assert want in e.value.render()
    assert (tmp_path / "busy" / "notes.txt").read_text(encoding="utf-8") == "mine"  # left alone
    (tmp_path / "empty").mkdir()
    export_model(weights, spec, tmp_path / "empty")  # an empty directory is written into
    with pytest.raises(FlowError, match="it is not empty"):
        export_model(weights, spec, tmp_path / "empty")
    done = export_model(weights, spec, tmp_path / "empty", overwrite=True)  # a model directory is replaced
    assert sorted(p.name for p in done.path.iterdir()) == ["chat_template.jinja", "config.json",
                                                           "generation_config.json", "model.safetensors",
                                                           "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial directory left
    with pytest.raises(FlowError) as e:
        export_model(weights, ModelSpec(f"hf:{tmp_path / 'gone'}"), tmp_path / "out")
    assert e.value.render() == (f"error: cannot export a model from hf:{tmp_path / 'gone'}: directory not found\n"
                                "hint: the export takes the architecture and the tokenizer from the source "
                                "directory the run started from; restore it there")
