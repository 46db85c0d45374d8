"""Tokenizers for flowrl models (flowrl.models): a file-free byte tokenizer and a local HF wrapper.

Both satisfy the `Tokenizer` protocol that the generation engine and the reward/data code rely on. Neither ever
touches the network: `ByteTokenizer` is built in code and `HFTokenizer` only reads local files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the engines need from a tokenizer; `encode` never adds special tokens."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then `<pad>`=256, `<bos>`=257, `<eos>`=258 (vocab 259)."""

    PAD = 256
    BOS = 257
    EOS = 258
    VOCAB = 259

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return self.VOCAB

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def bos_id(self) -> int | None:
        return self.BOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Specials and ids beyond the byte range (a model vocab may be padded past 259) carry no text.
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class CharTokenizer:
    """A fixed character set as ids 0..len-1, then `<pad>`, `<bos>`, `<eos>`, `<unk>`: a tiny vocabulary, so
    tiny models spend no capacity (or exploration) on tokens a task never uses."""

    def __init__(self, charset: str):
        chars = list(dict.fromkeys(charset))  # unique, order kept
        if not chars:
            raise ValueError("charset must contain at least one character")
        self.chars = "".join(chars)
        self._index = {c: i for i, c in enumerate(chars)}
        n = len(chars)
        self.PAD, self.BOS, self.EOS, self.UNK = n, n + 1, n + 2, n + 3

    @property
    def name(self) -> str:
        return f"chars:{self.chars}"

    @property
    def vocab_size(self) -> int:
        return self.UNK + 1

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def bos_id(self) -> int | None:
        return self.BOS

    def encode(self, text: str) -> list[int]:
        return [self._index.get(c, self.UNK) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids if 0 <= int(i) < len(self.chars))

    def __repr__(self) -> str:
        return f"CharTokenizer({self.chars!r})"


class HFTokenizer:
    """A `transformers` tokenizer loaded from a local directory (never downloads)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._path = path
        self._tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer at {path!r} defines no eos token; generation needs one to stop")
        self._eos = int(eos)
        pad = self._tok.pad_token_id
        # Many causal-LM tokenizers ship without a pad token; padding is always masked, so EOS is a safe filler.
        self._pad = int(pad) if pad is not None else self._eos
        bos = self._tok.bos_token_id
        self._bos = int(bos) if bos is not None else None

    @property
    def hf(self) -> Any:
        """The wrapped `transformers` tokenizer (for chat templates and the like)."""
        return self._tok

    @property
    def name(self) -> str:
        return f"hf:{self._path}"

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens, which `vocab_size` on HF tokenizers leaves out.
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int | None:
        return self._bos

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({self._path!r})"
