"""flowrl's tiny tokenizers as Hugging Face tokenizers (flowrl.models.hf_tokenizer): saved to a directory and loaded
back by `AutoTokenizer` from it alone, each encodes and decodes as flowrl's does — every charset character, random
strings (characters outside the charset, whitespace, special tokens' text, multi-byte characters), random ids
(specials and ids past the vocabulary included) — with BOS first where flowrl's prompts have it, the same
special ids and tokens, and flowrl's plain chat template."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from flowrl.data.chat import render_plain
from flowrl.models.hf_tokenizer import byte_alphabet, save_hf_tokenizer
from flowrl.models.tokenizer import ByteTokenizer, CharTokenizer

CHARSET = "0123456789+= \nabc<>é"  # a space, a newline, special tokens' brackets and a two-byte character


def loaded(tok: ByteTokenizer | CharTokenizer, folder: Path) -> Any:
    from transformers import AutoTokenizer

    save_hf_tokenizer(tok, folder, context=64)
    return AutoTokenizer.from_pretrained(folder)


def random_strings(pool: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 24))) for _ in range(count)]


@pytest.mark.parametrize("tok", [CharTokenizer(CHARSET), CharTokenizer("0123456789+="), ByteTokenizer()],
                         ids=["chars", "arith-chars", "bytes"])
def test_encodes_and_decodes_as_flowrl(tok: ByteTokenizer | CharTokenizer, tmp_path: Path) -> None:
    hf = loaded(tok, tmp_path)
    every = list(tok.chars) if isinstance(tok, CharTokenizer) else [chr(c) for c in range(0x250)]
    texts = every + random_strings(CHARSET + "xyz\t😀<eos><bos><pad><unk>\u0301", 300, seed=0)
    for text in texts:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text), repr(text)
        assert hf(text)["input_ids"] == [tok.bos_id, *tok.encode(text)], repr(text)  # BOS first, as prompts start
        assert hf.decode(tok.encode(text), skip_special_tokens=True) == tok.decode(tok.encode(text))
    rng = random.Random(1)
    for _ in range(300):  # any ids: specials, <unk>, ids past the vocabulary, broken UTF-8 (bytes)
        ids = [rng.randrange(tok.vocab_size + 4) for _ in range(rng.randint(0, 24))]
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids), ids


@pytest.mark.parametrize("tok", [CharTokenizer(CHARSET), ByteTokenizer()], ids=["chars", "bytes"])
def test_special_ids_and_tokens_are_flowrls(tok: ByteTokenizer | CharTokenizer, tmp_path: Path) -> None:
    hf = loaded(tok, tmp_path)
    assert (hf.bos_token, hf.bos_token_id) == ("<bos>", tok.bos_id)
    assert (hf.eos_token, hf.eos_token_id) == ("<eos>", tok.eos_id)
    assert (hf.pad_token, hf.pad_token_id) == ("<pad>", tok.pad_id)
    assert len(hf) == tok.vocab_size
    if isinstance(tok, CharTokenizer):
        assert (hf.unk_token, hf.unk_token_id) == ("<unk>", tok.UNK)
    assert hf.model_max_length == 64
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # the name transformers 4 and 5 both load


def test_the_chat_template_is_flowrls_plain_one(tmp_path: Path) -> None:
    hf = loaded(CharTokenizer(CHARSET), tmp_path)
    for messages in ([{"role": "user", "content": "2+3="}],
                     [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="}]):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == render_plain(messages)


def test_the_byte_alphabet_is_the_byte_level_pre_tokenizers() -> None:
    from tokenizers import pre_tokenizers

    table = byte_alphabet()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["Ġ"] == ord(" ")  # GPT-2 writes a space as Ġ
