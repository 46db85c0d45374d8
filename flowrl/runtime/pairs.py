"""Preference pairs and demonstrations as token batches (flowrl.runtime): what a `reward_model`'s or a policy's
preference update, and a forward over pairs, run on.

A data batch of preference rows (`prompt`, `chosen`, `rejected`) becomes 2B rows, the chosen response of pair i
at row 2i and its rejected one at row 2i + 1, both under pair i's prompt (`group_id` = i, so the share-prefix
pass computes the prompt once for the two); `pair_side` is 0 on chosen rows, 1 on rejected ones. Demonstrations
(`prompt`, `response`) become B rows. Responses end with EOS (the model learns to stop, as TRL's trainers do);
a prompt given as chat messages is rendered first (flowrl.data.chat), and gets the tokenizer's BOS unless its
template wrote one. When prompt + response pass the model's `context`, a pair's prompt is cut once for both its
sides (its end and its BOS kept) and each response keeps its start (TRL's `keep_start` for the completion).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from flowrl.data.chat import render_chat
from flowrl.data.tables import is_chat
from flowrl.engines.generation import left_pad_prompts
from flowrl.models.tokenizer import Tokenizer
from flowrl.runtime.batch import Batch
from flowrl.runtime.prompts import keep_end, with_bos

__all__ = ["demo_batch", "pair_batch", "prompt_text"]


def prompt_text(prompt: Any, tokenizer: Tokenizer) -> str:
    """A row's prompt as text: chat messages rendered with the model's template, text as it is."""
    return render_chat(prompt, tokenizer) if is_chat(prompt) else str(prompt)


def _encode(tokenizer: Tokenizer, prompt: str, responses: Sequence[str],
            context: int) -> tuple[list[int], list[list[int]]]:
    """A prompt's ids and its responses' (each ending with EOS), cut to `context` together: the prompt is cut
    once for all of them (a pair's two sides are read under the same prompt, as TRL's `tokenize_row` cuts a pair's
    prompt once), as little as the longest response needs and to no less than half the context, its end and its
    BOS kept; then each response keeps its start."""
    p = with_bos(tokenizer, tokenizer.encode(prompt))
    rs = [[*tokenizer.encode(r), tokenizer.eos_id] for r in responses]
    longest = max(len(r) for r in rs)
    if len(p) + longest > context:
        p = keep_end(p, max(context // 2, context - longest), tokenizer)
        rs = [r[: max(1, context - len(p))] for r in rs]
    return p, rs


def _tensors(pairs: Sequence[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    prompt_ids, prompt_mask = left_pad_prompts([p for p, _ in pairs], pad, torch.device("cpu"))  # (R, P)
    length = max(len(r) for _, r in pairs)
    response_ids = torch.full((len(pairs), length), pad, dtype=torch.long)
    response_mask = torch.zeros((len(pairs), length), dtype=torch.long)
    for i, (_, r) in enumerate(pairs):
        response_ids[i, : len(r)] = torch.tensor(r)  # right-padded responses
        response_mask[i, : len(r)] = 1
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask}


def _rows(batch: Batch) -> list[Mapping[str, Any]]:
    rows: list[Mapping[str, Any]] = batch.meta.get("row") or [{"prompt": p} for p in batch.meta["prompt"]]
    return rows


def pair_batch(batch: Batch, tokenizer: Tokenizer, context: int,
               render: Callable[[Any, Tokenizer], str] = prompt_text) -> Batch:
    """2B rows from B preference rows: chosen at 2i, rejected at 2i + 1 (see the module docstring)."""
    encoded: list[tuple[list[int], list[int]]] = []
    meta: dict[str, list[Any]] = {k: [] for k in batch.meta}
    meta["response"] = []
    for i, row in enumerate(_rows(batch)):
        sides = [str(row["chosen"]), str(row["rejected"])]
        prompt, (chosen, rejected) = _encode(tokenizer, render(row["prompt"], tokenizer), sides, context)
        encoded += [(prompt, chosen), (prompt, rejected)]
        for side in sides:
            meta["response"].append(side)
            for k, v in batch.meta.items():
                meta[k].append(v[i])
    tensors = _tensors(encoded, tokenizer.pad_id)
    size = len(encoded)
    tensors["group_id"] = torch.arange(size) // 2
    tensors["pair_side"] = torch.arange(size) % 2
    return Batch(size, tensors, meta, primary="response_ids")


def demo_batch(batch: Batch, tokenizer: Tokenizer, context: int,
               render: Callable[[Any, Tokenizer], str] = prompt_text) -> Batch:
    """B rows from B demonstration rows (`prompt`, `response`)."""
    rows = _rows(batch)
    encoded = [(p, r) for p, (r,) in (_encode(tokenizer, render(row["prompt"], tokenizer), [str(row["response"])],
                                              context) for row in rows)]
    tensors = _tensors(encoded, tokenizer.pad_id)
    tensors["group_id"] = torch.arange(len(rows))
    meta = {**batch.meta, "response": [str(row["response"]) for row in rows]}
    return Batch(len(rows), tensors, meta, primary="response_ids")
