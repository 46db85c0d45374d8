"""Preference data as a model reads it (flowrl.runtime.pairs, flowrl.runtime.prompts, issue 34 item 5): a pair's
two sides under one prompt cut once (BOS kept), and one BOS whether or not the chat template writes it."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.tokenizer import CharTokenizer, HFTokenizer
from flowrl.runtime.batch import Batch
from flowrl.runtime.pairs import demo_batch, pair_batch
from flowrl.runtime.preference_update import rows_batch
from flowrl.runtime.prompts import PromptEncoder, prompt_texts


def _real(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [[t for t, m in zip(r, mk, strict=True) if m] for r, mk in zip(ids.tolist(), mask.tolist(), strict=True)]


def test_a_pairs_prompt_is_cut_once_for_both_sides_and_keeps_its_bos() -> None:
    """The issue's case: a 300-token prompt, a short chosen and a long rejected response, context 512. On main the
    chosen row kept 301 prompt tokens (BOS + 300) and the rejected one 256 without its BOS: DPO and Bradley-Terry
    compared log-probs under different contexts."""
    tok = CharTokenizer("0123456789abcdefghij")
    prompt = "".join("abcdefghij"[i % 10] for i in range(300))
    b = pair_batch(rows_batch([{"prompt": prompt, "chosen": "1" * 9, "rejected": "2" * 249}]), tok, context=512)
    prompts = _real(b["prompt_ids"], b["prompt_mask"])
    responses = _real(b["response_ids"], b["response_mask"])
    assert prompts[0] == prompts[1]  # one prompt for both sides
    assert prompts[0][0] == tok.bos_id and prompts[0][1:] == tok.encode(prompt)[-(len(prompts[0]) - 1):]
    assert len(prompts[0]) == 512 - 250  # cut as little as the longer response (249 + EOS) needs
    assert [len(r) for r in responses] == [10, 250]  # both responses whole
    # responses longer than half the context: the prompt keeps half of it (its BOS among them), they their start
    b = pair_batch(rows_batch([{"prompt": prompt, "chosen": "1" * 400, "rejected": "2"}]), tok, context=512)
    prompts = _real(b["prompt_ids"], b["prompt_mask"])
    assert prompts[0] == prompts[1] and len(prompts[0]) == 256 and prompts[0][0] == tok.bos_id
    assert [len(r) for r in _real(b["response_ids"], b["response_mask"])] == [256, 2]
    demos = demo_batch(rows_batch([{"prompt": prompt, "response": "3" * 400}]), tok, context=512)
    assert _real(demos["prompt_ids"], demos["prompt_mask"])[0] == prompts[0]


def test_a_generation_prompt_cut_to_the_context_keeps_its_bos() -> None:
    tok = CharTokenizer("ab")
    ids = PromptEncoder(tok, context=8).ids(["ab" * 10, "ab"], max_tokens=3)
    assert ids == [[tok.bos_id, *tok.encode("ab" * 10)[-4:]], [tok.bos_id, *tok.encode("ab")]]


def _bos_template_tokenizer(path: Path) -> HFTokenizer:
    """A character-level Hugging Face tokenizer with a BOS whose chat template writes it first, as Llama-2/3's,
    Mistral's and Gemma's do (built here and saved with save_pretrained; nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    charset = "0123456789+=:abcdefghijklmnopqrstuvwxyz "
    vocab = {c: i for i, c in enumerate(charset)} | {s: len(charset) + i for i, s in
                                                    enumerate(["<eos>", "<unk>", "<pad>", "<bos>"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<bos>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)
    return HFTokenizer(str(path))


def test_a_chat_template_that_writes_the_bos_gets_no_second_one(tmp_path: Path) -> None:
    tok = _bos_template_tokenizer(tmp_path / "tok")
    assert tok.bos_id is not None
    chat = [{"role": "user", "content": "1+2="}]
    rendered = tok.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<bos>") and tok.encode(rendered)[0] == tok.bos_id  # the template wrote it
    b = pair_batch(rows_batch([{"prompt": chat, "chosen": "3", "rejected": "4"},
                               {"prompt": "1+2=", "chosen": "3", "rejected": "4"}]), tok, context=64)
    prompts = _real(b["prompt_ids"], b["prompt_mask"])
    assert prompts[0] == tok.encode(rendered)  # one BOS, the template's
    assert prompts[2] == [tok.bos_id, *tok.encode("1+2=")]  # a text prompt gets the tokenizer's
    assert [p.count(tok.bos_id) for p in prompts] == [1, 1, 1, 1]
    generated = Batch(1, {}, {"prompt": ["ignored"], "messages": [chat]})
    ids = PromptEncoder(tok, context=64).ids(prompt_texts(generated, tok), max_tokens=4)
    assert ids == [tok.encode(rendered)]
