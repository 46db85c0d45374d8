"""Prompts too long for the model that generates from them (flowrl.runtime): left out of a run's data when it
starts, counted and said, as verl's `data.filter_overlong_prompts` does, rather than cut to their end by the
worker (`PromptEncoder.ids` keeps a prompt's last `room` tokens, which loses the question's start).

A prompt is too long for a generate node when its tokens (rendered as that model sees it: chat messages with
its chat template, BOS first) exceed the model's `context` less the node's `max_tokens`: exactly the prompts
the worker would cut. Generation in an environment (`env = ...`) budgets whole trajectories instead and is
left alone. `flowrl check` counts the same prompts for tiny models (dsl/checks.py), whose tokenizer needs no
files; an `hf:` model's tokenizer is loaded here, once, at the start of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowrl.data.chat import is_chat, render_chat
from flowrl.data.jsonl import PromptLoader
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph, ModelDecl
from flowrl.models.sources import tiny_tokenizer
from flowrl.models.tokenizer import HFTokenizer, Tokenizer
from flowrl.runtime.prompts import PromptEncoder

__all__ = ["Overlong", "filter_overlong", "tokenizer_of"]


@dataclass(frozen=True)
class Overlong:
    """What `filter_overlong` left out of one data set for one generate node."""

    data: str
    model: str
    dropped: int  # prompts left out
    rows: int  # prompts there were
    room: int  # the most prompt tokens the model's context leaves beside `max_tokens`
    context: int
    max_tokens: int
    longest: int  # the longest prompt's tokens

    def message(self) -> str:
        return (f"data `{self.data}`: {self.dropped} of {self.rows} prompts are longer than the {self.room} tokens "
                f"model `{self.model}` leaves them (context {self.context}, max_tokens {self.max_tokens}; the "
                f"longest has {self.longest}); they are left out of the run")

    def to_json(self) -> dict[str, Any]:
        return {"data": self.data, "model": self.model, "dropped": self.dropped, "rows": self.rows, "room": self.room,
                "context": self.context, "max_tokens": self.max_tokens, "longest": self.longest}


def tokenizer_of(decl: ModelDecl) -> Tokenizer:
    """The tokenizer a worker builds for `decl` (flowrl.models.build), without its weights."""
    if decl.source.startswith("hf:"):
        return HFTokenizer(decl.source[3:])
    return tiny_tokenizer(decl.config)


def _text(value: Any, tokenizer: Tokenizer) -> str:
    return render_chat(value, tokenizer) if is_chat(value) else str(value)


def filter_overlong(graph: Graph, loaders: Mapping[str, PromptLoader]) -> list[Overlong]:
    """Drop from each loader the rows whose prompt is too long for a generate node reading it (see the module
    docstring); what was dropped, per data set and node (nothing when every prompt fits). FlowError when no
    prompt of a data set fits."""
    out: list[Overlong] = []
    tokenizers: dict[str, Tokenizer] = {}
    for node in graph.nodes:
        data = dict(node.inputs).get("prompts")
        loader = loaders.get(str(data)) if node.op == "generate" and data is not None else None
        if loader is None or node.model is None or isinstance(node.attrs.get("env"), Mapping):
            continue
        decl = graph.model(node.model)
        if decl.source not in tokenizers:
            tokenizers[decl.source] = tokenizer_of(decl)
        max_tokens = int(str(node.attrs.get("max_tokens", 256)))
        enc = PromptEncoder(tokenizers[decl.source], int(str(decl.config.get("context", 512) or 512)))
        room = enc.room(max_tokens)
        lengths = [len(enc.tokens(_text(row.get(loader.prompt_key, ""), enc.tokenizer))) for row in loader.rows]
        keep = [row for row, n in zip(loader.rows, lengths, strict=True) if n <= room]
        if len(keep) == len(loader.rows):
            continue
        found = Overlong(str(data), decl.name, len(loader.rows) - len(keep), len(loader.rows), room, enc.context,
                         max_tokens, max(lengths))
        if not keep:
            raise FlowError(Diagnostic(f"every prompt of data `{data}` is longer than the {room} tokens model "
                                       f"`{decl.name}` leaves them (context {enc.context}, max_tokens {max_tokens}; "
                                       f"the shortest has {min(lengths)})",
                                       hint="lower `max_tokens`, or use a model with more positions"))
        loader.rows = keep
        out.append(found)
    return out
