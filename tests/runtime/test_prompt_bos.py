"""A prompt starts with one BOS (flowrl.runtime.prompts): where an `hf:` checkpoint's chat template writes
`bos_token` itself (Llama's, Mistral's, Gemma's do), chat-message prompts get the ids transformers'
`apply_chat_template` gives, not a second BOS in front; text prompts and templates without it still get flowrl's."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.data.chat import render_chat
from flowrl.models.tokenizer import HFTokenizer
from flowrl.runtime.prompts import PromptEncoder

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=:\n"
WITH_BOS = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
MESSAGES = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="}]


def _tokenizer(path: Path, template: str) -> HFTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab |= {"<pad>": len(vocab), "<s>": len(vocab) + 1, "</s>": len(vocab) + 2, "<unk>": len(vocab) + 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", chat_template=template).save_pretrained(path)
    return HFTokenizer(str(path))


def _transformers_ids(tok: HFTokenizer) -> list[int]:
    got = tok.hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    return [int(i) for i in (got["input_ids"] if hasattr(got, "keys") else got)]


@pytest.mark.parametrize("template", [WITH_BOS, WITH_BOS.replace("{{ bos_token }}", "")],
                         ids=["template-writes-bos", "template-without-bos"])
def test_a_chat_prompt_has_one_bos(tmp_path: Path, template: str) -> None:
    tok = _tokenizer(tmp_path / "tok", template)
    ids = PromptEncoder(tok, 128).tokens(render_chat(MESSAGES, tok))
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    if "bos_token" in template:
        assert ids == _transformers_ids(tok)  # transformers' own rendering and tokenisation
    else:
        assert ids == [tok.bos_id, *_transformers_ids(tok)]  # flowrl puts BOS first where the template does not


def test_a_text_prompt_still_gets_bos(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path / "tok", WITH_BOS)
    assert PromptEncoder(tok, 128).tokens("2+3=") == [tok.bos_id, *tok.encode("2+3=")]
