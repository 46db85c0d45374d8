"""A step's prompts as a model sees them (flowrl.runtime): the texts (chat messages rendered with the model's
template), their token ids under the model's context (`PromptEncoder`), and each prompt's slot in its step's
batch, which keys its samples' random streams. `ModelWorker.generate` and its streamed forms read prompts
through these, and so do drivers that plan by tokens (the serverless backend's prefill planning).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowrl.data.chat import render_chat
from flowrl.models.tokenizer import Tokenizer
from flowrl.runtime.batch import Batch


@dataclass(frozen=True)
class PromptEncoder:
    """A model's prompt texts -> token ids: BOS first where the tokenizer has one (`with_bos`: one, even when a
    chat template wrote it), the prompt's end (and its BOS) kept when it leaves fewer than `max_tokens` of the
    model's `context` for the response."""

    tokenizer: Tokenizer
    context: int

    def tokens(self, text: str) -> list[int]:
        """A prompt's whole token ids, one BOS first where the tokenizer has one (see `with_bos`)."""
        return with_bos(self.tokenizer, self.tokenizer.encode(text))

    def room(self, max_tokens: int) -> int:
        """The most prompt tokens that leave `max_tokens` of the context for the response (at least one); a run
        leaves longer prompts out of its data at the start (flowrl.runtime.overlong), so none is cut here."""
        return max(1, self.context - max_tokens)

    def ids(self, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
        return [keep_end(self.tokens(text), self.room(max_tokens), self.tokenizer) for text in texts]


def with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """A prompt's ids with the tokenizer's BOS first, where it has one: prepended unless the text already began with
    it (a chat template that writes it: Llama-2/3's, Mistral's, Gemma's), so never two."""
    bos = tokenizer.bos_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def keep_end(ids: list[int], keep: int, tokenizer: Tokenizer) -> list[int]:
    """A prompt's ids cut to `keep` tokens (at least one) by dropping tokens after its BOS: its end is kept, and its
    BOS too (a model trained with one sees one)."""
    keep = max(1, keep)
    if len(ids) <= keep:
        return ids
    lead = 1 if tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id] and keep > 1 else 0
    return ids[:lead] + ids[len(ids) - (keep - lead):]


def prompt_texts(prompts: Batch, tokenizer: Tokenizer) -> list[str]:
    """A prompt batch's texts for a model: chat-message prompts ("messages", from the data) rendered with the
    model's chat template (`render_chat`: the plain template for tiny models), text prompts as they are."""
    messages = prompts.meta.get("messages") or [None] * prompts.size
    return [str(p) if m is None else render_chat(m, tokenizer)
            for p, m in zip(prompts.meta["prompt"], messages, strict=True)]


def prompt_slots(prompts: Batch, first: int = 0) -> list[int]:
    """Each prompt's slot in its step's whole batch, which its samples' random streams are keyed by (so a split
    or reordered batch samples alike): the prompts' "prompt_slot" (the controller numbers a step's prompts), else
    their places here counted from `first`."""
    return [int(s) for s in prompts.meta.get("prompt_slot", range(first, first + prompts.size))]
