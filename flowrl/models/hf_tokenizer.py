"""flowrl's own tokenizers as Hugging Face tokenizers (flowrl.models): what `flowrl export` writes next to a tiny
model's weights, so `AutoTokenizer.from_pretrained(DIR)` encodes and decodes as flowrl does, with no flowrl import.

`CharTokenizer` becomes a word-level vocabulary over single characters (every character its own word; one outside
the charset is `<unk>`), `ByteTokenizer` a byte-level BPE without merges whose id of each byte is the byte's value.
Both keep flowrl's ids for `<pad>`, `<bos>`, `<eos>` (and `<unk>`) and their meaning:

- `encode(text, add_special_tokens=False)` is flowrl's `encode(text)`; with special tokens (the default of
  `tokenizer(text)`) BOS comes first, as flowrl's prompts start (flowrl.runtime.prompts);
- `decode(ids, skip_special_tokens=True)` is flowrl's `decode(ids)` (flowrl drops specials and ids past the
  vocabulary);
- a special token's text in the input ("<eos>") is characters, not the token (`split_special_tokens`), since
  flowrl's tokenizers never read specials from text;
- the chat template is flowrl's plain one for tiny models (flowrl.data.chat.render_plain: contents joined by
  newlines), so chat-message prompts render to the text flowrl trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowrl.models.tokenizer import ByteTokenizer, CharTokenizer

__all__ = ["PLAIN_CHAT_TEMPLATE", "byte_alphabet", "hf_tokenizer", "save_hf_tokenizer"]

# flowrl.data.chat.render_plain as Jinja: each message's content, newline-separated, roles left out; the same text
# with or without `add_generation_prompt` (a tiny model continues the last message).
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"


def hf_tokenizer(tokenizer: ByteTokenizer | CharTokenizer, context: int | None = None) -> Any:
    """`tokenizer` as a `transformers.PreTrainedTokenizerFast` (ids, specials and text round trips equal to
    flowrl's); `context`: the model's positions, as `model_max_length`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    named = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
    if isinstance(tokenizer, CharTokenizer):
        vocab = {c: i for i, c in enumerate(tokenizer.chars)} | {"<unk>": tokenizer.UNK}
        raw = Tokenizer(models.WordLevel(_with_specials(vocab, tokenizer), unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character a word of its own
        raw.decoder = decoders.Fuse()  # word-level decoding would put a space between characters
        named["unk_token"] = "<unk>"
    elif isinstance(tokenizer, ByteTokenizer):
        raw = Tokenizer(models.BPE(_with_specials(byte_alphabet(), tokenizer), merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()  # bytes back to UTF-8, a bad sequence as U+FFFD, as flowrl decodes
    else:
        raise TypeError(f"no Hugging Face form for {tokenizer!r}: flowrl converts its CharTokenizer and ByteTokenizer")
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tokenizer.BOS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, **named, clean_up_tokenization_spaces=False, split_special_tokens=True,
        chat_template=PLAIN_CHAT_TEMPLATE, **({"model_max_length": context} if context else {}))


def save_hf_tokenizer(tokenizer: ByteTokenizer | CharTokenizer, path: str | Path, context: int | None = None) -> None:
    """`hf_tokenizer(tokenizer, context)` saved to the directory `path` (tokenizer.json, tokenizer_config.json,
    chat_template.jinja)."""
    hf_tokenizer(tokenizer, context).save_pretrained(str(path))
    # transformers 5 names its class TokenizersBackend, which transformers 4 (as vLLM's pin installs) cannot find;
    # both load the name they share
    config = Path(path) / "tokenizer_config.json"
    body = json.loads(config.read_text(encoding="utf-8"))
    body["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def _with_specials(vocab: dict[str, int], tokenizer: ByteTokenizer | CharTokenizer) -> dict[str, int]:
    return {**vocab, "<pad>": tokenizer.PAD, "<bos>": tokenizer.BOS, "<eos>": tokenizer.EOS}


def byte_alphabet() -> dict[str, int]:
    """The character byte-level tokenizers write each byte as, to the byte (GPT-2's `bytes_to_unicode`, the table
    the `ByteLevel` pre-tokenizer applies): printable Latin-1 bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
