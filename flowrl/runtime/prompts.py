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
    """A model's prompt texts -> token ids: BOS first where the tokenizer has one, the prompt's end kept when
    it leaves fewer than `max_tokens` of the model's `context` for the response."""

    tokenizer: Tokenizer
    context: int

    def tokens(self, text: str) -> list[int]:
        """A prompt's whole token ids, BOS first where the tokenizer has one (once: a chat template that writes
        `bos_token` itself, as Llama's and Mistral's do, already put it there)."""
        row = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_id
        return [bos, *row] if bos is not None and row[:1] != [bos] else row

    def room(self, max_tokens: int) -> int:
        """The most prompt tokens that leave `max_tokens` of the context for the response (at least one); a run
        leaves longer prompts out of its data at the start (flowrl.runtime.overlong), so none is cut here."""
        return max(1, self.context - max_tokens)

    def ids(self, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
        return [self.tokens(text)[-self.room(max_tokens):] for text in texts]


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
