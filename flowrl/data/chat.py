"""Chat-message prompts rendered to text (flowrl.data): the model's own chat template for `hf:` models, and a
simple documented one for tiny models, so a data set of messages feeds any policy.

The tiny template (`render_plain`) writes each message's content on its own line, roles left out — a tiny
character model has no roles and its charset may not even hold their letters:

    [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="}]  ->  "add\\n2+3="

(no newline after the last message: the model continues the last message's text, which for single-message
prompts is exactly the plain-text prompt.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["is_chat", "render_chat", "render_plain"]


def is_chat(value: Any) -> bool:
    """A prompt given as chat messages: a list of {"role": ..., "content": ...} dicts."""
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def render_plain(messages: Sequence[Mapping[str, str]]) -> str:
    """The tiny models' template: contents joined by newlines."""
    return "\n".join(str(m["content"]) for m in messages)


def render_chat(messages: Sequence[Mapping[str, str]], tokenizer: Any = None) -> str:
    """The prompt text of `messages` for a model whose tokenizer is `tokenizer`: an `HFTokenizer` with a chat
    template renders with it (`add_generation_prompt`: the assistant's turn opened); anything else (tiny models,
    HF tokenizers without a template) uses `render_plain`."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and getattr(hf, "chat_template", None):
        return str(hf.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True))
    return render_plain(messages)
